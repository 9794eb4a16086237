"""The seed contract as a check: the cache under test beside the oracle, every output compared.

:class:`CheckedCache` wraps any object with the seed's ``attend(q, k, v)`` and raises
:class:`ContractError` when an output has the wrong shape, is not finite or is farther from
the oracle over the last ``min(n, max_size)`` tokens than :func:`error_bounds` allows, or when
``len(cache)`` or ``cache.check_invariants()`` disagrees; the message names the window the
output does match. Pure Python: the state machine and every printed program run through it.
The checks and the error bound: "What the machine checks" in docs/testing.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pagedkv.testing.oracle import FLOAT32_EPS, FLOAT64_EPS, attend, dot, softmax, tolerance

__all__ = [
    "CheckedCache",
    "ContractError",
    "Precision",
    "error_bounds",
    "precision_eps",
]

#: The float type a cache computes in; it sets the tolerance.
Precision = Literal["float64", "float32"]


def precision_eps(precision: Precision) -> float:
    """Machine epsilon of ``precision``.

    Args:
        precision: ``"float64"`` or ``"float32"``.

    Returns:
        ``2**-52`` or ``2**-23``.

    >>> precision_eps("float32") == 2.0**-23
    True
    """
    if precision == "float64":
        return FLOAT64_EPS
    if precision == "float32":
        return FLOAT32_EPS
    raise ValueError(f"precision must be 'float64' or 'float32', got {precision!r}")


class ContractError(AssertionError):
    """A cache broke the seed contract; the message says how, and which window its output matches.

    The explanation is computed the first time the message is read (shrinking
    raises many of these and reads none).
    """

    def __init__(
        self, summary: str, explain: Callable[[], str] | None = None, *, kind: str = "contract"
    ) -> None:
        super().__init__(summary)
        self.summary = summary
        #: What broke: ``"output"``, ``"shape"``, ``"non-finite"``, ``"len"``,
        #: ``"invariants"``, ``"factory"``, ``"raised <ErrorType>"``, or ``"verdict"``
        #: (a whole run's report, from ``Verdict.assert_passed()``).
        self.kind = kind
        self._explain = explain
        self._explanation: str | None = None

    @property
    def explanation(self) -> str:
        """The diagnosis: which window of the token stream the wrong output matches ('' if none)."""
        if self._explanation is None:
            self._explanation = self._explain() if self._explain is not None else ""
        return self._explanation

    def __str__(self) -> str:
        return self.summary + (f"\n{self.explanation}" if self.explanation else "")


# ------------------------------------------------------------------ error model


def _head_bounds(
    query: Sequence[float],
    keys: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    scale: float,
    eps: float,
) -> list[float]:
    weights = softmax([scale * dot(query, key) for key in keys])
    # NOTE: a score's rounding error scales with sum |q_i k_i|, not with |q . k|:
    # q = [1e3, 1e3], k = [1e3, -1e3] scores 0 but carries an error of about
    # eps * 2e6. So the bound uses this "absolute" score, not the score itself.
    peak = max(abs(scale) * sum(abs(x * y) for x, y in zip(query, key)) for key in keys)
    floor = tolerance(0.0, eps) - 16 * eps
    spread = tolerance(len(keys) + (len(query) + 3) * peak, eps) - floor
    # A score error e changes a weight by a factor up to exp(e), not 1 + e: once
    # e nears 1 (float32 scores near 1e7) the weights are undetermined. Then only
    # the values' range bounds the output, which is a weighted mean of them.
    relative = floor + math.expm1(min(spread, 700.0))
    bounds = []
    for i in range(len(values[0])):
        column = [value[i] for value in values]
        linear = relative * max(1.0, sum(w * abs(x) for w, x in zip(weights, column)))
        hull = max(column) - min(column)
        hull += tolerance(len(keys), eps) * max(1.0, max(abs(x) for x in column))
        bounds.append(min(linear, hull))
    return bounds


def error_bounds(
    query: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    *,
    scale: float = 1.0,
    eps: float = FLOAT64_EPS,
) -> list[float]:
    """How far each output value of a correct float kernel may be from the oracle.

    For one query head over ``n`` tokens of head_dim ``d``, with
    ``A = max_j |scale| * sum_i |q_i * k_ji|`` (the largest score computed
    without cancellation), ``V_c = sum_j w_j * |v_jc|`` (the output with every
    value made positive) and ``floor`` the oracle's (``1e-13``, or ``1e-6`` for
    float32), output value ``c`` may differ by at most the smaller of::

        (floor + expm1(16 * eps * (1 + n + (d + 3) * A))) * max(1, V_c)
        max_j v_jc - min_j v_jc + tolerance(n, eps) * max(1, max_j |v_jc|)

    The first is the oracle's :func:`~pagedkv.testing.oracle.tolerance` with
    ``max |score|`` replaced by a term that also covers cancellation in the dot
    products, float32's rounding of float64 inputs and sums over ``n`` tokens,
    and ``expm1`` because a score error ``e`` scales a weight by up to
    ``exp(e)``. The second holds whatever the weights, since the output is a
    weighted mean of the values; it takes over where float32 cannot resolve the
    scores at all. Where scores cancel, the first is looser than
    ``tolerance(max |score|) * max(1, |expected|)``, which a correct float32
    cache, and with cancelling scores a float64 one, can exceed.

    Args:
        query: ``[d]`` or ``[[d] * Hq]``.
        keys: the window's keys, ``[d]`` or ``[[d] * Hkv]`` each.
        values: the window's values, shaped like the keys.
        scale: multiplies every score.
        eps: the cache's machine epsilon (:func:`precision_eps`).

    Returns:
        One absolute bound per output value, head by head (flattened).

    >>> error_bounds([1.0], [[1.0], [1.0]], [[0.0], [2.0]])  # 1e-13 + expm1(16 * eps * 7)
    [1.248689957516038e-13]
    >>> error_bounds([1.0, 0.0], [[1e12, 0.0], [1e12 + 1, 0.0]], [[0.0, 1.0], [8.0, 1.0]],
    ...              eps=FLOAT32_EPS)  # float32 cannot tell the scores apart: the range bounds
    [8.000053776367187, 6.7220458984375e-06]
    """
    if not query or not isinstance(query[0], list):
        return _head_bounds(query, keys, values, scale, eps)
    group = len(query) // len(keys[0])
    bounds: list[float] = []
    for head, head_query in enumerate(query):
        kv_head = head // group
        bounds += _head_bounds(
            head_query,
            [key[kv_head] for key in keys],
            [value[kv_head] for value in values],
            scale,
            eps,
        )
    return bounds


# --------------------------------------------------------------- conversions


def _as_token(x: Any) -> Any:
    """A plain nested list of floats from a list, tuple or array (a copy)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [_as_token(item) for item in x]
    return x


