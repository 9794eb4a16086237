"""A private windowed cache whose blocks page views can map: a fixed ring of the window's blocks.

Such a cache needs no room to re-lay its window into one run of ids: freed
blocks come back to the window's tail and the views read the window in
logical order whatever the ids. Other shapes keep the growable pool that
re-lays (tests/test_cache.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import KVCache, snapshot
from pagedkv.counts import window_blocks
from pagedkv.errors import NonFiniteError
from pagedkv.memory.vmem import views_supported
from pagedkv.reference import attend_window

pytestmark = pytest.mark.skipif(not views_supported(), reason="page views need Linux")

HEAD_DIM = 256  # 16 tokens x 1 head x 256 x float32 = 16 KiB a block: four memory pages


def _stream(max_size: int, length: int, seed: int) -> tuple[KVCache, np.ndarray, list[np.ndarray]]:
    """A ring cache streamed ``length`` tokens, each output checked against the recompute."""
    x = np.random.default_rng(seed).standard_normal((length, 3, 1, HEAD_DIM)).astype(np.float32)
    cache = KVCache(max_size, dtype=np.float32, scale=0.05)
    outputs = []
    for t in range(length):
        out = cache.attend(x[t, 0], x[t, 1], x[t, 2])
        start = max(0, t + 1 - max_size)
        window = x[start : t + 1]
        expected = attend_window(x[t, 0], window[:, 1], window[:, 2], scale=0.05, dtype=np.float32)
        assert np.array_equal(out, expected), f"token {t}"
        cache.check_invariants()
        outputs.append(out)
    return cache, x, outputs


@given(max_size=st.integers(1, 70), length=st.integers(1, 160), seed=st.integers(0, 2**16))
def test_a_ring_holds_exactly_the_window_blocks_and_equals_the_recompute(
    max_size: int, length: int, seed: int
) -> None:
    cache, _, _ = _stream(max_size, length, seed)
    pool = cache.pool
    assert pool is not None
    assert (pool.view_mode, pool.growable) == ("views", False)
    assert pool.num_blocks == window_blocks(max_size, 16)  # never grown, never twice the window
    assert cache.num_blocks <= pool.num_blocks


def test_a_ring_comes_round_again_and_again_read_through_views() -> None:
    x = np.random.default_rng(0).standard_normal((600, 3, 1, HEAD_DIM)).astype(np.float32)
    cache = KVCache(40, dtype=np.float32)
    wrapped = 0
    for t in range(600):  # 38 blocks through a ring of 4
        cache.attend(x[t, 0], x[t, 1], x[t, 2])
        wrapped += not cache.block_table.is_one_run
    pool = cache.pool
    assert pool is not None and pool.num_blocks == 4
    assert wrapped > 100  # most steps read a window whose ids are not one run
    assert pool.view_stats.num_view_reads > 0 and pool.view_stats.num_gather_reads == 0


def test_bad_input_leaves_a_ring_as_it_was() -> None:
    cache, x, _ = _stream(20, 50, 1)
    before = (cache.num_tokens, cache.block_table.block_ids, cache.keys().copy(), cache.values().copy())
    bad = x[0, 1].copy()
    bad[0, 3] = np.nan
    with pytest.raises(NonFiniteError):
        cache.attend(x[0, 0], bad, x[0, 2])
    assert (cache.num_tokens, cache.block_table.block_ids) == before[:2]
    assert np.array_equal(cache.keys(), before[2]) and np.array_equal(cache.values(), before[3])
    cache.check_invariants()


def test_a_saved_ring_loads_and_streams_on_equal_to_the_recompute(tmp_path: Path) -> None:
    cache, x, _ = _stream(30, 70, 2)
    path = tmp_path / "ring.pkv"
    snapshot.save(cache, path)
    twin = snapshot.load(path)
    assert isinstance(twin, KVCache)
    more = np.random.default_rng(3).standard_normal((40, 3, 1, HEAD_DIM)).astype(np.float32)
    history = np.concatenate([x, more])
    for t in range(70, 110):
        q, k, v = history[t]
        out, out_twin = cache.attend(q, k, v), twin.attend(q, k, v)
        expected = attend_window(q, history[t - 29 : t + 1, 1], history[t - 29 : t + 1, 2], scale=0.05,
                                 dtype=np.float32)
        assert np.array_equal(out, expected) and np.array_equal(out_twin, expected), f"token {t}"
        twin.check_invariants()


def test_shapes_views_cannot_map_keep_the_growable_pool() -> None:
    cache = KVCache(8, dtype=np.float32)
    cache.attend(np.ones(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32))  # 192-byte blocks
    assert cache.pool is not None and cache.pool.growable
    unbounded = KVCache(dtype=np.float32)
    unbounded.attend(*(np.ones((1, HEAD_DIM), np.float32) for _ in range(3)))
    assert unbounded.pool is not None and unbounded.pool.growable  # no window: no bound to ring within
