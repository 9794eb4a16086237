"""Tests for prefix caching: block keys, the cached free LRU, and admission lookup.

States are drawn with block_size 2 unless a test says otherwise::

    a: b0 |1 2| b1 |3 4| b2 |5 .|    sequence a's table; b0 and b1 are full
    keys: b0 = H(ROOT, [1 2]), b1 = H(b0, [3 4])    b2 is partial: no key
    free [3, 4]   cached free [1, 0]   plain free queue head first; cached
                                       free blocks least recently freed first

Outputs are checked bit for bit against the same sequence computed from
scratch on a manager without prefix caching, with the same chunking.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from support.managers import make_manager
from support.prefix import SHA256, Runner, from_scratch, key_chain, kv_of, make, prefix_of

from pagedkv import BlockAllocator, KVCacheManager, KVPool, SequenceState
from pagedkv.errors import BlockStateError, ConfigError, InputTypeError, SequenceStateError, UnknownBlockError
from pagedkv.prefix.cache import (
    ROOT_KEY,
    PrefixCache,
    hash_function,
)
from pagedkv.prefix.keys import encode_extra_keys

# ------------------------------------------------------------------ block keys


def test_sha256_is_the_default_and_is_hashlibs() -> None:
    assert make().hash_algorithm == "sha256"
    assert SHA256(b"pagedkv") == hashlib.sha256(b"pagedkv").digest()
    assert len(key_chain([1, 2])[0]) == 32


def test_a_key_is_sha256_of_the_length_prefixed_parent_tokens_and_extras() -> None:
    # key(block 0) = H("P" len ROOT  "T" len tokens  extras): every field length-prefixed.
    tokens = struct.pack("<2q", 1, 2)
    encoded = b"P" + struct.pack("<Q", len(ROOT_KEY)) + ROOT_KEY + b"T" + struct.pack("<Q", 16) + tokens
    assert key_chain([1, 2]) == [hashlib.sha256(encoded).digest()]


def test_xxh3_128_gives_16_byte_keys_that_hit_like_sha256() -> None:
    xxhash = pytest.importorskip("xxhash")
    assert hash_function("xxh3_128")(b"x") == xxhash.xxh3_128_digest(b"x")
    runner = Runner(make(hash_algorithm="xxh3_128"))
    runner.add("a", [1, 2, 3, 4, 5])
    runner.feed({"a": [1, 2, 3, 4, 5]})
    assert {len(key) for key in prefix_of(runner.manager)._block_of} == {16}
    assert runner.add("b", [1, 2, 3, 4, 5]) == 4


def test_xxh3_128_without_xxhash_raises_import_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # "import xxhash" now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "pagedkv\[xxhash\]"'):
        hash_function("xxh3_128")
    pool = KVPool(4, block_size=2, head_dim=1)
    with pytest.raises(ImportError, match=r"pagedkv\[xxhash\]"):
        KVCacheManager(pool, enable_prefix_caching=True, hash_algorithm="xxh3_128")
    # Nothing changed: the pool is free for a manager with the default hash.
    assert pool.allocator.on_evict is None
    KVCacheManager(pool, enable_prefix_caching=True)


def test_an_unknown_hash_algorithm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'md5'"):
        hash_function("md5")
    pool = KVPool(4, block_size=2, head_dim=1)
    with pytest.raises(ConfigError, match="sha256"):
        KVCacheManager(pool, enable_prefix_caching=True, hash_algorithm="md5")


def test_keys_exist_only_for_full_blocks() -> None:
    # |1 2|3 4|5 .|  -> two keys
    assert len(key_chain([1, 2, 3, 4, 5])) == 2
    assert key_chain([1]) == []


def test_a_key_chains_its_parent_so_equal_blocks_after_different_prefixes_differ() -> None:
    # |1 2|3 4|  and  |2 1|3 4|: block 1 holds the same tokens, but its prefix differs.
    first, second = key_chain([1, 2, 3, 4]), key_chain([2, 1, 3, 4])
    assert first[0] != second[0]
    assert first[1] != second[1]
    assert key_chain([1, 2, 3, 4, 9]) == first  # a longer prompt extends the same chain


def test_extra_keys_are_tagged_by_kind_and_by_type() -> None:
    assert encode_extra_keys(None) == encode_extra_keys({}) == b""
    assert encode_extra_keys({"salt": "a"}) != encode_extra_keys({"adapter": "a"})
    assert encode_extra_keys({"salt": "1"}) != encode_extra_keys({"salt": 1})
    assert encode_extra_keys({"salt": "a"}) != encode_extra_keys({"salt": b"a"})
    assert encode_extra_keys({"salt": ""}) != b""
    # Order of the mapping does not matter.
    both = encode_extra_keys({"salt": "s", "adapter": "x"})
    assert both == encode_extra_keys({"adapter": "x", "salt": "s"})


extra_value = st.one_of(st.text(max_size=3), st.binary(max_size=3), st.integers(-3, 300))
extra_keys_strategy = st.dictionaries(st.sampled_from(["salt", "adapter", "multimodal"]), extra_value)


@given(extra_keys_strategy, extra_keys_strategy)
def test_extra_key_encoding_is_injective(a: dict[str, Any], b: dict[str, Any]) -> None:
    typed = {kind: (type(value), value) for kind, value in a.items()}
    other = {kind: (type(value), value) for kind, value in b.items()}
    assert (encode_extra_keys(a) == encode_extra_keys(b)) == (typed == other)


@given(extra_keys_strategy, extra_keys_strategy)
def test_extra_keys_never_move_a_token_boundary(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Keys with different extras differ even when the token bytes could absorb the difference."""
    if encode_extra_keys(a) != encode_extra_keys(b):
        assert key_chain([1, 2], extra_keys=a) != key_chain([1, 2], extra_keys=b)


