"""The compiled decode kernel (``set_kernel("numba")``, the ``jit`` extra) over every storage format.

Paged decode over a fragmented shared pool, read by slot from the pages, must equal the no-cache
recompute (``reference.attend_window``, which runs the same kernel over the dense stored codes)
bit for bit, and the kernel must really be the one that ran. Skipped without numba.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pools import interleaved
from support.quantized import stored

import pagedkv.attention as attention
from pagedkv import reference
from pagedkv.attention import attend_chunked_masked, attend_sequence, kernel, set_kernel
from pagedkv.errors import ConfigError
from pagedkv.memory.quantization import QuantizedTokens

pytest.importorskip("ml_dtypes")
pytest.importorskip("numba")
from pagedkv.kernels import jit

FORMATS = ["float16", "bfloat16", "int8", "float8_e4m3"]


@pytest.fixture(autouse=True)
def numba_kernel() -> Iterator[None]:
    previous = set_kernel("numba")
    yield
    set_kernel(previous)


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype
    assert np.array_equal(got.view(f"u{got.itemsize}"), expected.view(f"u{expected.itemsize}"))


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(1, 60),
    block_size=st.sampled_from([1, 2, 4, 16]),
    head_dim=st.sampled_from([8, 24, 64]),
    group=st.sampled_from([1, 2, 3, 5]),
    seed=st.integers(0, 2**16),
)
def test_compiled_paged_decode_over_a_fragmented_pool_equals_the_recompute_bit_for_bit(
    name: str, num_tokens: int, block_size: int, head_dim: int, group: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    pool, table, keys, values = interleaved(name, num_tokens, block_size, head_dim, rng)
    query = rng.standard_normal((1, 2 * group, head_dim)).astype(np.float32)
    got = attend_sequence(pool, 0, table, None, query, 0.3)
    expected = reference.attend_window(query[0], list(keys), list(values), scale=0.3, dtype=np.float32,
                                       key_dtype=name, value_dtype=name)
    assert_same_bits(got[0], expected)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(1, 40),
    head_dim=st.sampled_from([32, 64, 96]),
    group=st.integers(2, 7),
    seed=st.integers(0, 2**16),
)
def test_each_grouped_query_head_equals_that_head_attended_alone_bit_for_bit(
    name: str, num_tokens: int, head_dim: int, group: int, seed: int
) -> None:
    """The kernels widen a kv head's key and value once for its query rows (in blocks of 4, 2, 1).

    Each row must still get the one-row result, op for op: the same query
    heads attended as one head per kv head give the same bits.
    """
    rng = np.random.default_rng(seed)
    pool, table, _, _ = interleaved(name, num_tokens, 4, head_dim, rng)
    query = rng.standard_normal((1, 2 * group, head_dim)).astype(np.float32)
    together = attend_sequence(pool, 0, table, None, query, 0.3)
    for row in range(group):
        heads = [kv_head * group + row for kv_head in range(2)]
        alone = attend_sequence(pool, 0, table, None, np.ascontiguousarray(query[:, heads]), 0.3)
        assert_same_bits(together[:, heads], alone)


@pytest.mark.parametrize("name", FORMATS)
def test_the_compiled_kernel_is_what_runs_and_stays_near_the_numpy_kernel(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    pool, table, _, _ = interleaved(name, 40, 4, 64, rng)
    query = rng.standard_normal((1, 2, 64)).astype(np.float32)
    calls: list[Any] = []
    original = jit.scores

    def counted(*args: Any) -> Any:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(jit, "scores", counted)
    compiled = attend_sequence(pool, 0, table, None, query, 0.3)
    assert len(calls) == 1
    set_kernel("numpy")
    numpy_path = attend_sequence(pool, 0, table, None, query, 0.3)
    assert len(calls) == 1
    # Different summation orders: close, not necessarily equal.
    np.testing.assert_allclose(compiled, numpy_path, rtol=1e-5, atol=1e-5)


def test_a_planted_kernel_that_reads_the_next_slot_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that reads slots as if the table were one run breaks only the paged read: must fail."""
    original = jit.scores

    def as_one_run(grouped: Any, keys: Any, slots: Any, scale_slots: Any) -> Any:
        if slots is not None:  # None: the tokens in order (the recompute), nothing to misread
            slots = slots[0] + np.arange(len(slots))
        return original(grouped, keys, slots, scale_slots)

    monkeypatch.setattr(jit, "scores", as_one_run)
    with pytest.raises(AssertionError):
        test_compiled_paged_decode_over_a_fragmented_pool_equals_the_recompute_bit_for_bit.hypothesis.inner_test(
            name="int8", num_tokens=12, block_size=2, head_dim=8, group=1, seed=3)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(17, 70),
    seed=st.integers(0, 2**16),
)
def test_compiled_decode_through_page_views_equals_the_recompute_bit_for_bit(
    name: str, num_tokens: int, seed: int
) -> None:
    """Views: codes mapped in order, scales read by slot from the pool (``scale_slots``), no copy."""
    rng = np.random.default_rng(seed)
    pool, table, keys, values = interleaved(name, num_tokens, 16, 128, rng, view_mode="views")
    query = rng.standard_normal((1, 4, 128)).astype(np.float32)
    got = attend_sequence(pool, 0, table, None, query, 0.3)
    expected = reference.attend_window(query[0], list(keys), list(values), scale=0.3, dtype=np.float32,
                                       key_dtype=name, value_dtype=name)
    assert_same_bits(got[0], expected)


