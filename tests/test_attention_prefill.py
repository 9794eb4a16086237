"""The masked prefill kernels' buffers: kv heads in blocks, scores in this thread's buffer.

``attend_dense_masked`` scores ``SCORE_BLOCK_BYTES`` of kv heads at a time into a
buffer kept between calls (``SCORE_BUFFER_MAX_BYTES``), and a quantized prefill of
at most ``WHOLE_WINDOW_BYTES`` (widened) runs it on the widened window. None of that
may change a bit, leak a buffer into a result, or skip a head: each check below
runs on the shipped kernel and on a planted one that does exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.quantized import stored

import pagedkv.attention as attention
from pagedkv.memory import quantization
from pagedkv.memory.quantization import QuantizedTokens, scratch_buffer, storage_format
from pagedkv.testing.oracle import FLOAT32_EPS, FLOAT64_EPS, attend, within_tolerance

Kernel = Callable[..., np.ndarray]


def masked_case(
    rng: np.random.Generator, num_queries: int, num_kv_heads: int, group: int, num_tokens: int, head_dim: int,
    dtype: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Queries, token-major keys and values seen as ``(H, N, d)``, and a mask where every row sees a key."""
    queries = rng.standard_normal((num_queries, num_kv_heads * group, head_dim)).astype(dtype)
    keys, values = (rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype).transpose(1, 0, 2)
                    for _ in range(2))
    visible = rng.random((num_queries, num_tokens)) < 0.6
    visible[np.arange(num_queries), rng.integers(0, num_tokens, num_queries)] = True
    return queries, keys, values, visible


def heads_stored(name: str, side: np.ndarray) -> QuantizedTokens:
    """A ``masked_case`` side ``(H, N, d)`` stored in ``name`` as a pool stores it."""
    return stored(name, side.transpose(1, 0, 2))


def oracle_rows(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
                scale: float) -> list[tuple[Any, float]]:
    """Each query over exactly the keys its row sees, by ``pagedkv.testing.oracle`` (float64 lists)."""
    rows = []
    for row, seen in zip(queries, visible):
        kept = np.flatnonzero(seen)
        rows.append(attend(row.astype(np.float64).tolist(),
                           keys[:, kept].transpose(1, 0, 2).astype(np.float64).tolist(),
                           values[:, kept].transpose(1, 0, 2).astype(np.float64).tolist(), scale))
    return rows


def check_blocks_and_buffers(kernel: Kernel, seed: int, num_kv_heads: int, group: int, num_tokens: int,
                             dtype: Any) -> None:
    """Blocks of one head, two (a partial last block where the heads are odd) and every head, and
    fresh arrays, all give the same bits, near the oracle."""
    rng = np.random.default_rng(seed)
    queries, keys, values, visible = masked_case(rng, 5, num_kv_heads, group, num_tokens, 4, dtype)
    head_bytes = 5 * group * num_tokens * np.dtype(dtype).itemsize  # one kv head's scores
    results = []
    with pytest.MonkeyPatch.context() as patch:
        for block_bytes, buffer_bytes in ((1, 1 << 30), (2 * head_bytes, 1 << 30), (1 << 30, 1 << 30),
                                          (2 * head_bytes, 0)):
            patch.setattr(attention, "SCORE_BLOCK_BYTES", block_bytes)
            patch.setattr(attention, "SCORE_BUFFER_MAX_BYTES", buffer_bytes)
            results.append(kernel(queries, keys, values, visible, 0.7))
    for result in results[1:]:
        assert result.dtype == results[0].dtype and np.array_equal(result, results[0])
    eps = FLOAT32_EPS if dtype == np.float32 else FLOAT64_EPS
    for got, (want, peak) in zip(results[0], oracle_rows(queries, keys, values, visible, 0.7)):
        assert within_tolerance(got.tolist(), want, peak, eps)