@pytest.mark.parametrize(
    ("extra_keys", "error", "fragment"),
    [
        ({"tenant": "x"}, ConfigError, "'tenant'"),
        ({"salt": 1.5}, InputTypeError, "1.5"),
        ({"salt": True}, InputTypeError, "True"),
        ({"salt": None}, InputTypeError, "None"),
    ],
)
def test_bad_extra_keys_are_refused_with_nothing_changed(
    extra_keys: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    manager = make()
    before = manager.metrics()
    with pytest.raises(error, match=fragment):
        manager.add_sequence("a", [1, 2, 3], extra_keys=extra_keys)
    assert "a" not in manager
    assert manager.metrics() == before


@pytest.mark.parametrize("prompt", [[1, True], [1, -1], [1, 2**63], [1, 2.0], ["a"]])
def test_bad_token_ids_are_refused_with_nothing_changed(prompt: list[Any]) -> None:
    manager = make()
    before = manager.metrics()
    with pytest.raises(InputTypeError):
        manager.add_sequence("a", prompt)
    assert "a" not in manager
    assert manager.metrics() == before


# ---------------------------------------------- PrefixCache and the cached LRU


def test_register_first_wins_and_a_keyed_block_keeps_its_key() -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    b0, b1 = allocator.allocate(2)
    assert cache.register(b0, b"k")
    assert not cache.register(b1, b"k")  # the same contents computed twice: b1 stays unkeyed
    assert not cache.register(b0, b"other")  # b0 keeps its key
    assert (cache.block_for(b"k"), cache.key_of(b0), cache.key_of(b1)) == (b0, b"k", None)
    assert cache.block_for(b"other") is None
    cache.check_invariants()


@given(
    pairs=st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 5)), st.sampled_from([b"a", b"b", b"c", b"d"])),
        max_size=8,
    ),
    keyed_first=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([b"a", b"x"])), max_size=2),
)
def test_register_blocks_is_register_of_each_pair_in_turn(
    pairs: list[tuple[int | None, bytes]], keyed_first: list[tuple[int, bytes]]
) -> None:
    def fresh() -> tuple[BlockAllocator, PrefixCache]:
        allocator = BlockAllocator(6)
        cache = PrefixCache(allocator)
        allocator.allocate(6)
        for block_id, key in keyed_first:
            cache.register(block_id, key)
        return allocator, cache

    one_by_one_allocator, one_by_one = fresh()
    expected = [block_id is not None and one_by_one.register(block_id, key) for block_id, key in pairs]
    allocator, cache = fresh()
    assert cache.register_blocks([b for b, _ in pairs], [k for _, k in pairs]) == expected
    assert cache._block_of == one_by_one._block_of and cache._key_of == one_by_one._key_of
    assert allocator._cached == one_by_one_allocator._cached
    cache.check_invariants()


