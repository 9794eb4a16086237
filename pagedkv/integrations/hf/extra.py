"""Loading the ``hf`` extra (torch, transformers) when it is used, not when pagedkv is imported.

NOTE: torch and transformers are loaded by name (``importlib``), so that
``import pagedkv.integrations.transformers``, the doctest run and ``mypy`` need
numpy alone; to mypy their objects are ``Any``. Building a cache or
registering the attention without the extra raises ``ImportError`` naming it.

>>> require("math").sqrt(4.0)
2.0
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["HF_EXTRA_HINT", "optional_class", "require"]

#: How to install what this package needs.
HF_EXTRA_HINT = "pip install 'pagedkv[hf]' (torch and transformers)"


def require(module: str) -> Any:
    """Import ``module``; without it, an ``ImportError`` that names the ``hf`` extra.

    >>> require("no_such_module_here")
    Traceback (most recent call last):
    ...
    ImportError: pagedkv.integrations.transformers needs no_such_module_here: pip install 'pagedkv[hf]' ...
    """
    # NOTE: a loaded module straight from ``sys.modules``: ``import_module``'s
    # own lookup runs in Python, and a decode step calls this a few times a layer.
    loaded = sys.modules.get(module)
    if loaded is not None:
        return loaded
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"pagedkv.integrations.transformers needs {module}: {HF_EXTRA_HINT}") from error


class _NeedsExtra:
    """Stands in for a transformers base class when transformers is missing; building one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(f"pagedkv.integrations.transformers needs torch and transformers: {HF_EXTRA_HINT}")


def optional_class(module: str, name: str) -> Any:
    """``module.name`` (a class to subclass), or a stand-in whose construction raises ``ImportError``.

    >>> optional_class("no_such_module_here", "Cache")()
    Traceback (most recent call last):
    ...
    ImportError: pagedkv.integrations.transformers needs torch and transformers: pip install 'pagedkv[hf]' ...
    """
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return _NeedsExtra
