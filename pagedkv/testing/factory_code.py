"""Python source that names a cache factory, so a printed program can import it again.

A failing run is printed as a standalone program (:mod:`~pagedkv.testing.program`);
its first lines must rebuild the factory in a fresh interpreter.
:func:`describe_factory` finds that source for module-level classes and
functions and for ``functools.partial`` of them; :class:`FactoryCode` holds it.

>>> FactoryCode.from_spec("pagedkv.testing.buggy:SeedCache").imports
('from pagedkv.testing.buggy import SeedCache',)
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FactoryCode", "describe_factory", "name_factory"]


@dataclass(frozen=True)
class FactoryCode:
    """Python source that names a cache factory: the imports, then an expression.

    Args:
        imports: import lines the expression needs.
        expression: evaluates to the factory.
    """

    imports: tuple[str, ...]
    expression: str

    @classmethod
    def from_spec(cls, spec: str) -> FactoryCode:
        """The code for ``"package.module:name"`` (``name`` may be dotted: ``Class.create``).

        Args:
            spec: ``MODULE:ATTRIBUTE``.

        Returns:
            A ``from MODULE import NAME`` line and the expression.

        Raises:
            ValueError: ``spec`` has no ``:`` or an empty side.

        >>> FactoryCode.from_spec("pagedkv:KVCache")
        FactoryCode(imports=('from pagedkv import KVCache',), expression='KVCache')
        """
        module, sep, attribute = spec.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"expected MODULE:FACTORY, e.g. pagedkv:KVCache, got {spec!r}")
        first = attribute.split(".")[0]
        return cls((f"from {module} import {first}",), attribute)


def _importable(obj: Any) -> FactoryCode | None:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if "<" in qualname or module == "__main__":
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    if found is not obj:
        return None
    return FactoryCode.from_spec(f"{module}:{qualname}")


def _literal(value: Any) -> FactoryCode | None:
    """Source for a partial's argument: a plain literal, or an importable class or function."""
    if value is None or isinstance(value, (bool, int, str)):
        return FactoryCode((), repr(value))
    if isinstance(value, float):
        return FactoryCode((), repr(value)) if math.isfinite(value) else None
    if isinstance(value, (tuple, list)):
        parts = [_literal(item) for item in value]
        if any(part is None for part in parts):
            return None
        codes = [part for part in parts if part is not None]
        inner = ", ".join(code.expression for code in codes)
        brackets = "[]" if isinstance(value, list) else "()"
        comma = "," if isinstance(value, tuple) and len(codes) == 1 else ""
        text = f"{brackets[0]}{inner}{comma}{brackets[1]}"
        return FactoryCode(tuple(line for code in codes for line in code.imports), text)
    if isinstance(value, type) or callable(value):
        return _importable(value)
    return None


def describe_factory(factory: Any) -> FactoryCode | None:
    """Source that rebuilds ``factory`` in a fresh interpreter, or ``None`` if there is none.

    Works for module-level functions and classes (``pagedkv.KVCache``) and for
    ``functools.partial`` of them with literal or importable arguments; not for
    lambdas, local functions or objects defined in ``__main__``.

    Args:
        factory: the cache factory.

    Returns:
        The code, or ``None``.

    >>> from pagedkv import KVCache
    >>> describe_factory(functools.partial(KVCache, block_size=2)).expression
    'functools.partial(KVCache, block_size=2)'
    >>> describe_factory(lambda max_size=None: None) is None
    True
    """
    if isinstance(factory, functools.partial):
        inner = _importable(factory.func)
        if inner is None:
            return None
        parts = [_literal(arg) for arg in factory.args]
        named = {key: _literal(arg) for key, arg in factory.keywords.items()}
        if any(part is None for part in parts) or any(part is None for part in named.values()):
            return None
        codes = [part for part in parts if part is not None]
        keyword_codes = {key: part for key, part in named.items() if part is not None}
        arguments = [inner.expression, *(code.expression for code in codes)]
        arguments += [f"{key}={code.expression}" for key, code in keyword_codes.items()]
        imports = ["import functools", *inner.imports]
        for code in [*codes, *keyword_codes.values()]:
            imports += [line for line in code.imports if line not in imports]
        return FactoryCode(tuple(imports), f"functools.partial({', '.join(arguments)})")
    return _importable(factory)


def name_factory(
    factory: Callable[..., Any], factory_code: FactoryCode | str | None
) -> tuple[FactoryCode | None, str]:
    """The code that imports ``factory`` in a printed program, and how reports name it.

    Args:
        factory: the cache factory.
        factory_code: the code to use, ``"module:name"``, or ``None`` to find it
            with :func:`describe_factory`.

    Returns:
        ``(code, label)``: ``code`` is ``None`` when no source rebuilds the
        factory (a lambda); ``label`` is ``"module:name"``, the partial's
        source, or the factory's ``__qualname__``.

    >>> from pagedkv.testing.buggy import SeedCache
    >>> name_factory(SeedCache, None)[1]
    'pagedkv.testing.buggy:SeedCache'
    >>> name_factory(lambda max_size=None: None, None)
    (None, '<lambda>')
    """
    code = FactoryCode.from_spec(factory_code) if isinstance(factory_code, str) else factory_code
    if code is None:
        code = describe_factory(factory)
    if isinstance(factory_code, str):
        label = factory_code
    elif code is not None and code.expression.startswith("functools.partial("):
        label = code.expression
    elif code is not None:
        label = f"{factory.__module__}:{factory.__qualname__}"
    else:
        label = ""
    return code, label or getattr(factory, "__qualname__", repr(factory))
