"""The engine of ``pagedkv check MODULE:FACTORY``: load the factory, check the options fit.

:func:`load_factory` imports the factory (the current directory is searched first, as with
``python -m``); :func:`pagedkv.testing.check_cache` then drives the caches it builds beside the
oracle. The command line around it (parser, verdict printing) is :mod:`pagedkv.cli.check`.
Only the standard library is imported here: Hypothesis loads when the command runs.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "MAX_TOKEN_VALUES",
    "UsageError",
    "check_token_size",
    "load_factory",
    "require_hypothesis",
]

#: The most values Hypothesis draws in one list (its ``BUFFER_SIZE``); the kit draws a
#: token's q, k and v as one flat list, so the largest token must fit.
MAX_TOKEN_VALUES = 8 * 1024


class UsageError(Exception):
    """The command line cannot be acted on; the message says why (exit status 2)."""


def require_hypothesis() -> None:
    """Check that Hypothesis imports, which the state machine needs.

    Raises:
        UsageError: it does not; the message names the extra that brings it.
    """
    try:
        import hypothesis  # noqa: F401 - imported to see that it can be
    except ImportError as error:
        raise UsageError(
            f"the conformance state machine needs Hypothesis, which did not import ({error}); "
            'install the test extra: pip install "pagedkv[test]"'
        ) from None


def check_token_size(heads: Sequence[str], head_dim: int, max_heads: int) -> None:
    """Check that the largest token the options draw fits in one Hypothesis list.

    A token is ``q`` plus ``k`` and ``v``: ``3 x head_dim`` values one-head,
    ``3 x heads x head_dim`` multi-head, at most ``2 x heads x head_dim``
    grouped-query (``num_kv_heads <= heads // 2``).

    Raises:
        UsageError: the largest token has more than :data:`MAX_TOKEN_VALUES` values.

    >>> check_token_size(["one-head"], 2730, 4)
    """
    num_values = {"one-head": 3, "multi-head": 3 * max_heads, "grouped-query": 2 * max(2, max_heads)}
    layout = max(heads, key=num_values.__getitem__)
    largest = head_dim * num_values[layout]
    if largest > MAX_TOKEN_VALUES:
        raise UsageError(
            f"--head-dim {head_dim} and --max-heads {max_heads} draw {layout} tokens of up to "
            f"{largest:,} values (q, k and v), Hypothesis at most {MAX_TOKEN_VALUES:,}: "
            "give a smaller --head-dim or --max-heads"
        )


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``MODULE:FACTORY`` (``FACTORY`` may be dotted) and check it can take ``max_size``.

    Args:
        spec: e.g. ``"pagedkv:KVCache"``.

    Returns:
        The factory.

    Raises:
        UsageError: a bad spec, a module that does not import, a missing or
            uncallable attribute, or a signature without ``max_size``.

    >>> load_factory("pagedkv:KVCache").__name__
    'KVCache'
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"expected MODULE:FACTORY (e.g. pagedkv:KVCache), got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m` does, so local modules import
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"cannot import module {module_name!r}: {error}") from error
    except Exception as error:
        raise UsageError(
            f"importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise UsageError(f"{spec} is a {type(found).__name__}, not a callable factory")
    try:
        inspect.signature(found).bind(max_size=None)
    except TypeError as error:
        raise UsageError(f"{spec} cannot be called as factory(max_size=None): {error}") from error
    except ValueError:  # no signature (a builtin): try it when the machine runs
        pass
    return found  # type: ignore[no-any-return]
