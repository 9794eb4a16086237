"""The program shrinker: a failing program made smaller and simpler by replaying it, no Hypothesis.

:func:`shrink_program` works on the program's own units (steps, windows,
heads, head_dim, values), where Hypothesis's shrinker works on the choices that
drew them; see its note for why, and ``docs/testing.md`` for the measurement.

>>> from pagedkv.testing.program import AttendStep, OpenStep
>>> steps = [OpenStep("cache_0", 4)] + [AttendStep("cache_0", [0.5], [0.5], [t]) for t in (1.0, 9.0)]
>>> shrink_program(steps, lambda program: any(s.v == [9.0] for s in program[1:]))
[OpenStep(name='cache_0', max_size=1), AttendStep(name='cache_0', q=[0.0], k=[0.0], v=[9.0], expected=None)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.testing.program import AttendStep, CloseStep, OpenStep, Step

__all__ = ["shrink_program"]


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