@pytest.mark.parametrize("bad_id", [3, 9, -1, 2.0])  # free, not in the pool, negative, a float
def test_register_blocks_with_an_id_the_allocator_refuses_changes_nothing(bad_id: object) -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    allocator.allocate(3)
    cache.register(0, b"k0")
    before = (dict(cache._block_of), dict(cache._key_of), set(allocator._cached))
    with pytest.raises((BlockStateError, UnknownBlockError)):
        cache.register_blocks([1, bad_id], [b"k1", b"k2"])  # type: ignore[list-item]
    assert (cache._block_of, cache._key_of, allocator._cached) == before
    cache.check_invariants()


def test_plain_free_blocks_go_first_then_cached_ones_least_recently_freed_first() -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    blocks = allocator.allocate(4)
    cache.register(blocks[0], b"k0")
    cache.register(blocks[1], b"k1")
    allocator.free([1, 0, 2, 3])
    # free [2, 3]   cached free [1, 0]
    assert allocator.free_block_ids() == [2, 3]
    assert allocator.cached_free_block_ids() == [1, 0]
    assert allocator.num_free_blocks == 4 and allocator.num_cached_free_blocks == 2
    assert allocator.allocate(2) == [2, 3]  # plain ones first: nothing evicted
    assert cache.num_evictions == 0 and cache.num_cached_blocks == 2
    assert allocator.allocate_one() == 1  # then the least recently freed cached one
    # b1 evicted: its key dropped at that moment.
    assert cache.block_for(b"k1") is None and cache.key_of(1) is None
    assert cache.num_evictions == 1 and cache.num_cached_blocks == 1
    cache.check_invariants()
    allocator.check_invariants()


def keyed(num_blocks: int, *keys: bytes) -> tuple[BlockAllocator, PrefixCache]:
    """A prefix cache on a fresh allocator whose first ``len(keys)`` blocks are in use, keyed ``keys``."""
    allocator = BlockAllocator(num_blocks)
    cache = PrefixCache(allocator)
    for block_id, key in zip(allocator.allocate(len(keys)), keys):
        cache.register(block_id, key)
    return allocator, cache


def test_a_revived_block_goes_to_the_back_of_the_lru_when_freed_again() -> None:
    allocator, cache = keyed(2, b"k0", b"k1")
    allocator.free([0, 1])
    # cached free [0, 1]
    allocator.revive(0)
    allocator.free_one(0)
    # cached free [1, 0]: block 0 was used most recently
    assert allocator.cached_free_block_ids() == [1, 0]
    assert allocator.allocate_one() == 1
    assert cache.block_for(b"k0") == 0 and cache.block_for(b"k1") is None


def test_evicting_never_touches_a_block_in_use() -> None:
    allocator = BlockAllocator(3)
    cache = PrefixCache(allocator)
    used, cached = allocator.allocate(2)
    cache.register(used, b"used")
    cache.register(cached, b"cached")
    allocator.free_one(cached)
    assert allocator.allocate(2) == [2, cached]
    assert cache.block_for(b"used") == used and allocator.ref_count(used) == 1
    with pytest.raises(MemoryError):
        allocator.allocate_one()
    cache.check_invariants()


def test_reset_turns_every_cached_free_block_into_a_plain_one() -> None:
    allocator, cache = keyed(3, b"k0", b"k1")
    allocator.free([1, 0])
    cache.reset()
    # free [2, 0, 1]   cached free []   (the keyed blocks join the tail, in the order they were keyed)
    assert allocator.free_block_ids() == [2, 0, 1]
    assert allocator.cached_free_block_ids() == []
    assert cache.num_cached_blocks == 0
    cache.check_invariants()
    allocator.check_invariants()


def test_the_longest_prefix_stops_at_a_missing_block_and_never_skips_it() -> None:
    # keys k0 k1 k2 of |1 2|3 4|5 6|; k1's block is gone, k0 and k2 are cached:
    #   k0 -> b0    k1 -> ?    k2 -> b1
    k0, k1, k2 = key_chain([1, 2, 3, 4, 5, 6])
    _, cache = keyed(2, k0, k2)
    assert cache.longest_prefix([k0, k1, k2]) == [0]
    assert cache.longest_prefix([k1, k2]) == []
    assert cache.longest_prefix([k0]) == [0]


