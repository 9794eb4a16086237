"""Hypothesis strategies for KV-cache tests: shapes, window sizes, and tokens (q, k, v).

Tokens are plain nested lists of Python floats (``[d]`` for one head, ``[[d] * num_heads]``
for many), finite and bounded by a magnitude tier drawn once per example: ``4``, ``1e3`` (a
softmax that forgets the maximum overflows) or :func:`max_magnitude`; values mix the small
tier with the drawn one. Why those tiers: "Values" in docs/testing.md.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

try:
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f'{__name__} needs Hypothesis; install the test extra: pip install "pagedkv[test]"'
    ) from error

from pagedkv.testing.contract import Precision, precision_eps

__all__ = [
    "LAYOUTS",
    "Config",
    "Shape",
    "configs",
    "elements",
    "keys",
    "magnitudes",
    "max_magnitude",
    "max_sizes",
    "queries",
    "shapes",
    "token_streams",
    "tokens",
    "values",
    "vectors",
]

#: The head layouts: one head fed as vectors; equal query and key/value heads; grouped-query.
LAYOUTS = ("one-head", "multi-head", "grouped-query")

#: The small tier every example mixes in.
SMALL_MAGNITUDE = 4.0

_FLOAT_MAX = {"float64": sys.float_info.max, "float32": 3.4028234663852886e38}


@dataclass(frozen=True)
class Shape:
    """The shape of a cache's tokens, fixed for a cache's life.

    Args:
        head_dim: values per head, at least 1.
        num_q_heads: query heads; ``None`` for one head fed as a vector ``[d]``.
        num_kv_heads: key/value heads, dividing ``num_q_heads``; ``None`` with it.

    Raises:
        ValueError: a count below 1, only one of the head counts given, or
            ``num_kv_heads`` not dividing ``num_q_heads``.

    Example:
        >>> shape = Shape(head_dim=2, num_q_heads=4, num_kv_heads=2)
        >>> shape.q_shape, shape.kv_shape
        ((4, 2), (2, 2))
    """

    head_dim: int
    num_q_heads: int | None = None
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {self.head_dim}")
        if (self.num_q_heads is None) != (self.num_kv_heads is None):
            raise ValueError("give both num_q_heads and num_kv_heads, or neither (one head)")
        if self.num_q_heads is not None and self.num_kv_heads is not None:
            if self.num_q_heads < 1 or self.num_kv_heads < 1:
                raise ValueError(
                    f"head counts must be >= 1, got {self.num_q_heads} and {self.num_kv_heads}"
                )
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_kv_heads={self.num_kv_heads} must divide num_q_heads={self.num_q_heads}"
                )

    @property
    def q_shape(self) -> tuple[int, ...]:
        """``(head_dim,)`` or ``(num_q_heads, head_dim)``."""
        if self.num_q_heads is None:
            return (self.head_dim,)
        return (self.num_q_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """``(head_dim,)`` or ``(num_kv_heads, head_dim)``."""
        if self.num_kv_heads is None:
            return (self.head_dim,)
        return (self.num_kv_heads, self.head_dim)

    @property
    def layout(self) -> str:
        """One of :data:`LAYOUTS`."""
        if self.num_q_heads is None:
            return "one-head"
        return "multi-head" if self.num_q_heads == self.num_kv_heads else "grouped-query"

    def __str__(self) -> str:
        return f"q {self.q_shape}, k/v {self.kv_shape}"


@dataclass(frozen=True)
class Config:
    """What a state-machine example draws once: the token shape, a magnitude, the first window.

    Args:
        shape: the token shape.
        magnitude: the bound on every value of q, k and v.
        max_size: the first cache's window (``None``: unbounded).
    """

    shape: Shape
    magnitude: float
    max_size: int | None


def max_magnitude(head_dim: int, *, scale: float = 1.0, precision: Precision = "float64") -> float:
    """The largest power of ten ``M`` for which scores stay far from overflowing.

    With every value in ``[-M, M]``, ``|scale * q . k| <= |scale| * head_dim * M**2``;
    ``M`` keeps that below ``finfo.max / 64``, four times under the
    ``finfo.max / 16`` at which :class:`pagedkv.KVCache` refuses input. So no
    score, partial sum or weighted value can overflow ``precision``: a correct
    cache must give finite, correct outputs on all of them. About ``1e152`` for
    float64 and ``1e18`` for float32 at ``head_dim=4``.

    Args:
        head_dim: values per head.
        scale: the score scale (values of ``|scale|`` below 1 count as 1).
        precision: ``"float64"`` or ``"float32"``.

    Returns:
        ``M``, a power of ten.

    >>> max_magnitude(4), max_magnitude(4, precision="float32")
    (1e+152, 1e+18)
    """
    precision_eps(precision)  # validates
    limit = _FLOAT_MAX[precision] / (64 * max(1.0, abs(scale)) * head_dim)
    return 10.0 ** math.floor(math.log10(math.sqrt(limit)))


def _representable(x: float, precision: Precision) -> float:
    """The largest value ``<= x`` that ``precision`` holds exactly (for ``x >= 0``)."""
    if precision == "float64":
        return x
    (y,) = struct.unpack("f", struct.pack("f", x))
    return float(y) if y <= x else math.nextafter(float(y), 0.0)


def magnitudes(
    head_dim: int, *, scale: float = 1.0, precision: Precision = "float64"
) -> st.SearchStrategy[float]:
    """One of the three magnitude tiers: ``4``, ``1e3`` and :func:`max_magnitude`.

    Args:
        head_dim: values per head.
        scale: the score scale.
        precision: ``"float64"`` or ``"float32"``.

    Returns:
        A strategy of bounds, shrinking to the small tier.
    """
    top = max_magnitude(head_dim, scale=scale, precision=precision)
    tiers = sorted({min(t, top) for t in (SMALL_MAGNITUDE, 1e3, top)})
    return st.sampled_from(tiers)


def elements(magnitude: float = SMALL_MAGNITUDE, *, precision: Precision = "float64") -> (
    st.SearchStrategy[float]
):
    """Finite floats in ``[-magnitude, magnitude]``, mixed with the small tier.

    Args:
        magnitude: the bound.
        precision: ``"float32"`` draws only values float32 holds exactly, so a
            float32 cache's input rounding adds no error.

    Returns:
        A strategy of Python floats (never NaN or infinite), shrinking towards 0.
    """
    width: Literal[32, 64] = 64 if precision == "float64" else 32
    small = _representable(min(magnitude, SMALL_MAGNITUDE), precision)
    tier = st.floats(-small, small, width=width)
    if magnitude <= SMALL_MAGNITUDE:
        return tier
    big = _representable(magnitude, precision)
    return st.one_of(tier, st.floats(-big, big, width=width))


def vectors(
    shape: Sequence[int], *, magnitude: float = SMALL_MAGNITUDE, precision: Precision = "float64"
) -> st.SearchStrategy[Any]:
    """Nested lists of floats of exactly ``shape`` (``(d,)`` or ``(heads, d)``).

    Args:
        shape: the dimensions, outermost first.
        magnitude: the bound on every value.
        precision: see :func:`elements`.

    Returns:
        A strategy of nested lists.
    """
    strategy: st.SearchStrategy[Any] = elements(magnitude, precision=precision)
    for size in reversed(tuple(shape)):
        strategy = st.lists(strategy, min_size=size, max_size=size)
    return strategy


def queries(
    shape: Shape, *, magnitude: float = SMALL_MAGNITUDE, precision: Precision = "float64"
) -> st.SearchStrategy[Any]:
    """Queries of ``shape.q_shape``; see :func:`vectors`.

    Args:
        shape: the token shape.
        magnitude: the bound on every value.
        precision: see :func:`elements`.

    Returns:
        A strategy of nested lists.
    """
    return vectors(shape.q_shape, magnitude=magnitude, precision=precision)


def keys(
    shape: Shape, *, magnitude: float = SMALL_MAGNITUDE, precision: Precision = "float64"
) -> st.SearchStrategy[Any]:
    """Keys (or values) of ``shape.kv_shape``; see :func:`vectors`.

    Args:
        shape: the token shape.
        magnitude: the bound on every value.
        precision: see :func:`elements`.

    Returns:
        A strategy of nested lists.
    """
    return vectors(shape.kv_shape, magnitude=magnitude, precision=precision)


#: Values have the keys' shape.
values = keys


def tokens(
    shape: Shape, *, magnitude: float = SMALL_MAGNITUDE, precision: Precision = "float64"
) -> st.SearchStrategy[tuple[Any, Any, Any]]:
    """One token's ``(q, k, v)``.

    Args:
        shape: the token shape.
        magnitude: the bound on every value.
        precision: see :func:`elements`.

    Returns:
        A strategy of ``(q, k, v)`` triples of nested lists.
    """
    return _tokens(shape, float(magnitude), precision)


@functools.lru_cache(maxsize=256)
def _tokens(
    shape: Shape, magnitude: float, precision: Precision
) -> st.SearchStrategy[tuple[Any, Any, Any]]:
    # NOTE: one flat list, cut into q, k and v, draws about twice as fast as
    # three nested lists, and the state machine draws one token per step.
    # Cached: building and validating the strategy cost as much as drawing.
    q_size = math.prod(shape.q_shape)
    kv_size = math.prod(shape.kv_shape)
    size = q_size + 2 * kv_size
    flat = st.lists(elements(magnitude, precision=precision), min_size=size, max_size=size)

    def as_q_k_v(values: list[float]) -> tuple[Any, Any, Any]:
        q = _reshape(values[:q_size], shape.q_shape)
        k = _reshape(values[q_size : q_size + kv_size], shape.kv_shape)
        v = _reshape(values[q_size + kv_size :], shape.kv_shape)
        return q, k, v

    return flat.map(as_q_k_v)


def _reshape(values: list[float], shape: tuple[int, ...]) -> Any:
    if len(shape) == 1:
        return values
    width = shape[1]
    return [values[i : i + width] for i in range(0, len(values), width)]


def token_streams(
    shape: Shape,
    *,
    min_size: int = 1,
    max_size: int = 20,
    magnitude: float = SMALL_MAGNITUDE,
    precision: Precision = "float64",
) -> st.SearchStrategy[list[tuple[Any, Any, Any]]]:
    """A stream of tokens for one sequence, to feed ``attend`` in order.

    Args:
        shape: the token shape.
        min_size: fewest tokens.
        max_size: most tokens.
        magnitude: the bound on every value.
        precision: see :func:`elements`.

    Returns:
        A strategy of lists of ``(q, k, v)``.
    """
    one = tokens(shape, magnitude=magnitude, precision=precision)
    return st.lists(one, min_size=min_size, max_size=max_size)


@st.composite
def _grouped(draw: st.DrawFn, max_head_dim: int, max_heads: int) -> Shape:
    num_kv_heads = draw(st.integers(1, max(1, max_heads // 2)))
    group = draw(st.integers(2, max(2, max_heads // num_kv_heads)))
    head_dim = draw(st.integers(1, max_head_dim))
    return Shape(head_dim, num_kv_heads * group, num_kv_heads)


def shapes(
    *, layouts: Sequence[str] = LAYOUTS, max_head_dim: int = 4, max_heads: int = 4
) -> st.SearchStrategy[Shape]:
    """Token shapes of the given layouts, tiny by default.

    Args:
        layouts: some of :data:`LAYOUTS`.
        max_head_dim: the largest head_dim.
        max_heads: the most query heads (grouped-query uses at least 2).

    Returns:
        A strategy of :class:`Shape`, shrinking towards the first layout.

    Raises:
        ValueError: an unknown layout, or none.

    >>> from hypothesis import find
    >>> find(shapes(layouts=["grouped-query"]), lambda s: True)
    Shape(head_dim=1, num_q_heads=2, num_kv_heads=1)
    """
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"layouts must be some of {LAYOUTS}, got {list(layouts)}")
    dims = st.integers(1, max_head_dim)
    options: list[st.SearchStrategy[Shape]] = []
    for layout in layouts:
        if layout == "one-head":
            options.append(st.builds(Shape, dims))
        elif layout == "multi-head":
            heads = st.integers(1, max_heads)
            options.append(heads.flatmap(lambda h: st.builds(Shape, dims, st.just(h), st.just(h))))
        else:
            options.append(_grouped(max_head_dim, max(2, max_heads)))
    return st.one_of(options)


def max_sizes(*, max_window: int = 6, unbounded: bool = True) -> st.SearchStrategy[int | None]:
    """Window sizes: ``None`` (unbounded) or ``1 .. max_window``; tiny so windows wrap often.

    Args:
        max_window: the largest window.
        unbounded: whether ``None`` is drawn too.

    Returns:
        A strategy of ``int | None``, shrinking to ``None`` (or 1).
    """
    windows = st.integers(1, max_window)
    return st.one_of(st.none(), windows) if unbounded else windows


def configs(
    *,
    shapes: st.SearchStrategy[Shape] | None = None,
    max_sizes: st.SearchStrategy[int | None] | None = None,
    scale: float = 1.0,
    precision: Precision = "float64",
) -> st.SearchStrategy[Config]:
    """Configurations: a shape, a magnitude tier for it, and a window size.

    Args:
        shapes: the shapes to draw (default: every layout, tiny).
        max_sizes: the windows to draw (default: :func:`max_sizes`).
        scale: the score scale, which bounds the magnitude.
        precision: ``"float64"`` or ``"float32"``.

    Returns:
        A strategy of :class:`Config`.
    """
    shape_strategy = shapes if shapes is not None else _default_shapes()
    size_strategy = max_sizes if max_sizes is not None else _default_max_sizes()

    def with_shape(shape: Shape) -> st.SearchStrategy[Config]:
        tier = magnitudes(shape.head_dim, scale=scale, precision=precision)
        return st.builds(Config, st.just(shape), tier, size_strategy)

    return shape_strategy.flatmap(with_shape)


# ``configs`` takes arguments named like the functions; keep handles on them.
_default_shapes = shapes
_default_max_sizes = max_sizes