@pytest.mark.parametrize("name", ["int8", "float8_e4m3"])
def test_a_page_view_names_the_pools_scales_and_their_slots(name: str) -> None:
    """The view's scales are the pool's own, read by slot where attention reads them: nothing copied."""
    pool, table, _, _ = interleaved(name, 40, 16, 128, np.random.default_rng(0), view_mode="views")
    assert not table.is_one_run
    keys, values = pool.read_quantized(0, table, table.live_ranges())
    for side in (keys, values):
        assert isinstance(side, QuantizedTokens) and side.slots is None and side.scale_slots is not None
        assert side.scale_slots.tolist() == table.slot_array(table.live_ranges()).tolist()
        assert side.shape == (2, 40, 128)
    assert keys.scales is not None and np.shares_memory(keys.scales, pool.pages._sides(0)[0][1])


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(3, 60),
    num_queries=st.integers(9, 16),
    block_size=st.sampled_from([1, 2, 16]),
    head_dim=st.sampled_from([8, 64, 128]),
    chunk=st.integers(1, 9),
    whole=st.sampled_from([0, 1 << 30]),
    view_mode=st.sampled_from(["views", "gather"]),
    seed=st.integers(0, 2**16),
)
def test_compiled_paged_prefill_over_a_fragmented_pool_equals_the_masked_recompute_bit_for_bit(
    name: str, num_tokens: int, num_queries: int, block_size: int, head_dim: int, chunk: int, whole: int,
    view_mode: str, seed: int,
) -> None:
    """A prefill chunk (more query rows than ``FOLD_MAX_ROWS``): widened by the compiled loop.

    ``whole`` is ``WHOLE_WINDOW_BYTES``: 0 runs the chunked kernel, 2^30 the whole window widened.
    """
    rng = np.random.default_rng(seed)
    try:
        pool, table, keys, values = interleaved(name, num_tokens, block_size, head_dim, rng, view_mode)
    except ConfigError:  # pages too small to map: views mode is refused
        return
    num_queries = min(num_queries, num_tokens)
    queries = rng.standard_normal((num_queries, 2, head_dim)).astype(np.float32)
    newest = np.arange(num_tokens - num_queries, num_tokens)
    mask = np.arange(num_tokens)[None, :] <= newest[:, None]
    saved = attention.COMPILED_CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES, attention.SCORE_BUFFER_MAX_BYTES
    # whole 0: the chunked kernel always (no buffer big enough for the whole window, nor its scores)
    attention.COMPILED_CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES, attention.SCORE_BUFFER_MAX_BYTES = (
        chunk, whole, whole or saved[2])
    try:
        got = attend_sequence(pool, 0, table, None, queries, 0.3)
        expected = attend_chunked_masked(queries, stored(name, keys), stored(name, values), mask, 0.3,
                                         np.dtype(np.float32))
    finally:
        (attention.COMPILED_CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES,
         attention.SCORE_BUFFER_MAX_BYTES) = saved
    assert_same_bits(got, expected)