def test_check_invariants_sees_a_key_on_the_wrong_block() -> None:
    allocator = BlockAllocator(2)
    cache = PrefixCache(allocator)
    b0, b1 = allocator.allocate(2)
    cache.register(b0, b"k")
    cache._block_of[b"k"] = b1  # corrupt: the map names a block that holds another key
    with pytest.raises(AssertionError, match="does not hold"):
        cache.check_invariants()


def test_check_invariants_sees_a_plain_free_block_with_a_key() -> None:
    allocator = BlockAllocator(2)
    cache = PrefixCache(allocator)
    b0 = allocator.allocate_one()
    cache.register(b0, b"k")
    allocator.free_one(b0)
    allocator._cached.discard(b0)  # corrupt: a keyed block that is no longer marked cached
    with pytest.raises(AssertionError):
        cache.check_invariants()


# --------------------------------------------------------- admission lookup


def test_keys_are_registered_only_when_a_block_is_full_and_written_in_every_layer() -> None:
    runner = Runner(make(num_layers=2))
    runner.add("a", [])
    batch = runner.manager.reserve({"a": [1, 2, 3]})
    # a: |1 2|3 .|  layer 0 written, layer 1 not: no key yet
    kv = np.ones((3, 1, 2))
    runner.manager.write(0, batch, kv, kv)
    assert runner.manager.metrics().num_cached_blocks == 0
    assert runner.manager.add_sequence("probe", [1, 2, 3]) == 0
    runner.manager.write(1, batch, kv, kv)
    # every layer written: block 0 (full) gets its key, block 1 (partial) none
    assert runner.manager.metrics().num_cached_blocks == 1
    first_block = runner.manager.block_table("a").block_ids[0]
    assert prefix_of(runner.manager).block_for(key_chain([1, 2])[0]) == first_block
    runner.manager.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("length", range(1, 8))
def test_lookup_leaves_at_least_the_last_token_to_compute(block_size: int, length: int) -> None:
    prompt = list(range(10, 10 + length))
    runner = Runner(make(num_blocks=16, block_size=block_size))
    runner.add("a", prompt)
    runner.feed({"a": [*prompt, 99]})  # every block of the prompt is cached
    num_hit = runner.add("b", prompt)
    assert num_hit == (length - 1) // block_size * block_size
    assert num_hit < length
    runner.feed({"b": prompt[num_hit:]})  # the rest computes without error


def test_a_hit_shares_blocks_by_ref_count_and_the_caller_writes_only_the_rest() -> None:
    runner = Runner(make())
    runner.add("a", [1, 2, 3, 4, 5])
    runner.feed({"a": [1, 2, 3, 4, 5]})
    # a: b0 |1 2| b1 |3 4| b2 |5 .|
    manager = runner.manager
    assert runner.add("b", [1, 2, 3, 4, 7, 8]) == 4
    # b: b0 |1 2| b1 |3 4|   shared, nothing allocated
    assert manager.block_table("b").block_ids == [0, 1]
    assert [manager.pool.allocator.ref_count(i) for i in (0, 1, 2)] == [2, 2, 1]
    assert manager.num_tokens("b") == 4
    runner.feed({"b": [7, 8]})
    # b: b0 |1 2| b1 |3 4| b3 |7 8|   b3 full and written: keyed
    assert manager.block_table("b").block_ids == [0, 1, 3]
    assert prefix_of(manager).block_for(key_chain([1, 2, 3, 4, 7, 8])[2]) == 3


def test_a_count_reservation_of_a_keyed_sequence_is_refused_and_changes_nothing() -> None:
    manager = make()
    manager.add_sequence("a", [1, 2, 3, 4])
    before = (manager.pool.allocator.free_block_ids(), manager.block_table("a").block_ids)
    with pytest.raises(ConfigError, match=r"caches its blocks by prefix.*cache_blocks=False"):
        manager.reserve({"a": 4})  # a count: keying would silently stop for this sequence
    assert (manager.pool.allocator.free_block_ids(), manager.block_table("a").block_ids) == before
    manager.check_invariants()


def test_a_sequence_added_with_cache_blocks_false_reserves_by_count_and_is_never_keyed() -> None:
    manager = make()
    manager.add_sequence("a", [1, 2, 3, 4], cache_blocks=False)
    batch = manager.reserve({"a": 4})  # counts, not token ids: the contents are unknown
    manager.write(0, batch, np.ones((4, 1, 2)), np.ones((4, 1, 2)))
    assert manager.metrics().num_cached_blocks == 0
    manager.check_invariants()


