"""A failed attention leaves everything as before ``KVCache.attend`` (issue 27, defect 5).

The attention runs after the append; when it raises, the append is taken back
whole: the table (evicted blocks included), the allocator's free queue order,
ref counts and cached marks, the slots of live blocks, and every other cache on
the pool. Each test makes the attention fail once before every real step, so
steps that take a block, evict whole blocks, or both are all covered::

    block_size 2, max_size 3, a full shared pool
    time t:    table [b3 b5]     free queue []          (b3 holds one live entry)
    time t+1:  evict b3, take b3 (the only free block), write slot 0 of b3
    failed:    table [b3 b5]     free queue []          b3's slots as at time t
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv import KVCache, KVPool
from pagedkv.errors import ConfigError

H, D = 1, 1024  # a block of any block_size fills whole 4 KiB pages, so page views can map it


def make_pool(num_blocks: int, block_size: int, view_mode: str) -> KVPool:
    try:
        return KVPool(num_blocks, block_size=block_size, num_kv_heads=H, head_dim=D,
                      dtype=np.float32, view_mode=view_mode)
    except ConfigError as error:  # no page file on this system
        pytest.skip(str(error))


def snapshot(caches: list[KVCache], pool: KVPool | None) -> Any:
    """Everything a failed attend must leave alone, as plain values."""
    caches_state = [
        (len(c), c.num_tokens, c.block_ids, c.keys().tobytes(), c.values().tobytes())
        for c in caches
    ]
    if pool is None:
        pool = caches[0].pool
    allocator = None if pool is None else pool.allocator._export_state()
    free = None if pool is None else pool.allocator.free_block_ids()
    return caches_state, allocator, free


def broken(*args: object) -> object:
    raise MemoryError("no memory for the scores")


def run_with_failures(
    monkeypatch: pytest.MonkeyPatch, cache: KVCache, other: KVCache | None, reference: KVCache,
    num_steps: int,
) -> list[int]:
    """Before every step, a failed attend that must change nothing; then the real step.

    Returns the pool's free block count before each real step.
    """
    free_counts: list[int] = []
    rng = np.random.default_rng(7)
    tokens = (rng.standard_normal((num_steps, 3, H, D)) / 4).astype(np.float32)
    caches = [cache] if other is None else [cache, other]
    for step, (q, k, v) in enumerate(tokens):
        if cache.pool is None:  # a private pool is made at the first attend (and kept: see attend)
            assert np.array_equal(cache.attend(q, k, v), reference.attend(q, k, v))
            continue
        before = snapshot(caches, cache.pool)
        monkeypatch.setattr("pagedkv.cache.attend_sequence", broken)
        with pytest.raises(MemoryError, match="no memory for the scores"):
            cache.attend(q, k, v)
        monkeypatch.undo()
        after = snapshot(caches, cache.pool)
        num_before = len(before[1].ref_counts)
        if cache.pool is not None and cache.pool.growable and len(after[1].ref_counts) > num_before:
            # The one documented exception: a private pool that grew keeps its new blocks, free, last.
            grown, after_state, free = after
            assert after_state.ref_counts[num_before:] == [0] * (len(after_state.ref_counts) - num_before)
            assert free[len(free) - (len(after_state.ref_counts) - num_before):] == list(
                range(num_before, len(after_state.ref_counts)))
            after = (grown, type(after_state)(after_state.ref_counts[:num_before],
                                              [b for b in after_state.free if b < num_before],
                                              after_state.cached_free, after_state.cached),
                     [b for b in free if b < num_before])
        assert after == before, f"step {step} changed something"
        free_counts.append(cache.pool.num_free_blocks if cache.pool is not None else -1)
        cache.check_invariants()
        out = cache.attend(q, k, v)
        assert np.array_equal(out, reference.attend(q, k, v)), f"step {step}"
        if other is not None and step % 3 == 0:  # the other cache takes and frees blocks too
            other.attend(q, k, v)
    return free_counts


@pytest.mark.parametrize("view_mode", ["gather", "views"])
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_failed_attend_on_a_full_shared_pool_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, view_mode: str, block_size: int
) -> None:
    max_size = 3
    window = -(-max_size // block_size) + 1
    pool = make_pool((max_size - 2) // block_size + 2 + 3, block_size, view_mode)  # full at steady state
    other = KVCache(pool=pool)
    for k in np.ones((2 * block_size + 1, H, D), np.float32):
        other.attend(k, k, k)
    cache = KVCache(max_size, pool=pool)
    reference = KVCache(max_size, pool=make_pool(window, block_size, "gather"))
    free_counts = run_with_failures(monkeypatch, cache, None, reference, 17)
    assert 0 in free_counts[4:]  # a step took straight back the block it evicted
    pool.check_invariants()


@pytest.mark.parametrize("view_mode", ["gather", "views"])
def test_failed_attend_beside_another_busy_cache_changes_neither(
    monkeypatch: pytest.MonkeyPatch, view_mode: str
) -> None:
    pool = make_pool(24, 2, view_mode)
    other = KVCache(4, pool=pool)
    cache = KVCache(3, pool=pool)
    reference = KVCache(3, pool=make_pool(8, 2, "gather"))
    run_with_failures(monkeypatch, cache, other, reference, 20)
    pool.check_invariants()


@pytest.mark.parametrize("max_size", [None, 3, 5])
def test_failed_attend_on_a_private_pool_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, max_size: int | None
) -> None:
    # A private pool grows (unbounded) or is re-laid by _compact (max_size): both on failing steps.
    cache = KVCache(max_size, block_size=2, dtype=np.float32)
    reference = KVCache(max_size, pool=make_pool(64, 2, "gather"))
    run_with_failures(monkeypatch, cache, None, reference, 30)


def test_failed_attend_with_int8_keys_keeps_the_reused_block_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(4, block_size=1, num_kv_heads=H, head_dim=D, dtype=np.float32, key_dtype="int8")
    cache = KVCache(3, pool=pool)
    reference = KVCache(3, pool=KVPool(4, block_size=1, num_kv_heads=H, head_dim=D,
                                       dtype=np.float32, key_dtype="int8"))
    run_with_failures(monkeypatch, cache, None, reference, 10)