def _shape(x: Any) -> tuple[int, ...] | None:
    """The rectangular shape of a nested list of numbers, or None if it is not one."""
    if isinstance(x, list):
        if not x:
            return (0,)
        inner = {_shape(item) for item in x}
        if len(inner) != 1 or None in inner:
            return None
        (shape,) = inner
        return None if shape is None else (len(x), *shape)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return ()
    return None


def _flatten(x: Any) -> list[float]:
    if isinstance(x, list):
        return [v for item in x for v in _flatten(item)]
    return [float(x)]


def _short(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------ the check


class CheckedCache:
    """A cache under test, checked against the oracle at every ``attend``.

    Invariants:
        * ``self.num_tokens`` tokens were attended; the oracle's window is the
          last ``min(num_tokens, max_size)`` of them;
        * every output so far matched the oracle within :func:`error_bounds`.

    Args:
        cache: any object with the seed's ``attend(q, k, v)``.
        max_size: the window the cache was built with (``None``: unbounded).
        scale: the factor the cache multiplies scores by.
        precision: the float type the cache computes in; sets the tolerance.
        name: how messages refer to the cache.

    Raises:
        ContractError: ``len(cache)`` is not 0, or ``check_invariants()``
            raises, on the new cache.

    Example:
        >>> class Seed:  # the seed exercise, solved
        ...     def __init__(self, max_size=None):
        ...         self.max_size, self.entries = max_size, []
        ...     def attend(self, q, k, v):
        ...         self.entries.append((k, v))
        ...         if self.max_size is not None and len(self.entries) > self.max_size:
        ...             del self.entries[0]
        ...         return attend(q, [k for k, _ in self.entries], [v for _, v in self.entries])[0]
        >>> cache = CheckedCache(Seed(max_size=1), max_size=1)
        >>> cache.attend([1.0], [1.0], [42.0])
        [42.0]
        >>> cache.attend([0.0], [0.0], [1.0])
        [1.0]
    """

    def __init__(
        self,
        cache: Any,
        *,
        max_size: int | None,
        scale: float = 1.0,
        precision: Precision = "float64",
        name: str = "cache",
    ) -> None:
        if max_size is not None and (
            isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1
        ):
            raise ValueError(f"max_size must be None or an int >= 1, got {max_size!r}")
        self.cache = cache
        self.max_size = max_size
        self.scale = float(scale)
        self.precision: Precision = precision
        self.eps = precision_eps(precision)
        self.name = name
        self.queries: list[Any] = []
        self.keys: list[Any] = []
        self.values: list[Any] = []
        #: The oracle's output for the latest ``attend`` (set before the cache is called).
        self.last_expected: Any = None
        self._check_after(f"{name} = factory(max_size={max_size})")

    @property
    def num_tokens(self) -> int:
        """Tokens attended so far, evicted ones included."""
        return len(self.keys)

    def window(self) -> tuple[list[Any], list[Any]]:
        """The keys and values the latest output had to attend over.

        Returns:
            ``(keys, values)``: the last ``min(n, max_size)`` tokens' (lists, oldest first).
        """
        start = 0 if self.max_size is None else max(0, len(self.keys) - self.max_size)
        return self.keys[start:], self.values[start:]

    def attend(self, q: Any, k: Any, v: Any) -> Any:
        """Call ``cache.attend(q, k, v)`` and check its output against the oracle.

        Args:
            q: the query, as the cache takes it (lists or arrays).
            k: the new key.
            v: the new value.

        Returns:
            The cache's output, unchanged.

        Raises:
            ContractError: the output, ``len`` or invariants break the contract,
                or the cache raised.
        """
        self.last_expected = None
        query, key, value = _as_token(q), _as_token(k), _as_token(v)
        self.queries.append(query)
        self.keys.append(key)
        self.values.append(value)
        step = len(self.keys)
        keys, values = self.window()
        expected, _ = attend(query, keys, values, self.scale)
        self.last_expected = expected
        call = f"{self.name}.attend({_short(query, 60)}, {_short(key, 60)}, {_short(value, 60)})"
        where = f"step {step} ({self.name}, max_size={self.max_size})"
        try:
            out = self.cache.attend(q, k, v)
        except Exception as error:
            raise ContractError(
                f"{where}: {call} raised {type(error).__name__}: {error}",
                kind=f"raised {type(error).__name__}",
            ) from error
        actual = _as_token(out)
        if _shape(actual) != _shape(query):
            raise ContractError(
                f"{where}: {call} returned {_short(out)}, of shape {_shape(actual)}; "
                f"the output must have q's shape {_shape(query)}",
                kind="shape",
            )
        got, want = _flatten(actual), _flatten(expected)
        if not all(math.isfinite(x) for x in got):
            raise ContractError(
                f"{where}: {call} returned {_short(actual)}, not finite", kind="non-finite"
            )
        bounds = error_bounds(query, keys, values, scale=self.scale, eps=self.eps)
        errors = [abs(a - b) for a, b in zip(got, want)]
        worst = max(range(len(errors)), key=lambda i: errors[i] / bounds[i])
        if errors[worst] > bounds[worst]:
            raise ContractError(
                f"{where}: {call} returned {_short(actual)}, the oracle says {_short(expected)} "
                f"(off by {errors[worst]:.3g}, allowed {bounds[worst]:.3g})",
                explain=self._diagnoser(query, got),
                kind="output",
            )
        self._check_after(call)
        return out

    def _check_after(self, call: str) -> None:
        """The length and invariant checks, after construction or an ``attend``."""
        where = f"after {call}"
        expected_len = len(self.window()[0])
        if hasattr(self.cache, "__len__"):
            try:
                actual_len = len(self.cache)
            except Exception as error:
                raise ContractError(
                    f"{where}: len({self.name}) raised {type(error).__name__}: {error}",
                    kind="len",
                ) from error
            if actual_len != expected_len:
                raise ContractError(
                    f"{where}: len({self.name}) is {actual_len}, expected "
                    f"min({self.num_tokens}, max_size={self.max_size}) = {expected_len}",
                    kind="len",
                )
        check = getattr(self.cache, "check_invariants", None)
        if callable(check):
            try:
                check()
            except Exception as error:
                raise ContractError(
                    f"{where}: {self.name}.check_invariants() raised "
                    f"{type(error).__name__}: {error}",
                    kind="invariants",
                ) from error

    def _diagnoser(self, query: Any, got: list[float]) -> Callable[[], str]:
        keys, values, max_size, scale, eps = (
            list(self.keys), list(self.values), self.max_size, self.scale, self.eps
        )

        def explain() -> str:
            return _diagnose(query, got, keys, values, max_size, scale, eps)

        return explain


def _count(m: int) -> str:
    return f"{m} token{'s' if m != 1 else ''}"


def _diagnose(
    query: Any,
    got: list[float],
    keys: list[Any],
    values: list[Any],
    max_size: int | None,
    scale: float,
    eps: float,
) -> str:
    """Which window of the token stream explains ``got``, told in the contract's words."""
    n = len(keys)
    want = n if max_size is None else min(n, max_size)

    def matches(start: int, stop: int) -> bool:
        if start >= stop:
            return False
        out, _ = attend(query, keys[start:stop], values[start:stop], scale)
        bounds = error_bounds(query, keys[start:stop], values[start:stop], scale=scale, eps=eps)
        return all(abs(a - b) <= e for a, b, e in zip(got, _flatten(out), bounds))

    # Nearest explanations first: a window off by one beats one off by five.
    sizes = sorted(range(1, n + 1), key=lambda m: (abs(m - want), m))
    for m in sizes:
        if m != want and matches(n - m, n):
            if m == want + 1:
                return (
                    f"It equals attention over the last {_count(m)}, one more than the window "
                    f"of {want}: the cache scores before it evicts (evict before scoring), "
                    "or its window is one token too long."
                )
            if m == n and max_size is not None:
                return f"It equals attention over all {n} tokens: the cache never evicts."
            side = "more" if m > want else "fewer"
            return (
                f"It equals attention over the last {_count(m)}, {abs(m - want)} {side} than "
                f"the exact window of min(n, max_size) = {want}."
            )
    for m in sorted(range(1, n), key=lambda m: (abs(m - want), m)):
        if matches(n - 1 - m, n - 1):
            return (
                f"It equals attention over the {_count(m)} before the current one: the cache "
                "drops the current token (append k/v before scoring; a token attends to itself)."
            )
    return (
        "No window of the token stream explains it: the scores, the softmax or the "
        "weighted sum are wrong (overflow? a wrong scale? a token overwritten?)."
    )
