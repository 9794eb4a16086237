"""Low-precision pages read as stored: the chunk decoders, and paged attention over every format.

The decoders (``StorageFormat.decode_into``) widen codes with integer shifts instead of a float
cast; they must give ``dequantize``'s numbers bit for bit, for every code. Paged decode and
prefill over a fragmented shared pool (read chunk by chunk from the pages, by slot) must equal
the no-cache recompute over the same stored tokens bit for bit: ``reference.attend_window`` for
a decode, the masked chunked kernel over the dense quantized tokens for a prefill.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pools import interleaved
from support.quantized import stored

import pagedkv.attention as attention
import pagedkv.memory.quantization as quantization
from pagedkv import reference
from pagedkv.attention import attend_chunked_masked, attend_sequence
from pagedkv.memory.quantization import QuantizedTokens, storage_format

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = ["float16", "bfloat16", "int8", "float8_e4m3"]


def decoded(name: str, codes: np.ndarray, scales: np.ndarray | None, dtype: Any) -> np.ndarray:
    out = np.empty(codes.shape, dtype)
    storage_format(name, codes.shape[-1]).decode_into(codes, scales, out)
    return out


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit: -0.0 and 0.0 differ, infinities and NaNs must match too."""
    assert got.dtype == expected.dtype
    assert np.array_equal(got.view(f"u{got.itemsize}"), expected.view(f"u{expected.itemsize}"))


# ------------------------------------------------------------ the decoders, code by code


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_float16_code_decodes_to_its_value_infinities_subnormals_and_signed_zeros(dtype: Any) -> None:
    codes = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite_or_inf = codes[~np.isnan(codes)].reshape(-1, 2)  # pages never hold a NaN code
    assert_same_bits(decoded("float16", finite_or_inf, None, dtype), finite_or_inf.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_bfloat16_code_decodes_to_its_value(dtype: Any) -> None:
    codes = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    codes = codes[~np.isnan(codes.astype(np.float32))].reshape(-1, 2)  # inputs are finite: no NaN codes
    expected = codes.astype(np.float32).astype(dtype)
    assert_same_bits(decoded("bfloat16", codes, None, dtype), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_fp8_code_times_its_scale_equals_dequantize(dtype: Any) -> None:
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    codes = codes[~np.isnan(codes.astype(np.float32))].reshape(-1, 2)  # quantize clips: no NaN codes
    scales = np.geomspace(1e-30, 1e30, len(codes)).astype(dtype).reshape(-1, 1)
    storage = storage_format("float8_e4m3", 2)
    expected = storage.dequantize(codes, scales, np.dtype(dtype))
    assert_same_bits(decoded("float8_e4m3", codes, scales, dtype), expected)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    dtype=st.sampled_from([np.float32, np.float64]),
    num_tokens=st.integers(1, 9),
    log_range=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_decode_into_equals_dequantize_bit_for_bit_on_strided_codes(
    name: str, dtype: Any, num_tokens: int, log_range: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_tokens, 3, 8)) * 2.0**log_range).astype(dtype)
    storage = storage_format(name, 8)
    with np.errstate(over="ignore"):
        codes, scales = storage.quantize(x.transpose(1, 0, 2))  # head-major: codes come strided
        expected = storage.dequantize(codes, scales if storage.scaled else None, np.dtype(dtype))
        got = decoded(name, codes.transpose(1, 0, 2), scales.transpose(1, 0, 2) if storage.scaled else None,
                      dtype)
    assert_same_bits(got, np.ascontiguousarray(expected.transpose(1, 0, 2)))


def test_a_planted_decoder_that_forgets_float16_infinities_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fix-up a stored infinity reads as 65536: the code-by-code check must fail."""
    original = quantization.StorageFormat.widen_into

    def no_infinities(self: Any, codes: np.ndarray, out: np.ndarray) -> None:
        with np.errstate(over="ignore"):
            original(self, codes, out)
        out[np.isinf(out)] = np.copysign(65536.0, out[np.isinf(out)])

    monkeypatch.setattr(quantization.StorageFormat, "widen_into", no_infinities)
    with pytest.raises(AssertionError):
        test_every_float16_code_decodes_to_its_value_infinities_subnormals_and_signed_zeros(np.float32)


# ------------------------------------------------------------ paged attention, every format


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(2, 40),
    block_size=st.sampled_from([1, 2, 4]),
    chunk=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_over_a_fragmented_pool_equals_the_recompute_bit_for_bit(
    name: str, num_tokens: int, block_size: int, chunk: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    pool, table, keys, values = interleaved(name, num_tokens, block_size, 8, rng)
    query = rng.standard_normal((1, 4, 8)).astype(np.float32)
    saved, attention.CHUNK_TOKENS = attention.CHUNK_TOKENS, chunk  # boundaries inside and across blocks
    try:
        got = attend_sequence(pool, 0, table, None, query, 0.3)
        expected = reference.attend_window(query[0], list(keys), list(values), scale=0.3, dtype=np.float32,
                                           key_dtype=name, value_dtype=name)
    finally:
        attention.CHUNK_TOKENS = saved
    assert_same_bits(got[0], expected)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(FORMATS),
    num_tokens=st.integers(3, 40),
    num_queries=st.integers(2, 6),
    chunk=st.integers(1, 7),
    whole=st.sampled_from([0, 1 << 30]),
    seed=st.integers(0, 2**16),
)
def test_paged_prefill_over_a_fragmented_pool_equals_the_masked_recompute_bit_for_bit(
    name: str, num_tokens: int, num_queries: int, chunk: int, whole: int, seed: int
) -> None:
    """``whole`` is ``WHOLE_WINDOW_BYTES``: 0 runs the chunked kernel, 2^30 the whole window decoded."""
    rng = np.random.default_rng(seed)
    pool, table, keys, values = interleaved(name, num_tokens, 2, 8, rng)
    num_queries = min(num_queries, num_tokens)
    queries = rng.standard_normal((num_queries, 4, 8)).astype(np.float32)
    positions = np.arange(num_tokens)
    newest = np.arange(num_tokens - num_queries, num_tokens)
    mask = positions[None, :] <= newest[:, None]
    saved = attention.CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES, attention.SCORE_BUFFER_MAX_BYTES
    # whole 0: the chunked kernel always (no buffer big enough for the whole window, nor its scores)
    attention.CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES, attention.SCORE_BUFFER_MAX_BYTES = (
        chunk, whole, whole or saved[2])
    try:
        got = attend_sequence(pool, 0, table, None, queries, 0.3)
        expected = attend_chunked_masked(queries, stored(name, keys), stored(name, values), mask, 0.3,
                                         np.dtype(np.float32))
    finally:
        attention.CHUNK_TOKENS, attention.WHOLE_WINDOW_BYTES, attention.SCORE_BUFFER_MAX_BYTES = saved
    assert_same_bits(got, expected)


@pytest.mark.parametrize("name", FORMATS)
def test_a_fragmented_read_names_the_pages_and_copies_nothing(name: str) -> None:
    """gather_quantized hands the kernel the pages and the slots: no whole-table copy is made."""
    pool, table, _, _ = interleaved(name, 12, 2, 8, np.random.default_rng(0))
    assert not table.is_one_run
    keys, values = pool.gather_quantized(0, table.read_plan())
    for side, pages in ((keys, pool.key_pages(0)), (values, pool.value_pages(0))):
        assert isinstance(side, QuantizedTokens) and side.slots is not None
        assert np.shares_memory(side.codes, pages)
        assert side.shape == (2, 12, 8)
        assert side.slots.tolist() == table.slot_array(table.live_ranges()).tolist()