def test_cache_blocks_must_be_a_bool() -> None:
    manager = make()
    with pytest.raises(InputTypeError, match="cache_blocks must be True or False"):
        manager.add_sequence("a", [1, 2], cache_blocks=1)  # type: ignore[arg-type]
    assert "a" not in manager


def test_with_a_window_only_the_blocks_the_next_token_sees_are_shared() -> None:
    # W = 3, block_size 2, a 9-token prompt fully computed by a:
    #   logical   |0 1|2 3|4 5|6 7|8 .|
    #   a holds   b2  b3  (b0, b1 freed by the window: cached free, still keyed)
    # b's lookup of the same prompt hits 4 blocks (8 tokens); its next token
    # (index 8) sees 6 7 8, so b shares only b3: the older hits stay free.
    runner = Runner(make(num_blocks=16, max_size=3))
    prompt = [1, 2, 1, 1, 2, 2, 1, 2, 1]
    runner.add("a", [])
    for token in prompt:
        runner.feed({"a": [token]})
    manager = runner.manager
    a_ids = [manager.block_table("a").slot(2 * j) // 2 for j in (3, 4)]
    num_free = manager.pool.num_free_blocks
    assert runner.add("b", prompt) == 8
    table = manager.block_table("b")
    assert table.block_ids == [a_ids[0]]
    assert (table.num_tokens, table.window_start) == (8, 6)
    assert manager.pool.num_free_blocks == num_free  # b3 was in use by a: nothing revived
    scratch = Runner(make(num_blocks=16, max_size=3, enable_prefix_caching=False))
    scratch.add("b", [])
    scratch.feed({"b": prompt[:8]})
    assert all(np.array_equal(x, y) for x, y in zip(runner.feed({"b": [1]}), scratch.feed({"b": [1]})))


def test_with_sinks_and_a_window_the_sink_blocks_are_shared_too() -> None:
    # sinks 1, W = 2, block_size 2: b's next token (index 8) sees sink 0 and 7 8,
    # so b shares b0 (the sink block) and b3.
    runner = Runner(make(num_blocks=16, max_size=2, num_sink_tokens=1))
    prompt = [1, 2, 1, 1, 2, 2, 1, 2, 1]
    runner.add("a", [])
    runner.feed({"a": prompt[:8]})
    runner.feed({"a": prompt[8:]})
    a_table = runner.manager.block_table("a")
    assert runner.add("b", prompt) == 8
    b_table = runner.manager.block_table("b")
    assert b_table.block_ids == [a_table.block_ids[0], a_table.slot(6) // 2]
    out = runner.feed({"b": prompt[8:]})
    scratch = Runner(make(num_blocks=16, max_size=2, num_sink_tokens=1, enable_prefix_caching=False))
    scratch.add("b", [])
    scratch.feed({"b": prompt[:8]})
    assert all(np.array_equal(x, y) for x, y in zip(out, scratch.feed({"b": prompt[8:]})))


def test_a_forked_sequence_keeps_its_keys_and_keys_its_own_new_blocks() -> None:
    runner = Runner(make())
    runner.add("a", [1, 2, 3])
    runner.feed({"a": [1, 2, 3]})
    manager = runner.manager
    manager.fork("a", "c")
    runner.history["c"] = list(runner.history["a"])
    runner.feed({"c": [4]})  # copy-on-write of |3 .|, then |3 4| is full: keyed
    key = key_chain([1, 2, 3, 4])[1]
    assert prefix_of(manager).block_for(key) == manager.block_table("c").block_ids[1]
    manager.free("a")
    assert runner.add("d", [1, 2, 3, 4, 5]) == 4
    assert manager.block_table("d").block_ids == manager.block_table("c").block_ids


def test_a_swapped_sequence_keeps_its_keys_and_rekeys_restored_blocks() -> None:
    runner = Runner(make(num_blocks=4, host=True))
    manager = runner.manager
    runner.add("a", [1, 2, 3, 4, 5])
    runner.feed({"a": [1, 2, 3, 4, 5]})
    manager.preempt("a", "swap")
    # device: b0, b1 cached free (keys kept), b2 plain free; a's copies on the host
    assert manager.metrics().num_cached_free_blocks == 2
    assert runner.add("b", [1, 2, 3, 9]) == 2  # a's old device block b0 serves b
    manager.free("b")
    runner.add("c", [])
    runner.feed({"c": [7] * 8})  # fills the pool: evicts b0 and b1, keys gone
    manager.free("c")
    assert manager.resume("a") == 5
    # the restored blocks of a hold |1 2|3 4|: their keys were free again, so they are keyed
    for logical_block, key in enumerate(key_chain([1, 2, 3, 4])):
        block_id = manager.block_table("a").slot(2 * logical_block) // 2
        assert prefix_of(manager).block_for(key) == block_id
    manager.check_invariants()
    runner.history["a"] = [1, 2, 3, 4, 5]
    runner.feed({"a": [6]})


def test_a_swapped_sequence_does_not_take_a_key_another_block_holds() -> None:
    runner = Runner(make(num_blocks=8, host=True))
    manager = runner.manager
    runner.add("a", [1, 2, 3])
    runner.feed({"a": [1, 2, 3]})
    manager.fork("a", "twin")
    manager.preempt("a", "swap")  # twin still holds b0 with its key
    assert manager.resume("a") == 3
    key = key_chain([1, 2])[0]
    assert prefix_of(manager).block_for(key) == manager.block_table("twin").block_ids[0]
    assert prefix_of(manager).key_of(manager.block_table("a").block_ids[0]) is None
    manager.check_invariants()


def test_metrics_by_hand() -> None:
    runner = Runner(make(num_blocks=6))
    manager = runner.manager
    runner.add("a", [1, 2, 3, 4, 5])
    runner.feed({"a": [1, 2, 3, 4, 5]})
    # a: b0 |1 2| b1 |3 4| b2 |5 .|   queries 5, hits 0, keyed b0 b1
    assert runner.add("b", [1, 2, 3, 4, 9]) == 4
    runner.feed({"b": [9]})
    # b: b0 b1 (shared) b3 |9 .|       queries 10, hits 4
    m = manager.metrics()
    assert (m.num_prefix_queries, m.num_prefix_hits, m.prefix_hit_rate) == (10, 4, 0.4)
    assert (m.num_cached_blocks, m.num_cached_free_blocks, m.num_used_blocks) == (2, 0, 4)
    manager.free("a")
    manager.free("b")
    # free [4, 5, 2, 3]   cached free [1, 0]  (tail first: b1 before b0)
    m = manager.metrics()
    assert (m.num_cached_blocks, m.num_cached_free_blocks, m.num_free_blocks) == (2, 2, 6)
    runner.add("c", [7] * 11)
    runner.feed({"c": [7] * 11})
    # c takes the four plain blocks, then evicts b1 and b0 (oldest first): 6 blocks, 5 keyed
    m = manager.metrics()
    assert (m.num_prefix_queries, m.num_prefix_hits) == (21, 4)
    assert m.prefix_hit_rate == pytest.approx(4 / 21)
    assert (m.num_prefix_evictions, m.num_cached_blocks, m.num_cached_free_blocks) == (2, 5, 0)
    manager.preempt("c")
    assert manager.resume("c") == 10  # its own 5 cached blocks, counted apart from hits
    m = manager.metrics()
    assert (m.num_prefix_queries, m.num_prefix_hits, m.num_resumed_reuse_tokens) == (21, 4, 10)
    assert (m.num_preemptions, m.num_cached_blocks) == (1, 5)


def test_metrics_without_prefix_caching_are_zero() -> None:
    manager = make(enable_prefix_caching=False)
    assert manager.add_sequence("a", [1, 2, 3]) == 0
    m = manager.metrics()
    assert (m.num_prefix_queries, m.num_prefix_hits, m.prefix_hit_rate, m.num_cached_blocks) == (0, 0, 0.0, 0)


def test_reset_is_refused_while_blocks_are_in_use_and_drops_every_key_when_none_are() -> None:
    runner = Runner(make(host=True))
    manager = runner.manager
    runner.add("a", [1, 2, 3])
    runner.feed({"a": [1, 2, 3]})
    before = (manager.metrics(), manager.pool.allocator.cached_free_block_ids())
    with pytest.raises(SequenceStateError, match="2 blocks are in use"):
        manager.reset_prefix_cache()
    assert (manager.metrics(), manager.pool.allocator.cached_free_block_ids()) == before
    manager.preempt("a", "swap")  # a holds host blocks only: the device pool is idle
    manager.reset_prefix_cache()
    m = manager.metrics()
    assert (m.num_cached_blocks, m.num_cached_free_blocks, m.num_free_blocks) == (0, 0, 8)
    assert manager.add_sequence("b", [1, 2, 3]) == 0
    manager.check_invariants()


def test_reset_without_prefix_caching_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="prefix caching is off"):
        make(enable_prefix_caching=False).reset_prefix_cache()


def test_two_managers_cannot_both_run_prefix_caching_on_one_pool() -> None:
    pool = KVPool(4, block_size=2, head_dim=1)
    first = KVCacheManager(pool, enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="another prefix cache"):
        KVCacheManager(pool, enable_prefix_caching=True)
    assert first.prefix_caching


def test_a_second_prefix_cache_on_one_allocator_is_refused() -> None:
    # Before: the second silently took over on_evict, and the first's next
    # eviction raised KeyError past the point of no return.
    allocator = BlockAllocator(4)
    first = PrefixCache(allocator)
    with pytest.raises(ConfigError, match="another prefix cache"):
        PrefixCache(allocator)
    block_id = allocator.allocate_one()
    assert first.register(block_id, b"k")
    allocator.free_one(block_id)
    allocator.allocate(4)  # evicts the cached block through the first cache, which drops its key
    assert first.block_for(b"k") is None
    first.check_invariants()


def test_a_manager_dropped_without_free_gives_its_blocks_back_and_its_prefix_cache_stops() -> None:
    import gc

    pool = KVPool(6, block_size=2, head_dim=1)
    manager = KVCacheManager(pool, enable_prefix_caching=True)
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    batch = manager.reserve({"a": [1, 2, 3, 4, 5]})
    manager.write(0, batch, np.ones((5, 1, 1)), np.ones((5, 1, 1)))
    assert pool.num_free_blocks == 3
    del manager, batch
    gc.collect()
    assert pool.num_free_blocks == 6 and pool.allocator.num_cached_free_blocks == 0
    again = KVCacheManager(pool, enable_prefix_caching=True)  # before: refused forever
    assert again.add_sequence("b", [1, 2, 3, 4, 5]) == 0
    again.check_invariants()


def test_a_recompute_preempted_sequence_reuses_its_own_cached_blocks() -> None:
    runner = Runner(make())
    manager = runner.manager
    runner.add("a", [1, 2, 3, 4, 5])
    runner.feed({"a": [1, 2, 3, 4, 5]})
    manager.preempt("a")
    assert manager.state("a") is SequenceState.PREEMPTED
    assert manager.resume("a") == 4
    runner.history["a"] = [1, 2, 3, 4]
    out = runner.feed({"a": [5]})
    scratch = Runner(make(enable_prefix_caching=False))
    scratch.add("a", [])
    scratch.feed({"a": [1, 2, 3, 4]})
    assert all(np.array_equal(x, y) for x, y in zip(out, scratch.feed({"a": [5]})))


def test_admission_stops_at_a_middle_block_missing_from_the_chain() -> None:
    # No window: a prompt needs every block from the first, so a gap in the
    # chain ends the hit even though later keys are still cached.
    runner = Runner(make(num_blocks=6))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5, 6, 7]
    runner.add("a", prompt)
    runner.feed({"a": prompt})
    manager.free("a")
    keys = key_chain(prompt)
    cache = prefix_of(manager)
    cache.forget(cache.block_for(keys[1]))  # the middle block loses its key
    assert [cache.block_for(key) is not None for key in keys] == [True, False, True]
    assert runner.add("b", [*prompt, 8]) == 2
    outs = runner.feed({"b": [3, 4, 5, 6, 7, 8]})
    expected = from_scratch([*prompt, 8], [2, 6])
    assert all(np.array_equal(x, y) for x, y in zip(outs, expected))


