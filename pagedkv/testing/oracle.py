"""The naive oracle: the seed's dot and softmax in plain Python, sharing no code with pagedkv.

No numpy, no blocks, no pools: lists of floats and ``math.exp``. It is slow
and obviously right, which is the point; property tests compare every cache
against it. Nothing here imports the rest of pagedkv.

>>> cache = OracleCache()
>>> cache.attend([1.0], [1.0], [42.0])
[42.0]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

__all__ = [
    "FLOAT32_EPS",
    "FLOAT64_EPS",
    "OracleCache",
    "attend",
    "dot",
    "softmax",
    "tolerance",
    "within_tolerance",
]

Vector = list[float]
#: One token's key or value: a vector for one head, or one vector per head.
Token = Vector | list[Vector]

FLOAT64_EPS = sys.float_info.epsilon  # 2**-52
FLOAT32_EPS = 2.0**-23


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The seed's dot product: ``sum(a[i] * b[i])``, left to right."""
    total = 0.0
    for x, y in zip(a, b):
        total += x * y
    return total


def softmax(scores: Sequence[float]) -> list[float]:
    """The seed's softmax, shifted by the maximum so large scores stay finite."""
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def _attend_head(
    query: Sequence[float], keys: Sequence[Sequence[float]], values: Sequence[Sequence[float]],
    scale: float,
) -> tuple[list[float], float]:
    scores = [scale * dot(query, key) for key in keys]
    weights = softmax(scores)
    out = [0.0] * len(values[0])
    for weight, value in zip(weights, values):
        for i, x in enumerate(value):
            out[i] += weight * x
    # NOTE: the score's magnitude *without cancellation*, |scale| * sum |q_i k_i|:
    # a dot product's rounding error scales with it, not with |q . k| (q = [1e3,
    # 1e3] and k = [1e3, -1e3] score 0 but carry an error near eps * 2e6).
    peak = max(abs(scale) * sum(abs(x * y) for x, y in zip(query, key)) for key in keys)
    return out, peak


def attend(
    query: Token, keys: Sequence[Token], values: Sequence[Token], scale: float = 1.0
) -> tuple[Token, float]:
    """Attention of ``query`` over exactly ``keys``/``values``; also the score magnitude.

    The second result is ``max_j |scale| * sum_i |q_i * k_ji|``: the largest
    score computed without cancellation (equal to ``max |score|`` when no
    products cancel), which is what :func:`tolerance` needs.

    Shapes: a query ``[d]`` with keys ``[d]``; or a query ``[[d] * Hq]`` with
    keys ``[[d] * Hkv]``, query head ``h`` reading key/value head
    ``h // (Hq // Hkv)`` (grouped-query attention).

    >>> attend([1.0], [[1.0], [1.0]], [[2.0], [4.0]])
    ([3.0], 1.0)
    """
    if not keys:
        raise ValueError("attention needs at least one key")
    if not isinstance(query[0], list):
        return _attend_head(query, keys, values, scale)  # type: ignore[arg-type]
    heads: list[Vector] = query
    num_kv_heads = len(keys[0])
    group = len(heads) // num_kv_heads
    outputs, peak = [], 0.0
    for head, head_query in enumerate(heads):
        kv_head = head // group
        head_keys: list[Vector] = [key[kv_head] for key in keys]  # type: ignore[misc]
        head_values: list[Vector] = [value[kv_head] for value in values]  # type: ignore[misc]
        out, head_peak = _attend_head(head_query, head_keys, head_values, scale)
        outputs.append(out)
        peak = max(peak, head_peak)
    return outputs, peak


def tolerance(max_abs_score: float, eps: float = FLOAT64_EPS) -> float:
    """How far a float kernel may stray from the oracle, relative to ``max(1, |expected|)``.

    ``1e-13 + 16 * eps * (1 + S)`` for float64, where ``S`` is the score
    magnitude :func:`attend` returns: softmax's exp turns an absolute rounding
    error ``e`` in a score into a relative error ``e`` in its weight, and a
    score's rounding error grows with ``S``. For float32 the same form with
    float32's epsilon and an absolute floor of ``1e-6``.

    NOTE: the issue first stated this with ``S = max |score|``; a correct
    kernel breaks that bound when a dot product cancels (the score is small,
    its rounding error is not), so ``S`` is the score without cancellation.
    The bound assumes the values themselves do not cancel in the weighted
    sum; :func:`pagedkv.testing.error_bounds` drops that assumption too.

    >>> tolerance(0.0) > 0
    True
    """
    floor = 1e-13 if eps <= FLOAT64_EPS else 1e-6
    return floor + 16 * eps * (1.0 + max_abs_score)


def _flatten(x: Token) -> list[float]:
    if x and isinstance(x[0], list):
        return [v for row in x for v in row]
    return list(x)  # type: ignore[arg-type]


def within_tolerance(
    actual: Token, expected: Token, max_abs_score: float, eps: float = FLOAT64_EPS
) -> bool:
    """Whether every value of ``actual`` is within ``tolerance`` of ``expected``."""
    limit = tolerance(max_abs_score, eps)
    got, want = _flatten(actual), _flatten(expected)
    if len(got) != len(want):
        return False
    return all(abs(a - b) <= limit * max(1.0, abs(b)) for a, b in zip(got, want))


class OracleCache:
    """The deliberately dumb cache: a Python list of every entry, trimmed to ``max_size``.

    ``attend`` appends, drops the oldest entry past ``max_size``, then attends
    over what is left: exactly the seed's contract.
    """

    def __init__(self, max_size: int | None = None, scale: float = 1.0) -> None:
        self.max_size = max_size
        self.scale = scale
        self.keys: list[Token] = []
        self.values: list[Token] = []
        #: Largest |score| of the last attend, for :func:`tolerance`.
        self.last_max_abs_score = 0.0

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Token, k: Token, v: Token) -> Token:
        """Append ``k``/``v``, evict the oldest past ``max_size``, attend ``q`` over the rest."""
        self.keys.append(k)
        self.values.append(v)
        if self.max_size is not None and len(self.keys) > self.max_size:
            del self.keys[0]
            del self.values[0]
        out, self.last_max_abs_score = attend(q, self.keys, self.values, self.scale)
        return out