@pytest.mark.parametrize("name", FORMATS)
def test_a_compiled_prefill_widens_with_the_compiled_loop_to_the_numpy_values(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled widening runs for a prefill, and gives numpy's decode bit for bit (one rounding)."""
    rng = np.random.default_rng(0)
    pool, table, _, _ = interleaved(name, 40, 4, 64, rng)
    queries = rng.standard_normal((12, 2, 64)).astype(np.float32)
    calls: list[Any] = []
    original = jit.decode_into

    def counted(*args: Any) -> Any:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(jit, "decode_into", counted)
    attend_sequence(pool, 0, table, None, queries, 0.3)
    assert calls
    keys, _ = pool.read_quantized(0, table, table.live_ranges())
    assert isinstance(keys, QuantizedTokens)
    numpy_widened = np.empty((40, 2, 64), np.float32)  # token-major
    keys.decode_into(0, 40, numpy_widened)
    for as_keys in (True, False):  # keys token-major, values head-major: the same numbers
        widened = attention._widen_compiled(keys, 0, 40, np.dtype(np.float32), as_keys).copy()
        assert_same_bits(widened.transpose(1, 0, 2), numpy_widened)


def test_a_planted_prefill_widening_that_reads_the_next_slot_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A widening that reads the slots as one run breaks only the paged prefill: the test must fail."""
    original = jit.decode_into

    def as_one_run(side: Any, slots: Any, scale_slots: Any, *layout: Any) -> Any:
        if slots is not None:  # None: the tokens in order (the recompute), nothing to misread
            slots = slots[0] + np.arange(len(slots))
        return original(side, slots, scale_slots, *layout)

    monkeypatch.setattr(jit, "decode_into", as_one_run)
    for whole in (0, 1 << 30):  # the chunked kernel and the whole window
        with pytest.raises(AssertionError):
            test_compiled_paged_prefill_over_a_fragmented_pool_equals_the_masked_recompute_bit_for_bit.hypothesis.inner_test(
                name="int8", num_tokens=12, num_queries=10, block_size=2, head_dim=64, chunk=4, whole=whole,
                view_mode="gather", seed=3)


def test_an_unknown_kernel_is_refused_and_nothing_changes() -> None:
    before = kernel()
    with pytest.raises(ConfigError, match="kernel must be one of"):
        set_kernel("cuda")
    assert kernel() == before == "numba"
    assert attention.KERNELS == ("numpy", "numba")


def every_code(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every code of ``name`` that may reach a page (no NaN), as stored, and its exact float32 value."""
    if name in ("int8", "float8_e4m3"):
        raw = np.arange(256, dtype=np.uint8)
        exact = raw.view(np.int8).astype(np.float32) if name == "int8" else jit_reference_fp8(raw)
    else:
        bits = np.arange(1 << 16, dtype=np.uint16)
        exact = (bits.view(np.float16).astype(np.float32) if name == "float16"
                 else (bits.astype(np.uint32) << 16).view(np.float32))
        raw = bits
    keep = ~np.isnan(exact)
    return raw[keep], exact[keep]


def jit_reference_fp8(raw: np.ndarray) -> np.ndarray:
    import ml_dtypes

    with np.errstate(invalid="ignore"):
        values: np.ndarray = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return values


@pytest.mark.parametrize("name", FORMATS)
def test_every_storable_code_widens_to_its_exact_value(name: str) -> None:
    """One token, weight 1, scales 1: the values pass returns each code's value (subnormals, 448, inf)."""
    raw, exact = every_code(name)
    if name == "float8_e4m3":  # 254 codes: two zeros make whole groups of 32
        raw, exact = np.concatenate([raw, raw[:2] * 0]), np.concatenate([exact, exact[:2] * 0])
    num_codes = len(raw)
    codes = raw[:num_codes].reshape(1, 1, num_codes)
    scales = None if name in ("float16", "bfloat16") else np.ones((1, 1, num_codes // 32), np.float32)
    weights = np.ones((1, 1, 1), np.float32)
    slot = np.zeros(1, np.intp)
    got = jit.weighted_values(weights, (name, codes, scales), slot, slot, num_codes)
    # The sum starts at +0.0, so -0.0 comes out as +0.0 (as a matmul's would).
    assert_same_bits(got.reshape(-1), exact[:num_codes] + np.float32(0.0))


@pytest.mark.parametrize("name", FORMATS)
def test_a_float64_query_is_read_as_float32_by_the_compiled_kernel(name: str) -> None:
    """The explicit-vector loops read float32 queries; a float64 query must be cast, not reinterpreted."""
    rng = np.random.default_rng(1)
    pool, table, _, _ = interleaved(name, 20, 4, 64, rng)
    query = rng.standard_normal((1, 2, 64))
    got = attend_sequence(pool, 0, table, None, query, 0.3)
    assert_same_bits(got, attend_sequence(pool, 0, table, None, query.astype(np.float32), 0.3))