def check_results_own_their_memory(kernel: Kernel) -> None:
    """A second call (same shapes, other numbers) leaves the first result as it was."""
    rng = np.random.default_rng(5)
    first_case = masked_case(rng, 6, 1, 1, 9, 4, np.float32)
    first = kernel(*first_case, 1.0)
    kept = first.copy()
    kernel(*masked_case(rng, 6, 1, 1, 9, 4, np.float32), 1.0)
    assert np.array_equal(first, kept), "a result shares memory with a buffer the next call reuses"


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_kv_heads=st.integers(1, 5),
    group=st.integers(1, 3),
    num_tokens=st.integers(1, 40),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_any_head_block_and_a_fresh_array_give_the_same_bits(
    seed: int, num_kv_heads: int, group: int, num_tokens: int, dtype: Any
) -> None:
    check_blocks_and_buffers(attention.attend_dense_masked, seed, num_kv_heads, group, num_tokens, dtype)


def test_a_result_never_shares_the_thread_s_buffers() -> None:
    check_results_own_their_memory(attention.attend_dense_masked)

    def quantized_kernel(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
                         scale: float) -> np.ndarray:
        sides = (heads_stored("int8", keys), heads_stored("int8", values))
        return attention.attend_chunked_masked(queries, *sides, visible, scale, np.dtype(np.float32))

    for whole in (0, 1 << 30):  # the chunked kernel's copy out of its buffer, and the whole window's
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "WHOLE_WINDOW_BYTES", whole)
            check_results_own_their_memory(quantized_kernel)


def test_a_planted_kernel_that_returns_its_buffer_is_caught() -> None:
    def leaky(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
              scale: float) -> np.ndarray:
        result = attention.attend_dense_masked(queries, keys, values, visible, scale)
        buffer = scratch_buffer("planted out", result.dtype, result.shape)
        buffer[...] = result
        return buffer

    with pytest.raises(AssertionError, match="shares memory"):
        check_results_own_their_memory(leaky)


