"""Tests for ``pagedkv.cache.KVCache``: hand-built boundary cases of the block state.

Every case draws the expected state, block_size 4 unless it says otherwise::

    b0 |0 1 2 3|   block id 0 holding logical indices 0..3
    b1 |4 . . .|   block id 1 holding index 4, three free slots
    b0 |- - 2 3|   indices 0 and 1 evicted, the block still held for 2 and 3
    free [2, 3]    the pool's free queue, head (next handed out) first

Each attend is also checked, bit for bit, against ``pagedkv.reference``.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from pagedkv import KVCache, KVPool, reference
from pagedkv.errors import NonFiniteError, PoolExhaustedError


def token(index: int) -> tuple[list[float], list[float], list[float]]:
    """Token ``index``'s (q, k, v): small distinct numbers, one head of head_dim 1."""
    return [0.5], [float(index % 3) - 1.0], [float(index)]


class Checked:
    """Feeds ``token(i)`` to a cache and checks each output against the recompute."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.keys: list[list[float]] = []
        self.values: list[list[float]] = []

    def attend(self, index: int | None = None) -> list[float]:
        index = len(self.keys) if index is None else index
        q, k, v = token(index)
        out = self.cache.attend(q, k, v)
        self.keys.append(k)
        self.values.append(v)
        size = self.cache.max_size
        start = 0 if size is None else max(0, len(self.keys) - size)
        expected = reference.attend_window(q, self.keys[start:], self.values[start:]).tolist()
        assert out == expected
        self.cache.check_invariants()
        return out  # type: ignore[no-any-return]


def shared(num_blocks: int, block_size: int = 4) -> KVPool:
    return KVPool(num_blocks, block_size=block_size, head_dim=1)


# ------------------------------------------------------------- block boundaries


def test_first_token_of_a_new_block_takes_the_head_of_the_free_queue() -> None:
    pool = shared(4)
    stream = Checked(KVCache(pool=pool))
    for _ in range(4):
        stream.attend()
    # b0 |0 1 2 3|                 free [1, 2, 3]
    assert (stream.cache.block_ids, pool.num_free_blocks) == ([0], 3)
    stream.attend()
    # b0 |0 1 2 3| b1 |4 . . .|    free [2, 3]
    assert stream.cache.block_ids == [0, 1]
    assert pool.allocator.free_block_ids() == [2, 3]
    assert len(stream.cache) == 5


def test_a_block_exactly_full_needs_no_new_block_until_the_next_token() -> None:
    pool = shared(2)
    stream = Checked(KVCache(pool=pool))
    for n in range(1, 5):
        stream.attend()
        # n = 1: b0 |0 . . .|  ...  n = 4: b0 |0 1 2 3|   free [1]
        assert (stream.cache.block_ids, pool.num_free_blocks, len(stream.cache)) == ([0], 1, n)
    assert stream.cache.block_table.num_new_blocks(1) == 1
    assert stream.cache.keys()[:, 0].tolist() == [-1.0, 0.0, 1.0, -1.0]


def test_window_slide_frees_the_oldest_block_to_the_tail_of_the_queue() -> None:
    # block_size 4, max_size 6, ten tokens on a shared pool of 8 blocks
    pool = shared(8)
    stream = Checked(KVCache(max_size=6, pool=pool))
    expected = [
        # n   window   block state                           block_ids
        [0],  # 1  0..0   b0 |0 . . .|
        [0],  # 2  0..1   b0 |0 1 . .|
        [0],  # 3  0..2   b0 |0 1 2 .|
        [0],  # 4  0..3   b0 |0 1 2 3|
        [0, 1],  # 5  0..4   b0 |0 1 2 3| b1 |4 . . .|
        [0, 1],  # 6  0..5   b0 |0 1 2 3| b1 |4 5 . .|
        [0, 1],  # 7  1..6   b0 |- 1 2 3| b1 |4 5 6 .|
        [0, 1],  # 8  2..7   b0 |- - 2 3| b1 |4 5 6 7|
        [0, 1, 2],  # 9  3..8   b0 |- - - 3| b1 |4 5 6 7| b2 |8 . . .|
        [1, 2],  # 10 4..9   (b0 freed)   b1 |4 5 6 7| b2 |8 9 . .|
    ]
    for n, block_ids in enumerate(expected, start=1):
        stream.attend()
        assert stream.cache.block_ids == block_ids, f"after {n} tokens"
        assert len(stream.cache) == min(n, 6)
        assert pool.num_free_blocks == 8 - len(block_ids)
    # free [3, 4, 5, 6, 7, 0]: b0 rejoined at the tail the moment index 3 left the window
    assert pool.allocator.free_block_ids() == [3, 4, 5, 6, 7, 0]
    assert stream.cache.values()[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_block_size_one_gives_every_token_its_own_block() -> None:
    # block_size 1, max_size 3, a pool of 4 blocks: the window rotates through them
    pool = shared(4, block_size=1)
    stream = Checked(KVCache(max_size=3, pool=pool))
    expected = [
        ([0], [1, 2, 3]),  # n=1   b0|0|
        ([0, 1], [2, 3]),  # n=2   b0|0| b1|1|
        ([0, 1, 2], [3]),  # n=3   b0|0| b1|1| b2|2|
        ([1, 2, 3], [0]),  # n=4   b0 freed (to the tail), then b3 taken from the head
        ([2, 3, 0], [1]),  # n=5   b1 freed, b0 reused
        ([3, 0, 1], [2]),  # n=6
        ([0, 1, 2], [3]),  # n=7   back where n=3 was
    ]
    for n, (block_ids, free) in enumerate(expected, start=1):
        stream.attend()
        assert (stream.cache.block_ids, pool.allocator.free_block_ids()) == (block_ids, free), n


def test_block_size_one_unbounded_holds_one_block_per_token() -> None:
    pool = shared(5, block_size=1)
    stream = Checked(KVCache(pool=pool))
    for n in range(1, 6):
        stream.attend()
        assert stream.cache.block_ids == list(range(n))
    assert pool.num_free_blocks == 0


def test_max_size_one_attends_to_the_new_token_alone() -> None:
    # block_size 4, max_size 1, a pool of 2 blocks
    pool = shared(2)
    cache = KVCache(max_size=1, pool=pool)
    expected = [
        [0], [0], [0], [0],  # n=1..4  b0 |- - - 3|: evicted slots stay in the held block
        [1], [1], [1], [1],  # n=5     b0 freed, b1 |4 . . .|
        [0],                 # n=9     b1 freed, b0 |8 . . .| reused
    ]
    for n, block_ids in enumerate(expected, start=1):
        q, k, v = token(n)
        # One entry gets weight exactly 1.0: the output is v itself, bit for bit.
        assert cache.attend(q, k, v) == v
        assert (len(cache), cache.block_ids, pool.num_free_blocks) == (1, block_ids, 1)
        cache.check_invariants()


def test_max_size_one_block_size_one_runs_forever_on_a_single_block() -> None:
    pool = shared(1, block_size=1)
    stream = Checked(KVCache(max_size=1, pool=pool))
    for _ in range(20):
        stream.attend()
        # b0 |n|: freed by the eviction, then taken again by the new token
        assert (stream.cache.block_ids, pool.num_free_blocks) == ([0], 0)


def test_max_size_smaller_than_block_size() -> None:
    # block_size 4, max_size 2, a pool of 3 blocks
    pool = shared(3)
    stream = Checked(KVCache(max_size=2, pool=pool))
    expected = [
        [0],     # n=1   b0 |0 . . .|
        [0],     # n=2   b0 |0 1 . .|
        [0],     # n=3   b0 |- 1 2 .|
        [0],     # n=4   b0 |- - 2 3|
        [0, 1],  # n=5   b0 |- - - 3| b1 |4 . . .|   the window straddles two blocks
        [1],     # n=6   b0 freed     b1 |4 5 . .|
        [1],     # n=7   b1 |- 5 6 .|
        [1],     # n=8   b1 |- - 6 7|
        [1, 2],  # n=9   b1 |- - - 7| b2 |8 . . .|
        [2],     # n=10  b1 freed     b2 |8 9 . .|
    ]
    for n, block_ids in enumerate(expected, start=1):
        stream.attend()
        assert stream.cache.block_ids == block_ids, n
        assert len(stream.cache) == min(n, 2)
    assert pool.allocator.free_block_ids() == [0, 1]


def test_max_size_equal_to_block_size() -> None:
    # block_size 4, max_size 4, a pool of 3 blocks
    pool = shared(3)
    stream = Checked(KVCache(max_size=4, pool=pool))
    expected = [
        [0], [0], [0], [0],  # n=1..4  b0 |0 1 2 3|
        [0, 1],              # n=5     b0 |- 1 2 3| b1 |4 . . .|
        [0, 1], [0, 1],      # n=6, 7  b0 |- - - 3| b1 |4 5 6 .|
        [1],                 # n=8     b0 freed     b1 |4 5 6 7|: the window is one whole block
        [1, 2],              # n=9     b1 |- 5 6 7| b2 |8 . . .|
        [1, 2], [1, 2],      # n=10,11
        [2],                 # n=12    b1 freed     b2 |8 9 10 11|
        [2, 0],              # n=13    b2 |- 9 10 11| b0 |12 . . .|  (b0 reused)
    ]
    for n, block_ids in enumerate(expected, start=1):
        stream.attend()
        assert stream.cache.block_ids == block_ids, n
        assert len(stream.cache) == min(n, 4)


def test_max_size_a_multiple_of_block_size() -> None:
    # block_size 4, max_size 8: at most ceil(8 / 4) + 1 = 3 blocks
    pool = shared(4)
    stream = Checked(KVCache(max_size=8, pool=pool))
    held = []
    for _ in range(16):
        stream.attend()
        held.append(stream.cache.block_ids)
    assert held[7] == [0, 1]        # n=8   b0 |0 1 2 3| b1 |4 5 6 7|
    assert held[8] == [0, 1, 2]     # n=9   b0 |- 1 2 3| b1 |...| b2 |8 . . .|
    assert held[11] == [1, 2]       # n=12  b0 freed: window 4..11 is exactly b1 b2
    assert held[12] == [1, 2, 3]    # n=13
    assert held[15] == [2, 3]       # n=16  b1 freed
    assert max(len(ids) for ids in held) == 3


# ----------------------------------------------------- exhaustion and reuse


def test_exhausted_shared_pool_then_reuse_after_another_cache_closes() -> None:
    # block_size 2, a pool of 3 blocks shared by caches A and B
    pool = shared(3, block_size=2)
    a, b = Checked(KVCache(pool=pool)), Checked(KVCache(pool=pool))
    a.attend()
    a.attend()
    b.attend()
    b.attend()
    b.attend()
    # A: b0 |0 1|      B: b1 |0 1| b2 |2 .|      free []
    assert (a.cache.block_ids, b.cache.block_ids, pool.num_free_blocks) == ([0], [1, 2], 0)
    q, k, v = token(2)
    with pytest.raises(PoolExhaustedError, match="need 1 block, 0 free of 3"):
        a.cache.attend(q, k, v)
    assert (len(a.cache), a.cache.block_ids, pool.num_free_blocks) == (2, [0], 0)
    # B's next token fits in the free slot of b2: no block needed, so no error.
    b.attend()
    # B: b1 |0 1| b2 |2 3|
    b.cache.close()
    # free [2, 1]: B's blocks, newest first
    assert pool.allocator.free_block_ids() == [2, 1]
    a.attend()
    # A: b0 |0 1| b2 |2 .|   (not one run of ids: attention gathers, bits unchanged)
    assert a.cache.block_ids == [0, 2]
    assert pool.allocator.free_block_ids() == [1]
    a.attend()
    a.attend()
    assert a.cache.block_ids == [0, 2, 1]
    pool.check_invariants()


def test_eviction_releases_a_block_in_time_for_the_new_token() -> None:
    # block_size 2, max_size 2, a pool of 2 blocks, one cache: it never runs out
    pool = shared(2, block_size=2)
    stream = Checked(KVCache(max_size=2, pool=pool))
    for _ in range(12):
        stream.attend()
        assert stream.cache.num_blocks <= 2


def test_a_window_straddling_two_blocks_exhausts_a_one_block_pool() -> None:
    # block_size 2, max_size 2, a pool of 1 block
    pool = shared(1, block_size=2)
    stream = Checked(KVCache(max_size=2, pool=pool))
    stream.attend()
    stream.attend()
    # b0 |0 1|. Token 2's window is 1..2: index 1 keeps b0 and index 2 needs a block.
    q, k, v = token(2)
    with pytest.raises(PoolExhaustedError, match="0 free of 1"):
        stream.cache.attend(q, k, v)
    assert (len(stream.cache), stream.cache.block_ids) == (2, [0])


# ------------------------------------------------------ queries and lifecycle


def test_defaults_and_queries() -> None:
    cache = KVCache()
    assert (cache.max_size, cache.block_size, cache.dtype, cache.scale) == (
        None, 16, np.dtype(np.float64), 1.0
    )
    assert (len(cache), cache.num_tokens, cache.num_blocks, cache.block_ids) == (0, 0, 0, [])
    assert cache.pool is None  # a private pool is made by the first attend
    assert cache.closed is False
    assert "max_size=None" in repr(cache)
    cache.check_invariants()


def test_cache_on_a_pool_takes_the_pools_block_size_and_dtype() -> None:
    pool = KVPool(2, block_size=3, head_dim=2, dtype=np.float32)
    cache = KVCache(pool=pool)
    assert (cache.block_size, cache.dtype, cache.pool) == (3, np.dtype(np.float32), pool)


def test_first_attend_creates_a_growable_private_pool_shaped_like_k() -> None:
    cache = KVCache(block_size=2)
    cache.attend(np.ones((4, 3)), np.ones((2, 3)), np.ones((2, 3)))
    assert cache.pool is not None
    assert cache.pool.growable is True
    assert (cache.pool.num_kv_heads, cache.pool.head_dim, cache.pool.block_size) == (2, 3, 2)


def test_num_tokens_counts_evicted_entries_len_does_not() -> None:
    stream = Checked(KVCache(max_size=3, block_size=2))
    for _ in range(7):
        stream.attend()
    assert (stream.cache.num_tokens, len(stream.cache)) == (7, 3)


def test_keys_and_values_are_logical_order_copies() -> None:
    pool = KVPool(6, block_size=2, num_kv_heads=2, head_dim=1)
    other = KVCache(pool=pool)
    cache = KVCache(max_size=3, pool=pool)
    history = []
    for i in range(6):
        k = np.array([[i], [10 + i]], float)  # (num_kv_heads, head_dim)
        history.append(k)
        cache.attend(np.zeros((2, 1)), k, -k)
        other.attend(np.zeros((2, 1)), k, k)  # interleaved: cache's blocks are not one run
    keys = cache.keys()
    assert keys.shape == (3, 2, 1)  # (len, num_kv_heads, head_dim)
    assert np.array_equal(keys, np.stack(history[3:]))
    assert np.array_equal(cache.values(), -np.stack(history[3:]))
    keys[:] = 99.0
    assert np.array_equal(cache.keys(), np.stack(history[3:]))


def test_keys_of_an_empty_cache() -> None:
    cache = KVCache()
    assert cache.keys().shape[0] == 0
    cache.attend([1.0, 2.0], [1.0, 2.0], [1.0, 2.0])
    cache.clear()
    assert cache.keys().shape == (0, 2)


def test_clear_gives_every_block_back_and_the_cache_starts_over() -> None:
    pool = shared(4, block_size=2)
    stream = Checked(KVCache(max_size=5, pool=pool))
    for _ in range(7):
        stream.attend()
    assert pool.num_free_blocks == 1
    stream.cache.clear()
    assert (len(stream.cache), stream.cache.num_tokens, stream.cache.block_ids) == (0, 0, [])
    assert pool.num_free_blocks == 4
    pool.check_invariants()
    # Starts over: the same outputs as a fresh cache given the same tokens.
    fresh = KVCache(max_size=5, block_size=2)
    for i in range(7):
        assert stream.cache.attend(*token(i)) == fresh.attend(*token(i))


def test_clear_forgets_the_largest_key_the_overflow_check_remembers() -> None:
    # The score bound is |scale| * sum|q| * max|k| over the keys attended over.
    # After a key of 1e300, a query of 1e300 could overflow (1e600), so attend
    # refuses it; once clear has dropped that key, the same query over a key of
    # 1.0 is bounded by 1e300 and must be answered.
    cache = KVCache()
    assert cache.attend([1e-300], [1e300], [2.0]) == [2.0]
    with pytest.raises(NonFiniteError, match="could reach"):
        cache.attend([1e300], [1.0], [3.0])
    cache.clear()
    assert cache.attend([1e300], [1.0], [3.0]) == [3.0]
    cache.check_invariants()


def test_close_gives_blocks_back_refuses_use_and_is_idempotent() -> None:
    pool = shared(2)
    cache = KVCache(pool=pool)
    cache.attend(*token(0))
    cache.close()
    assert cache.closed is True
    assert (len(cache), cache.block_ids, pool.num_free_blocks) == (0, [], 2)
    cache.close()
    assert pool.num_free_blocks == 2
    assert "closed" in repr(cache)
    pool.check_invariants()
    cache.check_invariants()


def test_private_cache_close_drops_its_pool() -> None:
    cache = KVCache()
    cache.attend(*token(0))
    cache.close()
    assert cache.pool is None
    assert len(cache) == 0


def test_context_manager_closes_even_when_the_body_raises() -> None:
    pool = shared(2)
    with pytest.raises(KeyError), KVCache(pool=pool) as cache:
        cache.attend(*token(0))
        assert pool.num_free_blocks == 1
        raise KeyError("boom")
    assert cache.closed
    assert pool.num_free_blocks == 2


def test_many_caches_share_one_pool_and_each_returns_its_blocks() -> None:
    pool = shared(6, block_size=2)
    streams = [Checked(KVCache(max_size=size, pool=pool)) for size in (None, 3, 1)]
    for _ in range(4):
        for stream in streams:
            stream.attend()
    held = [stream.cache.block_ids for stream in streams]
    # No block in two tables; every block either held once or free.
    flat = [block_id for ids in held for block_id in ids]
    assert sorted(flat + pool.allocator.free_block_ids()) == list(range(6))
    for stream in streams:
        freed = stream.cache.num_blocks
        before = pool.num_free_blocks
        stream.cache.close()
        assert pool.num_free_blocks == before + freed
    assert pool.num_free_blocks == 6


def test_a_dropped_cache_gives_its_blocks_back() -> None:
    pool = shared(2)
    cache: Any = KVCache(pool=pool)
    cache.attend(*token(0))
    del cache
    gc.collect()
    assert pool.num_free_blocks == 2