def test_a_windowed_admission_needs_only_the_blocks_its_window_reaches() -> None:
    # block_size 2, sinks 2 (block 0 pinned), window 2, 6 blocks. After a's
    # prompt the window has let go of b1 (cached free, still keyed):
    #   a: b0 |1 2| (sink)  b1 |3 4| (released)  b2 |5 6|  b3 |7 .|
    #   keys k0 -> b0, k1 -> b1, k2 -> b2     free [4, 5]   cached free [1]
    # fill takes b4, b5, then evicts b1: k1 is gone while k0 and k2 stay.
    # b's prompt |1 2|3 4|5 6|7 8: its next token (index 6) attends to 5..6
    # and the sinks, so k0 and k2 are enough (vLLM's sliding-window rule):
    # 6 tokens hit, where a whole-chain rule would stop at the gap (2).
    runner = Runner(make(num_blocks=6, max_size=2, num_sink_tokens=2))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5, 6, 7]
    runner.add("a", [])
    for token_id in prompt:
        runner.feed({"a": [token_id]})
    assert manager.pool.allocator.cached_free_block_ids() == [1]
    runner.admit("fill", [9] * 6)
    keys = key_chain(prompt)
    assert [prefix_of(manager).block_for(key) for key in keys] == [0, None, 2]
    manager.free("fill")
    assert runner.add("b", [*prompt, 8]) == 6
    assert manager.block_table("b").block_ids == [0, 2]
    outs = runner.feed({"b": [7, 8]})
    expected = from_scratch([*prompt, 8], [6, 2], max_size=2, num_sink_tokens=2)
    assert all(np.array_equal(x, y) for x, y in zip(outs, expected))


