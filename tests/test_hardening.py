"""Misuses that once passed silently (issue 11): threads, shared private pools, masked
arrays, edited or forged batches, and sizes too large to allocate.

Each test failed on the code before its fix; the comment above it says how.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from pagedkv import Batch, KVCache, KVCacheManager, KVPool
from pagedkv.errors import (
    ConfigError,
    InputTypeError,
    PoolTooLargeError,
    SequenceStateError,
)
from pagedkv.reference import attend_window

HEAD_DIM = 4
NUM_KV_HEADS = 2
#: The two-thread runs: a quarter of their steps under the quick profile (a
#: shared scratch planted back gave 345 and 157 wrong outputs at full length).
THREAD_STEPS_SCALE = 4 if os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE") == "ci" else 1


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Make the interpreter switch threads every microsecond, so races show up."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def _run_threads(work: Callable[[int], int], num_threads: int = 2) -> list[int]:
    """Run ``work(index)`` in threads; return what each returned (re-raising any error)."""
    results: list[Any] = [None] * num_threads

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except BaseException as error:  # re-raised below, in the test's thread
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# ------------------------------------------------------------------- threads


# Before: KVPool.gather returned a view of ONE scratch buffer per pool, which the
# other thread overwrote: about 30 wrong outputs in 20,000, no exception.
def test_two_threads_with_their_own_caches_on_one_pool_get_every_output_right(
    tiny_switch_interval: None,
) -> None:
    num_steps, window = 2_500 * THREAD_STEPS_SCALE, 12
    pool = KVPool(2 * 5, block_size=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=np.float32)
    caches = [KVCache(max_size=window, pool=pool) for _ in range(2)]

    def work(index: int) -> int:
        rng = np.random.default_rng(index)
        cache, history = caches[index], []
        num_wrong = 0
        for _ in range(num_steps):
            q, k, v = rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
            history.append((k, v))
            out = cache.attend(q, k, v)
            keys = [key for key, _ in history[-window:]]
            values = [value for _, value in history[-window:]]
            expected = attend_window(q, keys, values, dtype=np.float32)
            num_wrong += not np.array_equal(out, expected)
        return num_wrong

    assert _run_threads(work) == [0, 0]
    for cache in caches:
        cache.check_invariants()
        cache.close()
    assert pool.num_free_blocks == pool.num_blocks  # every block back
    pool.check_invariants()


# Before: two threads on one manager, each driving its own sequences, got about
# 100 wrong outputs in 20,000 (the same shared scratch, and unlocked reserves).
def test_two_threads_driving_their_own_sequences_of_one_manager_get_every_output_right(
    tiny_switch_interval: None,
) -> None:
    num_steps, window = 1_250 * THREAD_STEPS_SCALE, 10
    pool = KVPool(24, block_size=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=np.float32)
    manager = KVCacheManager(pool, max_size=window)

    def work(index: int) -> int:
        rng = np.random.default_rng(10 + index)
        seq_ids = [f"t{index}-a", f"t{index}-b"]
        for seq_id in seq_ids:
            manager.add_sequence(seq_id)
        histories: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {seq_id: [] for seq_id in seq_ids}
        num_wrong = 0
        for step in range(num_steps):
            seq_id = seq_ids[step % 2]
            q, k, v = rng.standard_normal((3, 1, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
            batch = manager.reserve({seq_id: 1})
            manager.write(0, batch, k, v)
            out = manager.attend(0, batch, q)
            history = histories[seq_id]
            history.append((k[0], v[0]))
            expected = attend_window(
                q[0], [key for key, _ in history[-window:]], [value for _, value in history[-window:]],
                dtype=np.float32,
            )
            num_wrong += not np.array_equal(out[0], expected)
        for seq_id in seq_ids:
            manager.free(seq_id)
        return num_wrong

    assert _run_threads(work) == [0, 0]
    manager.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


# -------------------------------------------------- a private pool shared by accident


# Before: accepted; the owner then compacted its private pool under the second
# cache, and every later output of the second cache was wrong.
def test_a_cache_refuses_another_caches_private_pool_and_nothing_changes() -> None:
    owner = KVCache(max_size=4, block_size=2)
    owner.attend([1.0], [1.0], [1.0])
    private = owner.pool
    assert private is not None and private.growable
    free_before = private.allocator.free_block_ids()
    with pytest.raises(ConfigError, match=r"pool is growable.*KVPool\(num_blocks"):
        KVCache(pool=private)
    assert private.allocator.free_block_ids() == free_before
    owner.check_invariants()


# ------------------------------------------------------------------ masked arrays


def _masked_nan() -> np.ma.MaskedArray:
    return np.ma.masked_array([1.0, np.nan], mask=[False, True])


# Before: the mask hid the NaN from the finiteness check and the NaN was stored.
@pytest.mark.parametrize("field", ["q", "k", "v"])
def test_the_cache_refuses_masked_arrays_and_nothing_changes(field: str) -> None:
    cache = KVCache(block_size=2)
    cache.attend([1.0, 0.0], [1.0, 0.0], [2.0, 3.0])
    args = {"q": np.ones(2), "k": np.ones(2), "v": np.ones(2), field: _masked_nan()}
    with pytest.raises(InputTypeError, match=f"{field} is a masked array"):
        cache.attend(args["q"], args["k"], args["v"])
    assert len(cache) == 1 and np.isfinite(cache.values()).all()
    cache.check_invariants()


def test_the_manager_refuses_masked_keys_and_nothing_changes() -> None:
    manager = KVCacheManager(KVPool(4, block_size=2, head_dim=2))
    manager.add_sequence("a")
    batch = manager.reserve({"a": 1})
    keys = np.ma.masked_array(np.array([[[1.0, np.nan]]]), mask=[[[False, True]]])
    with pytest.raises(InputTypeError, match="keys is a masked array"):
        manager.write(0, batch, keys, np.ones((1, 1, 2)))
    assert not np.isnan(manager.pool.keys(0)).any()
    manager.write(0, batch, np.ones((1, 1, 2)), np.ones((1, 1, 2)))  # the reservation still stands
    manager.check_invariants()


# ---------------------------------------------------------------- edited or forged batches


def _two_sequences() -> tuple[KVCacheManager, Any]:
    manager = KVCacheManager(KVPool(8, block_size=2, head_dim=1))
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id)
        first = manager.reserve({seq_id: 2})
        manager.write(0, first, np.full((2, 1, 1), 7.0), np.full((2, 1, 1), 7.0))
    return manager, manager.reserve({"a": 1})


# Before: the arrays were writable; editing slot_mapping aimed "a"'s new key at "b"'s slots.
def test_a_batchs_arrays_are_read_only_for_good() -> None:
    manager, batch = _two_sequences()
    for array in (batch.slot_mapping, batch.query_start):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0
        with pytest.raises(ValueError):
            array.flags.writeable = True
    manager.check_invariants()


# Before: a forged batch with the right stamps and another sequence's slots was written.
def test_write_and_attend_refuse_a_batch_that_reserve_did_not_return() -> None:
    manager, batch = _two_sequences()
    b_slots = np.array([manager.block_table("b").slot(0)], np.int64)
    forged = Batch(  # reserve's batch with another slot mapping
        batch.seq_ids, batch.num_new_tokens, batch.first_positions, batch.query_start, b_slots,
        batch.reservation_ids,
    )
    b_keys_before = manager.pool.keys(0).copy()
    with pytest.raises(SequenceStateError, match=r"not the one reserve\(\) returned"):
        manager.write(0, forged, np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))
    assert np.array_equal(manager.pool.keys(0), b_keys_before)
    manager.write(0, batch, np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))
    with pytest.raises(SequenceStateError, match=r"not the one reserve\(\) returned"):
        manager.attend(0, forged, np.zeros((1, 1, 1)))
    manager.check_invariants()


# ---------------------------------------------------------------- sizes too large


# Before: an empty MemoryError, an OverflowError, numpy's own MemoryError, and a bare
# ValueError (block_size 10**18); none named the bytes wanted.
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 10**12, "head_dim": 1},
        {"num_blocks": 2**63, "head_dim": 1},
        {"num_blocks": 4, "head_dim": 10**12},
        {"num_blocks": 4, "block_size": 10**18, "head_dim": 1},
    ],
)
def test_a_pool_too_large_to_allocate_says_how_many_bytes_it_wanted(kwargs: dict[str, int]) -> None:
    with pytest.raises(PoolTooLargeError, match=r"wants [0-9,]+ bytes") as info:
        KVPool(**kwargs)
    assert isinstance(info.value, MemoryError) and info.value.num_bytes > 10**12


def test_a_cache_whose_private_pool_cannot_be_made_is_unchanged() -> None:
    cache = KVCache(block_size=10**18)
    with pytest.raises(PoolTooLargeError):
        cache.attend([1.0], [1.0], [1.0])
    assert cache.pool is None and len(cache) == 0 and cache.num_tokens == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"layer_max_sizes": 5}, InputTypeError, "layer_max_sizes must be a list"),
        ({"layer_max_sizes": ["4"]}, InputTypeError, "layer_max_sizes entry"),
        ({"enable_prefix_caching": 1}, InputTypeError, "enable_prefix_caching must be True or False"),
        ({"hash_algorithm": "md5"}, ConfigError, "hash_algorithm must be"),
    ],
)
def test_bad_manager_arguments_are_typed(kwargs: dict[str, Any], error: type, fragment: str) -> None:
    pool = KVPool(4, block_size=2, head_dim=1)
    with pytest.raises(error, match=fragment):
        KVCacheManager(pool, **kwargs)
    assert pool.num_free_blocks == 4


def test_a_prompt_that_is_not_token_ids_is_an_input_type_error() -> None:
    manager = KVCacheManager(KVPool(4, block_size=2, head_dim=1))
    with pytest.raises(InputTypeError, match="prompt must be a sequence of token ids, got 5"):
        manager.add_sequence("a", prompt=5)  # type: ignore[arg-type]
    assert "a" not in manager


# Before: pool.keys(5) raised a bare IndexError and pool.keys(-1) silently read the last layer.
@pytest.mark.parametrize("layer", [1, -1, "0"])
def test_a_pools_layer_accessors_refuse_layers_it_does_not_have(layer: Any) -> None:
    from pagedkv.errors import LayerIndexError

    pool = KVPool(2, block_size=2, head_dim=1, key_dtype="int8", value_dtype="int8")
    for accessor in (pool.keys, pool.values, pool.key_scales, pool.value_scales):
        with pytest.raises((LayerIndexError, InputTypeError), match="layer"):
            accessor(layer)


# Before: BlockTable(0) raised ZeroDivisionError.
@pytest.mark.parametrize(
    ("args", "error"), [((0,), ConfigError), (("4",), InputTypeError), ((4, -1), ConfigError)]
)
def test_a_block_table_refuses_bad_sizes(args: tuple[Any, ...], error: type) -> None:
    from pagedkv import BlockTable

    with pytest.raises(error):
        BlockTable(*args)


# Before: a position past the table raised numpy's bare IndexError.
def test_slot_mapping_refuses_positions_outside_the_table() -> None:
    from pagedkv.errors import ShapeError
    from pagedkv.integrations.interop import slot_mapping

    assert slot_mapping([3, 7], [0, 5], 4).tolist() == [12, 29]
    for position in (8, -1, 1.5):
        with pytest.raises(ShapeError, match="not a logical index of this table"):
            slot_mapping([3, 7], [position], 4)  # type: ignore[list-item]


# Issue 15's reproducer: blocks leaving a window in one reserve were freed oldest
# first, so the shortest prefix was evicted first and stranded the keys behind it.
def test_blocks_leaving_a_window_together_are_freed_newest_first() -> None:
    manager = KVCacheManager(KVPool(5, block_size=2, head_dim=1), max_size=4, enable_prefix_caching=True)
    manager.add_sequence("a")
    ones = np.ones((8, 1, 1))
    batch = manager.reserve({"a": list(range(8))})
    manager.write(0, batch, ones, ones)
    batch = manager.reserve({"a": [8]})  # the window now starts at 5: blocks 0 and 1 leave together
    manager.write(0, batch, ones[:1], ones[:1])
    assert manager.pool.allocator.cached_free_block_ids() == [1, 0]
    manager.add_sequence("b")
    two = manager.reserve({"b": [50, 51]})  # no plain free block: evicts the longer prefix (block 1)
    manager.write(0, two, ones[:2], ones[:2])
    manager.free("b")
    assert manager.add_sequence("c", [0, 1, 2, 3, 99]) == 2  # block 0 (tokens 0, 1) is still found
    manager.check_invariants()


@pytest.mark.parametrize("view_mode", ["views", "gather"])
def test_pools_caches_and_managers_refuse_pickle_and_copy_by_name_and_stay_usable(view_mode: str) -> None:
    import copy
    import pickle

    pool = KVPool(8, block_size=16, num_kv_heads=1, head_dim=64, dtype=np.float32, view_mode=view_mode)
    cache = KVCache(pool=pool)
    manager = KVCacheManager(KVPool(8, block_size=16, num_kv_heads=1, head_dim=64, dtype=np.float32))
    one = np.ones(64, np.float32)
    before = cache.attend(one, one, one)
    for obj, name in ((pool, "KVPool"), (cache, "KVCache"), (manager, "KVCacheManager")):
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(InputTypeError, match=f"a {name} cannot be pickled or copied.*snapshot.save"):
                attempt(obj)
    assert pool.num_free_blocks == 7 and len(cache) == 1
    assert np.allclose(cache.attend(one, one, one), before)
    pool.check_invariants()
    manager.check_invariants()
