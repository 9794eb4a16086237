"""Page views for every storage format: codes read through the mapped window, scales by slot.

A pool of float16, bfloat16, int8 or fp8 pages whose blocks fill whole memory pages maps views
like a float pool; decode and prefill then read the codes uncopied and must equal, bit for bit,
the same pool gathering and the no-cache recompute. Keys and values of one width may differ in
format (float16 keys, bfloat16 values); of different widths they cannot share a page file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.pools import interleaved

import pagedkv.memory.views as views_module
from pagedkv import KVCache, KVPool, reference
from pagedkv.attention import attend_sequence
from pagedkv.blocks.table import BlockTable
from pagedkv.errors import ConfigError
from pagedkv.memory.quantization import QuantizedTokens
from pagedkv.memory.vmem import views_supported

pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.skipif(not views_supported(), reason="page views need Linux mmap(MAP_FIXED)")

H, D, BS = 2, 128, 16  # an int8 block is 16 x 2 x 128 = 4,096 bytes: one memory page
PAIRS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("int8", "int8"),
         ("float8_e4m3", "float8_e4m3"), ("float16", "bfloat16"), ("int8", "float8_e4m3")]


def filled(
    key_dtype: str, value_dtype: str, mode: str, num_tokens: int
) -> tuple[KVPool, BlockTable, Any, Any]:
    """A pool in ``mode`` whose first of two tables takes every other block; its dense keys and values."""
    return interleaved(key_dtype, num_tokens, BS, D, np.random.default_rng(5), mode, num_kv_heads=H,
                       value_dtype=value_dtype, key_scale=2.0)


@pytest.mark.parametrize(("key_dtype", "value_dtype"), PAIRS)
def test_every_format_maps_views_and_decodes_as_the_recompute_bit_for_bit(
    key_dtype: str, value_dtype: str
) -> None:
    viewed, table, keys, values = filled(key_dtype, value_dtype, "views", 70)
    gathered, other_table, _, _ = filled(key_dtype, value_dtype, "gather", 70)
    assert viewed.view_mode == "views" and not table.is_one_run
    query = np.random.default_rng(1).standard_normal((1, 4, D)).astype(np.float32)
    out = attend_sequence(viewed, 0, table, None, query, 0.1)
    assert viewed.view_stats.num_view_reads == 1 and viewed.view_stats.num_gather_reads == 0
    assert np.array_equal(out, attend_sequence(gathered, 0, other_table, None, query, 0.1))
    expected = reference.attend_window(query[0], list(keys), list(values), scale=0.1, dtype=np.float32,
                                       key_dtype=key_dtype, value_dtype=value_dtype)
    assert np.array_equal(out[0], expected)
    viewed.check_invariants()


@pytest.mark.parametrize(("key_dtype", "value_dtype"), PAIRS[:4])
def test_a_prefill_chunk_through_views_equals_the_gathering_pool_bit_for_bit(
    key_dtype: str, value_dtype: str
) -> None:
    viewed, table, _, _ = filled(key_dtype, value_dtype, "views", 50)
    gathered, other_table, _, _ = filled(key_dtype, value_dtype, "gather", 50)
    queries = np.random.default_rng(2).standard_normal((9, 2, D)).astype(np.float32)
    out = attend_sequence(viewed, 0, table, 40, queries, 0.1)  # a window of 40: the mask cuts the oldest
    assert viewed.view_stats.num_view_reads == 1
    assert np.array_equal(out, attend_sequence(gathered, 0, other_table, 40, queries, 0.1))


def test_a_view_read_hands_over_the_mapped_codes_uncopied() -> None:
    pool, table, _, _ = filled("int8", "int8", "views", 40)
    keys, values = pool.read_quantized(0, table, table.live_ranges())
    for side in (keys, values):
        assert isinstance(side, QuantizedTokens) and side.slots is None and side.scales is not None
        assert side.shape == (H, 40, D) and side.codes.dtype == np.int8
        assert not side.codes.flags.writeable  # the read-only window view, not a copy of it
    expected = pool.pages.gather_quantized(0, table.read_plan())[0]
    assert isinstance(expected, QuantizedTokens)
    f32 = np.dtype(np.float32)
    assert np.array_equal(keys.dequantize(0, 40, f32), expected.dequantize(0, 40, f32))


def test_values_of_another_format_of_one_width_read_as_their_own_dtype() -> None:
    """float16 keys beside bfloat16 values in one page file: the value view must be bfloat16."""
    pool, table, _, _ = filled("float16", "bfloat16", "views", 20)
    _, values = pool.read_quantized(0, table, table.live_ranges())
    assert isinstance(values, QuantizedTokens) and values.codes.dtype.name == "bfloat16"
    assert pool.value_pages(0).dtype.name == "bfloat16"


def test_a_planted_view_that_reads_values_as_the_keys_dtype_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decoders read bits, so such a view would still decode right; the dtype check must see it."""
    monkeypatch.setattr(views_module.PageFile, "side_dtype", lambda self, side: self.dtype)
    with pytest.raises(AssertionError):
        test_values_of_another_format_of_one_width_read_as_their_own_dtype()


def test_keys_and_values_of_different_widths_cannot_share_a_page_file() -> None:
    with pytest.raises(ConfigError, match="1,024 bytes and one of values 2,048"):
        KVPool(4, block_size=4, num_kv_heads=2, head_dim=128, dtype=np.float32,
               key_dtype="int8", value_dtype="float16", view_mode="views")
    auto = KVPool(4, block_size=BS, num_kv_heads=H, head_dim=D, dtype=np.float32, key_dtype="int8",
                  value_dtype="float16")
    assert auto.view_mode == "gather"


def test_a_windowed_quantized_cache_reads_its_ring_through_views_as_the_recompute() -> None:
    rng = np.random.default_rng(9)
    cache = KVCache(max_size=40, block_size=BS, key_dtype="int8", value_dtype="float8_e4m3", dtype=np.float32)
    keys: list[Any] = []
    values: list[Any] = []
    for _ in range(90):  # past the window twice: the ring turns
        q, k, v = (rng.standard_normal((H, D)).astype(np.float32) for _ in range(3))
        out = cache.attend(q, k, v)
        keys.append(k)
        values.append(v)
        expected = reference.attend_window(q, keys[-40:], values[-40:], dtype=np.float32, key_dtype="int8",
                                           value_dtype="float8_e4m3")
        assert np.array_equal(out, expected)
    assert cache.pool is not None and cache.pool.view_mode == "views"
    assert cache.pool.view_stats.num_view_reads > 0
    cache.check_invariants()