# ------------------------------------------------- outputs equal from scratch

tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=14)


@settings(max_examples=4 * (settings.default.max_examples or 25))  # cheap: about 3 ms an example
@given(
    block_size=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 7)),
    num_sink_tokens=st.sampled_from([0, 1, 3]),
    num_layers=st.integers(1, 2),
    num_kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    dtype=st.sampled_from([np.float64, np.float32]),
    warm=tokens_strategy,
    prompt_tail=tokens_strategy,
    cut=st.integers(0, 14),
    decode=st.lists(st.integers(0, 2), max_size=6),
    free_warm=st.booleans(),
)
def test_a_cached_admission_equals_from_scratch_bit_for_bit_at_every_step(
    block_size: int,
    window: int | None,
    num_sink_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    group: int,
    dtype: Any,
    warm: list[int],
    prompt_tail: list[int],
    cut: int,
    decode: list[int],
    free_warm: bool,
) -> None:
    """Issue 5 item 3: the prefill of the rest and every decode step after it are bit-for-bit
    the outputs of a manager without prefix caching that prefilled the same chunks (the
    cached prefix, then the rest), so the only difference is which blocks hold the prefix."""
    prompt = warm[:cut] + prompt_tail
    num_q_heads = num_kv_heads * group
    options = {
        "block_size": block_size, "head_dim": 2, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
        "dtype": dtype, "max_size": window, "num_sink_tokens": num_sink_tokens, "num_q_heads": num_q_heads,
    }

    def kv(history: list[int], positions: range, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.array([kv_of(tuple(history[: p + 1]), layer, num_kv_heads) for p in positions])
        q = np.concatenate([rows[:, 0]] * group, axis=1)  # (n, num_q_heads, head_dim)
        return q.astype(dtype), rows[:, 1].astype(dtype), rows[:, 2].astype(dtype)

    def step(manager: KVCacheManager, seq_id: str, history: list[int], new: list[int]) -> list[np.ndarray]:
        start = len(history)
        history.extend(new)
        batch = manager.reserve({seq_id: new})
        outs = []
        for layer in range(num_layers):
            q, k, v = kv(history, range(start, len(history)), layer)
            manager.write(layer, batch, k, v)
            outs.append(manager.attend(layer, batch, q))
        return outs

    cached = make_manager(64, enable_prefix_caching=True, **options)
    cached.add_sequence("warm", warm)
    step(cached, "warm", [], list(warm))
    if free_warm:
        cached.free("warm")
    num_hit = cached.add_sequence("s", prompt)
    assert num_hit % block_size == 0 and num_hit < len(prompt)
    event(f"cached blocks: {min(num_hit // block_size, 3)}{'+' if num_hit // block_size >= 3 else ''}")
    scratch = make_manager(64, **options)
    scratch.add_sequence("s")
    history_cached, history_scratch = list(prompt[:num_hit]), []
    if num_hit:
        step(scratch, "s", history_scratch, list(prompt[:num_hit]))
    outputs = []
    for chunk in [prompt[num_hit:]] + [[token] for token in decode]:
        outputs.append((step(cached, "s", history_cached, chunk), step(scratch, "s", history_scratch, chunk)))
    cached.check_invariants()
    for got, expected in outputs:
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and np.array_equal(a, b)
