"""The calls a state-machine run made, and how to print them as a runnable Python program.

The machine records every step (a cache built by the factory, an ``attend``)
as it runs. When a run fails, :func:`render_program` turns the shrunk run's
steps into a standalone script: it imports the factory, builds each cache
wrapped in :class:`~pagedkv.testing.contract.CheckedCache`, and replays the
``attend`` calls with their exact float values; the last line raises the same
error. No Hypothesis is needed to run it.

>>> code = FactoryCode.from_spec("pagedkv.testing.buggy:EvictsAfterScoring")
>>> steps = [OpenStep("cache_0", 1), AttendStep("cache_0", [0.0], [0.0], [1.0], [1.0])]
>>> print(render_program(steps, factory=code, failure="..."))  # doctest: +ELLIPSIS
# The shrunk failing program found by pagedkv's conformance state machine.
...
from pagedkv.testing.buggy import EvictsAfterScoring
from pagedkv.testing.contract import CheckedCache
<BLANKLINE>
cache_0 = CheckedCache(EvictsAfterScoring(max_size=1), max_size=1, name='cache_0')
cache_0.attend([0.0], [0.0], [1.0])  # oracle: [1.0]  <- fails here
<BLANKLINE>
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv.testing.contract import CheckedCache, ContractError, Precision

__all__ = [
    "AttendStep",
    "CloseStep",
    "FactoryCode",
    "OpenStep",
    "Step",
    "describe_factory",
    "feed_value",
    "render_program",
    "replay",
    "shrink_program",
]


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


# --------------------------------------------------------------------- steps


@dataclass
class OpenStep:
    """``name = factory(max_size=max_size)``.

    Args:
        name: the cache's variable name.
        max_size: the window it was built with.
    """

    name: str
    max_size: int | None


@dataclass
class AttendStep:
    """``name.attend(q, k, v)``, with the oracle's output when it was computed.

    Args:
        name: the cache's variable name.
        q: the query, as nested lists of floats.
        k: the key.
        v: the value.
        expected: the oracle's output (``None`` until computed).
    """

    name: str
    q: Any
    k: Any
    v: Any
    expected: Any = None


@dataclass
class CloseStep:
    """``name.cache.close()`` (the machine closes every cache at the end of a run).

    Args:
        name: the cache's variable name.
    """

    name: str


Step = OpenStep | AttendStep | CloseStep


def _comment(text: str) -> list[str]:
    return [f"#   {line}".rstrip() for line in text.splitlines()] or ["#"]


def render_program(
    steps: Sequence[Step],
    *,
    factory: FactoryCode | None,
    label: str = "",
    feed: Literal["lists", "arrays"] = "lists",
    precision: Precision = "float64",
    scale: float = 1.0,
    failure: str | None = None,
) -> str:
    """The steps as a standalone Python program whose last line fails as the run did.

    Args:
        steps: the recorded steps, in order.
        factory: code naming the factory; ``None`` writes a placeholder to fill in.
        label: how to name the factory in the header comment.
        feed: ``"arrays"`` passes numpy arrays, as the machine did.
        precision: the precision given to :class:`CheckedCache` (and the arrays' dtype).
        scale: the score scale given to :class:`CheckedCache`.
        failure: the error message, quoted in the header.

    Returns:
        The program's source, ending in a newline.
    """
    lines = ["# The shrunk failing program found by pagedkv's conformance state machine."]
    if label:
        lines.append(f"# Cache factory: {label}")
    lines.append("# Run it with python: it replays the calls, checks each output against the")
    lines.append("# oracle, and its last line raises" + (":" if failure else "."))
    if failure:
        lines += _comment(failure)
    lines.append("")
    if feed == "arrays":
        lines.append("import numpy as np")
    imports = ["from pagedkv.testing.contract import CheckedCache"]
    if factory is not None:
        imports += [line for line in factory.imports if line not in imports]
    lines += sorted(imports, key=lambda line: (not line.startswith("import"), line))
    lines.append("")
    if factory is None:
        name = "factory"
        lines.append("factory = ...  # could not name the factory (a lambda?): write it here")
    elif factory.expression.isidentifier():
        name = factory.expression
    else:
        name = "factory"
        lines.append(f"factory = {factory.expression}")
    extra = "" if scale == 1.0 else f", scale={scale!r}"
    extra += "" if precision == "float64" else f", precision={precision!r}"
    dtype = "" if precision == "float64" else ", dtype=np.float32"

    def fed(x: Any) -> str:
        return f"np.array({x!r}{dtype})" if feed == "arrays" else repr(x)

    for index, step in enumerate(steps):
        if isinstance(step, OpenStep):
            size = step.max_size
            call = f"{name}(max_size={size})"
            line = f"{step.name} = CheckedCache({call}, max_size={size}{extra}, name={step.name!r})"
        elif isinstance(step, AttendStep):
            line = f"{step.name}.attend({fed(step.q)}, {fed(step.k)}, {fed(step.v)})"
            if step.expected is not None:
                expected = repr(step.expected)
                line += f"  # oracle: {expected if len(expected) <= 80 else expected[:77] + '...'}"
        else:
            line = f"{step.name}.cache.close()"
        if index == len(steps) - 1 and failure:
            line += "  <- fails here" if "  # " in line else "  # <- fails here"
        lines.append(line)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ replay, shrink


def feed_value(x: Any, feed: Literal["lists", "arrays"], precision: Precision) -> Any:
    """A token as the machine passes it: the nested list itself, or a numpy array of it.

    Args:
        x: nested lists of floats.
        feed: ``"lists"`` or ``"arrays"``.
        precision: the arrays' dtype.

    Returns:
        ``x``, or a new array.
    """
    if feed == "lists":
        return x
    import numpy as np  # only the arrays feed needs it

    return np.array(x, dtype=np.float64 if precision == "float64" else np.float32)


def replay(
    steps: Sequence[Step],
    factory: Callable[..., Any],
    *,
    feed: Literal["lists", "arrays"] = "lists",
    precision: Precision = "float64",
    scale: float = 1.0,
    close: bool = True,
) -> ContractError | None:
    """Run ``steps`` again, as the reproducer would, and return the error it raises (if any).

    Every cache still open at the end is closed (when ``close``), errors
    suppressed, so a shared pool gets its blocks back.

    Args:
        steps: the program.
        factory: the cache factory.
        feed: how tokens are passed.
        precision: the caches' precision.
        scale: the caches' score scale.
        close: close the caches left open.

    Returns:
        The :class:`ContractError` the program raised, or ``None`` if it ran clean.
    """
    caches: dict[str, CheckedCache] = {}
    try:
        for step in steps:
            if isinstance(step, OpenStep):
                try:
                    cache = factory(max_size=step.max_size)
                except Exception as error:
                    raise ContractError(
                        f"factory(max_size={step.max_size}) raised {type(error).__name__}: {error}",
                        kind="factory",
                    ) from error
                caches[step.name] = CheckedCache(
                    cache, max_size=step.max_size, scale=scale, precision=precision, name=step.name
                )
            elif isinstance(step, AttendStep):
                checked = caches[step.name]
                try:
                    fed = [feed_value(x, feed, precision) for x in (step.q, step.k, step.v)]
                    checked.attend(*fed)
                finally:
                    step.expected = checked.last_expected
            else:
                caches.pop(step.name).cache.close()
    except ContractError as error:
        return error
    except Exception as error:  # close() failing, or a bad program
        name = type(error).__name__
        return ContractError(f"{name}: {error}", kind=f"raised {name}")
    finally:
        if close:
            for checked in caches.values():
                closer = getattr(checked.cache, "close", None)
                if callable(closer):
                    with suppress(Exception):
                        closer()
    return None


def shrink_program(
    steps: Sequence[Step],
    still_fails: Callable[[list[Step]], bool],
    *,
    max_replays: int = 1000,
) -> list[Step]:
    """Make a failing program smaller and simpler while it still fails; replays, no Hypothesis.

    NOTE: Hypothesis shrinks the choices that drew a run. A step draws
    ``1 + 3 * head_dim`` or more of them, and its deletion passes remove at most
    five at a time, so runs stay long, and each attempt replays the whole run:
    on long runs it spent seconds and still left steps behind. Here the units are
    the program's own: steps (deleted in halving chunks, as in delta
    debugging), windows (smaller ``max_size``), heads and head_dim (dropped from
    every token at once), and values (0, then integers, then the smallest
    power of ten or integer that still fails). Passes repeat until none helps.

    Args:
        steps: a failing program.
        still_fails: replays a candidate and says whether it fails the same way.
        max_replays: stop after this many replays.

    Returns:
        The smallest failing program found (a new list; ``steps`` is unchanged).
    """
    search = _Search([_copy(step) for step in steps], still_fails, max_replays)
    for _ in range(4):
        before = _size(search.best())
        _delete_steps(search.best, search.attempt)
        _smaller_windows(search.best, search.attempt)
        _narrower_tokens(search.best, search.attempt)
        _simpler_values(search.best, search.attempt)
        if _size(search.best()) >= before or search.budget <= 0:
            break
    return _renumber([_copy(step) for step in search.best()])


class _Search:
    """The best failing program so far, and the replays left to improve it."""

    def __init__(
        self, steps: list[Step], still_fails: Callable[[list[Step]], bool], budget: int
    ) -> None:
        self._best = steps
        self._still_fails = still_fails
        self.budget = budget

    def best(self) -> list[Step]:
        return self._best

    def attempt(self, candidate: list[Step]) -> bool:
        """Keep ``candidate`` if it is well formed and still fails."""
        if self.budget <= 0 or not _well_formed(candidate):
            return False
        self.budget -= 1
        if self._still_fails([_copy(step) for step in candidate]):
            self._best = candidate
            return True
        return False


_Attempt = Callable[[list[Step]], bool]
_Best = Callable[[], list[Step]]


def _size(steps: list[Step]) -> tuple[int, int, float]:
    """How big a program is: steps, then values, then their total magnitude."""
    values = [x for step in steps if isinstance(step, AttendStep) for x in _tokens_flat(step)]
    windows = sum(s.max_size or 0 for s in steps if isinstance(s, OpenStep))
    return (len(steps), len(values) + windows, sum(min(abs(x), 1e300) for x in values))


def _tokens_flat(step: AttendStep) -> list[float]:
    return _flat(step.q) + _flat(step.k) + _flat(step.v)


def _delete_steps(best: _Best, attempt: _Attempt) -> None:
    chunk = max(1, len(best()) // 2)
    while chunk >= 1:
        start = 0
        while start < len(best()):
            candidate = best()[:start] + best()[start + chunk :]
            if not candidate or not attempt(candidate):
                start += chunk
        chunk //= 2


def _smaller_windows(best: _Best, attempt: _Attempt) -> None:
    for index, step in enumerate(best()):
        if isinstance(step, OpenStep) and step.max_size is not None:
            for size in range(1, step.max_size):
                program = best()
                if attempt([*program[:index], OpenStep(step.name, size), *program[index + 1 :]]):
                    break


def _map_tokens(steps: list[Step], q: Callable[[Any], Any], kv: Callable[[Any], Any]) -> list[Step]:
    return [
        AttendStep(step.name, q(step.q), kv(step.k), kv(step.v))
        if isinstance(step, AttendStep)
        else _copy(step)
        for step in steps
    ]


def _narrower_tokens(best: _Best, attempt: _Attempt) -> None:
    """Drop a head_dim component, a key/value head, or a query head per group, from every token."""
    first = next((s for s in best() if isinstance(s, AttendStep)), None)
    if first is None:
        return
    two_d = bool(first.k) and isinstance(first.k[0], list)
    if two_d:
        num_kv, num_q = len(first.k), len(first.q)
        group = num_q // num_kv
        for head in reversed(range(num_kv)):
            if num_kv > 1 and attempt(_map_tokens(best(), *_without_kv_head(head, group))):
                num_kv -= 1
        for member in reversed(range(group)):
            if group > 1 and attempt(_map_tokens(best(), *_without_group_member(member, group))):
                group -= 1
        if num_kv == 1 and group == 1:
            attempt(_map_tokens(best(), _first, _first))
    width = len(first.k[0]) if two_d else len(first.k)
    for column in reversed(range(width)):
        if width == 1:
            break

        def drop(x: Any, c: int = column) -> Any:
            if x and isinstance(x[0], list):
                return [row[:c] + row[c + 1 :] for row in x]
            return x[:c] + x[c + 1 :]

        if attempt(_map_tokens(best(), drop, drop)):
            width -= 1


def _first(x: Any) -> Any:
    return x[0]


def _same(x: Any) -> Any:
    return x


def _without_kv_head(head: int, group: int) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    def q(x: Any) -> Any:
        return x[: head * group] + x[(head + 1) * group :]

    def kv(x: Any) -> Any:
        return x[:head] + x[head + 1 :]

    return q, kv


def _without_group_member(
    member: int, group: int
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    def q(x: Any) -> Any:
        return [h for i, h in enumerate(x) if i % group != member]

    return q, _same


def _simpler_values(best: _Best, attempt: _Attempt) -> None:
    index = 0
    while index < len(best()):
        step = best()[index]
        if isinstance(step, AttendStep):
            for field in ("q", "k", "v"):
                for position in range(len(_flat(getattr(step, field)))):
                    _simplify_one(best, attempt, index, field, position)
        index += 1


def _simplify_one(best: _Best, attempt: _Attempt, index: int, field: str, position: int) -> None:
    def attempt_value(value: float) -> bool:
        program = best()
        step = program[index]
        assert isinstance(step, AttendStep)
        changed = _copy(step)
        setattr(changed, field, _set_flat(getattr(step, field), position, value))
        return attempt([*program[:index], changed, *program[index + 1 :]])

    def current() -> float:
        step = best()[index]
        assert isinstance(step, AttendStep)
        return _flat(getattr(step, field))[position]

    x = current()
    if x == 0.0:
        if math.copysign(1.0, x) < 0:  # -0.0 reads worse than 0.0
            attempt_value(0.0)
        return
    if attempt_value(0.0):
        return
    sign = math.copysign(1.0, x)
    if x < 0 and attempt_value(-x):  # positive reads better
        x, sign = -x, 1.0
    integral = x == math.trunc(x) or abs(x) >= 1e15
    towards_zero = abs(x) >= 1.0 and not integral and attempt_value(float(math.trunc(x)))
    if towards_zero or (not integral and attempt_value(float(math.trunc(x)) + sign)):
        x = current()
    if abs(x) < 1.0:
        for small in (1.0, 0.5):
            if abs(x) != small and attempt_value(sign * small):
                return
        return
    # The smallest power of ten that still fails (a binary search over exponents;
    # ``exponent + 1`` stands for x itself), then, if small, the smallest integer.
    low, high = -1, math.floor(math.log10(abs(x))) + 1
    while high - low > 1:
        middle = (low + high) // 2
        if 10.0**middle != abs(x) and attempt_value(sign * 10.0**middle):
            high = middle
        else:
            low = middle
    x = current()
    if abs(x) <= 1e6 and x == math.trunc(x):
        low, high = 0, int(abs(x))  # 0 passes, |x| fails
        while high - low > 1:
            middle = (low + high) // 2
            if attempt_value(sign * middle):
                high = middle
            else:
                low = middle


def _copy(step: Step) -> Step:
    if isinstance(step, AttendStep):
        return AttendStep(step.name, step.q, step.k, step.v, step.expected)
    if isinstance(step, OpenStep):
        return OpenStep(step.name, step.max_size)
    return CloseStep(step.name)


def _well_formed(steps: Sequence[Step]) -> bool:
    """Every attend and close names a cache opened (and not closed) before it."""
    live: set[str] = set()
    for step in steps:
        if isinstance(step, OpenStep):
            live.add(step.name)
        elif step.name not in live:
            return False
        elif isinstance(step, CloseStep):
            live.discard(step.name)
    return True


def _flat(x: Any) -> list[float]:
    return [v for row in x for v in row] if x and isinstance(x[0], list) else list(x)


def _set_flat(x: Any, position: int, value: float) -> Any:
    if x and isinstance(x[0], list):
        width = len(x[0])
        rows = [list(row) for row in x]
        rows[position // width][position % width] = value
        return rows
    out = list(x)
    out[position] = value
    return out


def _renumber(steps: list[Step]) -> list[Step]:
    """Name the caches ``cache_0, cache_1, ...`` in the order they are opened."""
    names: dict[str, str] = {}
    for step in steps:
        if isinstance(step, OpenStep):
            names[step.name] = f"cache_{len(names)}"
    for step in steps:
        step.name = names.get(step.name, step.name)
    return steps