def test_a_planted_kernel_that_drops_the_last_partial_block_is_caught() -> None:
    """Heads in blocks of two, the odd head's output left at zero: the block sizes disagree."""
    def last_block_dropped(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
                           scale: float) -> np.ndarray:
        num_kv_heads = keys.shape[0]
        head_bytes = queries.shape[0] * (queries.shape[1] // num_kv_heads) * keys.shape[1] * keys.itemsize
        block = max(1, min(num_kv_heads, attention.SCORE_BLOCK_BYTES // head_bytes))
        result = attention.attend_dense_masked(queries, keys, values, visible, scale)
        if num_kv_heads % block:  # the planted defect: a last, partial block never computed
            group = queries.shape[1] // num_kv_heads
            result[:, (num_kv_heads - num_kv_heads % block) * group:] = 0.0
        return result

    with pytest.raises(AssertionError):
        check_blocks_and_buffers(last_block_dropped, 1, 3, 1, 7, np.float64)


@pytest.mark.parametrize("name", ["int8", "float8_e4m3", "float16", "bfloat16"])
@pytest.mark.parametrize("kernel_name", ["numpy", "numba"])
def test_a_short_quantized_prefill_is_float32_s_masked_kernel_over_the_stored_values(
    name: str, kernel_name: str
) -> None:
    """Up to ``WHOLE_WINDOW_BYTES``: the widened window through ``attend_dense_masked``, bit for bit."""
    if kernel_name == "numba":
        pytest.importorskip("numba")
    rng = np.random.default_rng(9)
    storage = storage_format(name, 64)
    queries, keys, values, visible = masked_case(rng, 12, 2, 2, 30, 64, np.float32)
    sides = [heads_stored(name, side) for side in (keys, values)]
    decoded = [storage.dequantize(*storage.quantize(side.transpose(1, 0, 2)), np.float32).transpose(1, 0, 2)
               for side in (keys, values)]
    previous = attention.set_kernel(kernel_name)
    try:
        got = attention.attend_chunked_masked(queries, *sides, visible, 0.5, np.dtype(np.float32))
    finally:
        attention.set_kernel(previous)
    expected = attention.attend_dense_masked(queries, *decoded, visible, 0.5)
    assert np.array_equal(got, expected)


def test_the_score_buffer_is_kept_between_calls_up_to_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same shapes twice reuse one buffer (no fresh pages); past the limit the buffer is not touched."""
    rng = np.random.default_rng(4)
    case = masked_case(rng, 8, 2, 1, 64, 8, np.float32)
    buffers = quantization._SCRATCH.__dict__.setdefault("buffers", {})
    attention.attend_dense_masked(*case, 1.0)
    kept = buffers[("scores", np.dtype(np.float32))]
    attention.attend_dense_masked(*case, 1.0)
    assert buffers[("scores", np.dtype(np.float32))] is kept
    monkeypatch.setattr(attention, "SCORE_BUFFER_MAX_BYTES", 0)
    attention.attend_dense_masked(*masked_case(rng, 8, 2, 1, 4096, 8, np.float32), 1.0)
    assert buffers[("scores", np.dtype(np.float32))] is kept  # not grown to the larger scores


def test_a_scratch_buffer_grows_by_half_so_a_growing_context_rarely_maps_pages() -> None:
    dtype = np.dtype(np.float32)
    first = scratch_buffer("growth test", dtype, (1000,))
    grown = scratch_buffer("growth test", dtype, (1001,))
    assert not np.shares_memory(first, grown)
    base = quantization._SCRATCH.buffers[("growth test", dtype)]
    assert base.size == 1500
    for size in range(1002, 1501, 100):  # room for half again: no new buffer
        scratch_buffer("growth test", dtype, (size,))
        assert quantization._SCRATCH.buffers[("growth test", dtype)] is base


def test_softmax_rows_masks_in_place_and_hidden_is_the_negated_mask() -> None:
    scores = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])
    visible = np.array([[True, False, True], [False, False, True]])
    by_hidden = scores.copy()
    weights = attention.softmax_rows(scores, 2.0, visible)
    assert weights is scores
    assert np.array_equal(attention.softmax_rows(by_hidden, 2.0, hidden=~visible), weights)
    assert weights[0, 1] == 0.0 and weights[1, 0] == 0.0 and weights[1, 2] == 1.0


@pytest.mark.parametrize(("num_queries", "whole"), [(7, False), (8, True), (16, True)])
def test_many_query_rows_widen_the_window_whole_whatever_its_length(
    monkeypatch: pytest.MonkeyPatch, num_queries: int, whole: bool
) -> None:
    """From ``2 * head_dim`` rows a kv head the chunks' scores outweigh the widened window: whole."""
    monkeypatch.setattr(attention, "WHOLE_WINDOW_BYTES", 0)
    calls: list[int] = []
    original = attention.attend_dense_masked

    def spy(*args: Any) -> np.ndarray:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(attention, "attend_dense_masked", spy)
    rng = np.random.default_rng(1)
    queries, keys, values, visible = masked_case(rng, num_queries, 2, 1, 20, 4, np.float32)
    sides = [heads_stored("int8", side) for side in (keys, values)]
    attention.attend_chunked_masked(queries, *sides, visible, 1.0, np.dtype(np.float32))
    assert bool(calls) == whole


def test_a_mask_of_ones_and_zeros_hides_what_false_hides() -> None:
    """``visible`` as 0/1 integers: the in-place masking negates it logically, not bitwise (~1 is -2)."""
    rng = np.random.default_rng(6)
    queries, keys, values, visible = masked_case(rng, 4, 2, 2, 9, 4, np.float64)
    as_bools = attention.attend_dense_masked(queries, keys, values, visible, 1.0)
    as_ints = attention.attend_dense_masked(queries, keys, values, visible.astype(int), 1.0)
    assert np.array_equal(as_ints, as_bools)
    scores = rng.standard_normal((4, 9))
    assert np.array_equal(attention.softmax_rows(scores.copy(), 1.0, visible.astype(np.int8)),
                          attention.softmax_rows(scores.copy(), 1.0, visible))
