"""The contract: caching never changes an output.

* Bit for bit: at every step, ``attend`` equals ``pagedkv.reference`` (dense
  arrays of the window rebuilt from scratch, the same kernel), for float64 and
  float32, one head, many heads and grouped-query attention, whatever the
  block_size and wherever the blocks lie in the pool.
* Within ``oracle.tolerance``: it equals the pure-Python oracle, which shares
  no code with the kernel.
* ``max_size=W``: each output attends to exactly ``min(n, W)`` tokens, and an
  evicted token never influences a later output.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv import KVCache, KVPool, reference
from pagedkv.testing import oracle

DTYPES = {"float64": (np.float64, oracle.FLOAT64_EPS), "float32": (np.float32, oracle.FLOAT32_EPS)}


@dataclass
class Stream:
    """A token stream: ``q_shape`` per query, ``kv_shape`` per key and value."""

    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    queries: list[np.ndarray]
    keys: list[np.ndarray]
    values: list[np.ndarray]

    @property
    def head_dim(self) -> int:
        return self.kv_shape[-1]

    @property
    def num_kv_heads(self) -> int:
        return 1 if len(self.kv_shape) == 1 else self.kv_shape[0]

    def __len__(self) -> int:
        return len(self.queries)

    def inputs(self, step: int, as_list: bool) -> tuple[Any, Any, Any]:
        q, k, v = self.queries[step], self.keys[step], self.values[step]
        return (q.tolist(), k.tolist(), v.tolist()) if as_list else (q, k, v)


# Exactly representable in float32, so a float32 cache, the oracle and the
# recompute all see the same numbers and only the kernel's rounding differs.
elements = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0]),
    st.floats(-4, 4, width=32),
)


@st.composite
def streams(draw: st.DrawFn, max_len: int = 24) -> Stream:
    head_dim = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["one head", "many heads", "gqa"]))
    if layout == "one head":
        q_shape: tuple[int, ...] = (head_dim,)
        kv_shape: tuple[int, ...] = (head_dim,)
    elif layout == "many heads":
        num_heads = draw(st.integers(1, 3))
        q_shape = kv_shape = (num_heads, head_dim)
    else:
        num_kv_heads = draw(st.integers(1, 2))
        q_shape = (num_kv_heads * draw(st.integers(2, 3)), head_dim)
        kv_shape = (num_kv_heads, head_dim)
    num_tokens = draw(st.integers(1, max_len))

    def array(shape: tuple[int, ...]) -> np.ndarray:
        flat = draw(st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape)))
        return np.array(flat, np.float64).reshape(shape)

    return Stream(
        q_shape, kv_shape,
        [array(q_shape) for _ in range(num_tokens)],
        [array(kv_shape) for _ in range(num_tokens)],
        [array(kv_shape) for _ in range(num_tokens)],
    )


def run(cache: KVCache, stream: Stream, as_list: bool = False) -> list[Any]:
    outputs = []
    for step in range(len(stream)):
        outputs.append(cache.attend(*stream.inputs(step, as_list)))
        cache.check_invariants()
    return outputs


def window(step: int, max_size: int | None) -> slice:
    return slice(0 if max_size is None else max(0, step + 1 - max_size), step + 1)


max_sizes = st.none() | st.integers(1, 12)
block_sizes = st.integers(1, 5)


# ----------------------------------------------------------------- bit for bit


@given(
    stream=streams(), max_size=max_sizes, block_size=block_sizes,
    dtype_name=st.sampled_from(sorted(DTYPES)), as_list=st.booleans(),
    use_sqrt_scale=st.booleans(),
)
def test_every_output_equals_the_recompute_bit_for_bit(
    stream: Stream, max_size: int | None, block_size: int, dtype_name: str, as_list: bool,
    use_sqrt_scale: bool,
) -> None:
    dtype, _ = DTYPES[dtype_name]
    scale = 1 / math.sqrt(stream.head_dim) if use_sqrt_scale else 1.0
    cache = KVCache(max_size, block_size=block_size, dtype=dtype, scale=scale)
    outputs = run(cache, stream, as_list)
    queries = [q.tolist() for q in stream.queries] if as_list else stream.queries
    expected = reference.recompute(
        queries, stream.keys, stream.values, max_size=max_size, scale=scale, dtype=dtype
    )
    for step, (out, want) in enumerate(zip(outputs, expected)):
        if as_list:
            assert out == want, f"step {step}"
        else:
            assert out.dtype == np.dtype(dtype)
            assert out.shape == stream.q_shape
            assert np.array_equal(out, want), f"step {step}"
        assert len(cache) <= len(stream)


@given(stream=streams(), max_size=max_sizes, block_size=block_sizes)
def test_float32_cache_equals_the_float32_recompute_not_the_float64_one(
    stream: Stream, max_size: int | None, block_size: int
) -> None:
    cache = KVCache(max_size, block_size=block_size, dtype=np.float32)
    for step, out in enumerate(run(cache, stream)):
        span = window(step, max_size)
        want = reference.attend_window(
            stream.queries[step], stream.keys[span], stream.values[span], dtype=np.float32
        )
        assert out.dtype == np.float32
        assert np.array_equal(out, want)


def _fragmented_pool(stream: Stream, block_size: int, order: list[int]) -> KVPool:
    """A shared pool whose free queue is shuffled into ``order``."""
    num_blocks = len(order)
    pool = KVPool(
        num_blocks, block_size=block_size, num_kv_heads=stream.num_kv_heads,
        head_dim=stream.head_dim,
    )
    taken = pool.allocator.allocate(num_blocks)
    pool.allocator.free([taken[i] for i in order])
    return pool


@given(
    stream=streams(), max_size=max_sizes, block_size=block_sizes,
    data=st.data(),
)
@example(
    stream=Stream((1,), (1,), [np.array([1.0])] * 9, [np.array([float(i)]) for i in range(9)],
                  [np.array([float(-i)]) for i in range(9)]),
    max_size=None, block_size=2, data=None,
).via("scattered blocks, unbounded")
def test_output_is_independent_of_where_the_blocks_lie(
    stream: Stream, max_size: int | None, block_size: int, data: Any
) -> None:
    num_needed = -(-len(stream) // block_size) + 1
    num_blocks = num_needed + 3
    if data is None:
        order = list(range(num_blocks))[::-1]
    else:
        order = data.draw(st.permutations(range(num_blocks)), label="free queue order")
    private = run(KVCache(max_size, block_size=block_size), stream)
    fresh_pool = KVPool(
        num_needed, block_size=block_size, num_kv_heads=stream.num_kv_heads,
        head_dim=stream.head_dim,
    )
    fresh = run(KVCache(max_size, pool=fresh_pool), stream)
    # Fragmented: a shuffled free queue, and another cache taking blocks between steps.
    pool = _fragmented_pool(stream, block_size, order)
    cache = KVCache(max_size, pool=pool)
    other = KVCache(max_size=block_size + 1, pool=pool)
    fragmented = []
    was_scattered = False
    for step in range(len(stream)):
        fragmented.append(cache.attend(*stream.inputs(step, False)))
        other.attend(stream.queries[step], stream.keys[step] + 1.0, stream.values[step])
        ids = cache.block_ids
        was_scattered |= any(b != a + 1 for a, b in itertools.pairwise(ids))
        pool.check_invariants()
    for step in range(len(stream)):
        assert np.array_equal(private[step], fresh[step]), f"step {step}"
        assert np.array_equal(private[step], fragmented[step]), f"step {step}"
    if data is None:
        assert was_scattered  # the explicit example really exercises the gather path


# ------------------------------------------------------------------ the oracle


@given(
    stream=streams(), max_size=max_sizes, block_size=block_sizes,
    dtype_name=st.sampled_from(sorted(DTYPES)), use_sqrt_scale=st.booleans(),
)
def test_every_output_is_within_tolerance_of_the_oracle(
    stream: Stream, max_size: int | None, block_size: int, dtype_name: str,
    use_sqrt_scale: bool,
) -> None:
    dtype, eps = DTYPES[dtype_name]
    scale = 1 / math.sqrt(stream.head_dim) if use_sqrt_scale else 1.0
    cache = KVCache(max_size, block_size=block_size, dtype=dtype, scale=scale)
    model = oracle.OracleCache(max_size, scale=scale)
    for step in range(len(stream)):
        q, k, v = stream.inputs(step, as_list=True)
        out = cache.attend(q, k, v)
        expected = model.attend(q, k, v)
        assert oracle.within_tolerance(out, expected, model.last_max_abs_score, eps), (
            f"step {step}: {out} vs {expected}, "
            f"tolerance {oracle.tolerance(model.last_max_abs_score, eps)}"
        )
        assert len(cache) == len(model)


def test_the_tolerance_check_can_fail() -> None:
    assert not oracle.within_tolerance([1.0 + 1e-9], [1.0], 0.0)
    assert oracle.within_tolerance([1.0 + 1e-15], [1.0], 0.0)
    assert not oracle.within_tolerance([1.0 + 1e-5], [1.0], 0.0, oracle.FLOAT32_EPS)


# ---------------------------------------------------------- shapes and types


def test_the_seed_example() -> None:
    out = KVCache().attend([1.0], [1.0], [42.0])
    assert out == [42.0]
    assert type(out[0]) is float


def test_lists_in_give_lists_of_python_floats_out() -> None:
    cache = KVCache(dtype=np.float32)
    out = cache.attend([[1.0, 0.0], [0.0, 1.0]], [[1.0, 2.0]], [[3.0, 4.0]])
    assert out == [[3.0, 4.0], [3.0, 4.0]]
    assert all(type(x) is float for row in out for x in row)
    # Tuples count as lists; an array q gives an array even with list k and v.
    assert cache.attend(((1.0, 0.0), (0.0, 1.0)), [[1.0, 2.0]], [[3.0, 4.0]]) == out
    assert isinstance(cache.attend(np.eye(2), [[1.0, 2.0]], [[3.0, 4.0]]), np.ndarray)


def test_arrays_in_give_an_array_of_the_cache_dtype_shaped_like_q() -> None:
    cache = KVCache()
    out = cache.attend(np.ones((6, 3), np.float32), np.ones((2, 3)), np.ones((2, 3)))
    assert isinstance(out, np.ndarray)
    assert out.shape == (6, 3)
    assert out.dtype == np.float64
    cache32 = KVCache(dtype=np.float32)
    out32 = cache32.attend(np.ones(3), np.ones(3), np.arange(3))
    assert (out32.shape, out32.dtype, out32.tolist()) == ((3,), np.float32, [0.0, 1.0, 2.0])


def test_integer_arrays_are_taken_as_real_numbers() -> None:
    cache = KVCache()
    assert cache.attend(np.array([1]), np.array([0]), np.array([7])).tolist() == [7.0]


def test_grouped_query_heads_read_their_kv_head() -> None:
    # Hq = 4 over Hkv = 2: query heads 0, 1 read kv head 0; heads 2, 3 read kv head 1.
    cache = KVCache()
    q = np.zeros((4, 1))
    cache.attend(q, np.zeros((2, 1)), np.array([[1.0], [10.0]]))
    out = cache.attend(q, np.zeros((2, 1)), np.array([[3.0], [30.0]]))
    assert out[:, 0].tolist() == [2.0, 2.0, 20.0, 20.0]


def test_the_output_is_a_new_array_not_a_view_of_the_pool() -> None:
    cache = KVCache(block_size=4)
    out = cache.attend(np.ones(2), np.ones(2), np.ones(2))
    out[:] = 5.0
    assert cache.attend(np.ones(2), np.ones(2), np.ones(2)).tolist() == [1.0, 1.0]


# ---------------------------------------------------- numerical stability


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_scores_of_1e4_give_finite_correct_outputs(dtype_name: str) -> None:
    dtype, eps = DTYPES[dtype_name]
    cache = KVCache(dtype=dtype)
    model = oracle.OracleCache()
    # scores q.k: 1e4, then 1e4 - 1 for the second key: weights 1 : e^-1
    for k, v in [([100.0], [2.0]), ([99.99], [5.0])]:
        out = cache.attend([100.0], k, v)
        expected = model.attend([100.0], k, v)
        assert all(math.isfinite(x) for x in out)
    assert model.last_max_abs_score == pytest.approx(1e4)
    score_gap = 100.0 * 100.0 - 100.0 * 99.99  # the float64 score difference
    exact = (2.0 + 5.0 * math.exp(-score_gap)) / (1.0 + math.exp(-score_gap))
    assert oracle.within_tolerance(out, [exact], 1e4, eps)
    assert oracle.within_tolerance(out, expected, model.last_max_abs_score, eps)


def test_equal_huge_negative_scores_average_the_values_exactly() -> None:
    cache = KVCache()
    for v in (1.0, 2.0, 6.0):
        out = cache.attend([-100.0], [100.0], [v])
    assert out == [3.0]


# ------------------------------------------------------------------ eviction


@given(
    stream=streams(max_len=20), max_size=st.integers(1, 6), block_size=block_sizes,
    data=st.data(),
)
def test_an_evicted_token_never_influences_a_later_output(
    stream: Stream, max_size: int, block_size: int, data: Any
) -> None:
    if len(stream) <= max_size:
        return  # nothing is ever evicted
    changed = data.draw(st.integers(0, len(stream) - max_size - 1), label="changed token")
    altered = Stream(
        stream.q_shape, stream.kv_shape, list(stream.queries), list(stream.keys),
        list(stream.values),
    )
    altered.keys[changed] = stream.keys[changed] * -3.0 + 1.0
    altered.values[changed] = stream.values[changed] + 1000.0
    outputs = run(KVCache(max_size, block_size=block_size), stream)
    altered_outputs = run(KVCache(max_size, block_size=block_size), altered)
    # Token `changed` leaves the window at step changed + max_size.
    for step in range(changed + max_size, len(stream)):
        assert np.array_equal(outputs[step], altered_outputs[step]), f"step {step}"


def test_a_huge_value_dominates_while_cached_and_vanishes_once_evicted() -> None:
    # q . k = 0 for every token: uniform weights over the window, max_size 3, block_size 2
    cache = KVCache(max_size=3, block_size=2)
    outputs = [cache.attend([0.0], [1.0], [1e6 if i == 0 else 1.0])[0] for i in range(8)]
    assert outputs[:3] == pytest.approx([1e6, (1e6 + 1) / 2, (1e6 + 2) / 3], rel=1e-14)
    assert outputs[3:] == [1.0] * 5  # token 0 left the window at step 3


@given(max_size=st.integers(1, 12), block_size=block_sizes, num_tokens=st.integers(1, 40))
def test_each_output_attends_to_exactly_min_n_w_tokens(
    max_size: int, block_size: int, num_tokens: int
) -> None:
    # Zero keys give uniform weights, so the output is the mean of the window's
    # values; with value i for token i that mean is (start + n - 1) / 2.
    cache = KVCache(max_size, block_size=block_size)
    for n in range(1, num_tokens + 1):
        out = cache.attend([1.0], [0.0], [float(n - 1)])[0]
        start = round(2 * out - (n - 1))
        assert n - start == min(n, max_size), f"after {n} tokens"
        assert len(cache) == min(n, max_size)


@given(
    stream=streams(), max_size=max_sizes, block_size=block_sizes,
    clear_at=st.sets(st.integers(0, 23), max_size=3), shared_pool=st.booleans(),
)
def test_after_clear_the_outputs_are_those_of_a_fresh_cache(
    stream: Stream, max_size: int | None, block_size: int, clear_at: set[int], shared_pool: bool
) -> None:
    pool = None
    if shared_pool:
        pool = KVPool(
            -(-len(stream) // block_size) + 1, block_size=block_size,
            num_kv_heads=stream.num_kv_heads, head_dim=stream.head_dim,
        )
    cache = KVCache(max_size, block_size=block_size, pool=pool)
    start = 0  # first step since the last clear
    for step in range(len(stream)):
        if step in clear_at:
            cache.clear()
            start = step
            assert (len(cache), cache.num_blocks) == (0, 0)
        out = cache.attend(*stream.inputs(step, False))
        span = window(step - start, max_size)
        span = slice(span.start + start, span.stop + start)
        want = reference.attend_window(stream.queries[step], stream.keys[span], stream.values[span])
        assert np.array_equal(out, want), f"step {step}"
        cache.check_invariants()
