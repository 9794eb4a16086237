"""KV events: the buffer, what each prefix-cache change reports, and the configuration's errors.

The stateful prefix machine (tests/test_stateful_prefix.py) replays every
event into a ``PrefixIndex`` after every step and compares it with the
manager's keys; the cases here pin each kind of event to its cause.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from support.prefix import key_chain, make

from pagedkv import KVCacheManager, KVPool
from pagedkv.errors import ConfigError, InputTypeError, SequenceStateError
from pagedkv.prefix.events import (
    DEFAULT_MAX_EVENTS,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBuffer,
    PrefixIndex,
)


def _write(manager: KVCacheManager, seq_id: str, token_ids: list[int]) -> None:
    batch = manager.reserve({seq_id: token_ids})
    kv = np.ones((len(token_ids), 1, 2))
    manager.write(0, batch, kv, kv)


def test_full_blocks_are_stored_once_written_with_their_tokens_and_parent() -> None:
    manager = make(8, kv_events=True)  # blocks of 2
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    assert manager.drain_kv_events() == []  # a lookup reports nothing
    _write(manager, "a", [1, 2, 3, 4, 5])
    keys = key_chain([1, 2, 3, 4], 2)
    assert manager.drain_kv_events() == [
        BlockStored(keys, None, [1, 2, 3, 4], 2, None, MEDIUM_GPU, None, kv_cache_spec_kind="full_attention")
    ]
    _write(manager, "a", [6])
    (event,) = manager.drain_kv_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == keys[1] and event.token_ids == [5, 6]
    assert event.block_hashes == key_chain([1, 2, 3, 4, 5, 6], 2)[2:]


def test_a_shared_prefix_is_not_stored_twice() -> None:
    manager = make(8, kv_events=True)
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id, [1, 2, 3])
    _write(manager, "a", [1, 2, 3])
    _write(manager, "b", [1, 2, 3])  # same key: the first block keeps it
    events = manager.drain_kv_events()
    assert [len(e.block_hashes) for e in events if isinstance(e, BlockStored)] == [1]


def test_eviction_truncation_and_reset_remove_keys() -> None:
    manager = make(3, kv_events=True)
    manager.add_sequence("a", [1, 2, 3, 4])
    _write(manager, "a", [1, 2, 3, 4])
    manager.truncate("a", 3)  # [3 4] is partial now: its key goes
    removed = manager.drain_kv_events()[1:]
    assert removed == [BlockRemoved([key_chain([1, 2, 3, 4], 2)[1]], MEDIUM_GPU)]
    manager.free("a")  # [1 2] waits in the cached free queue, still keyed
    assert manager.drain_kv_events() == []
    manager.add_sequence("b")
    manager.reserve({"b": [7, 8, 9, 10, 11, 12]})  # needs all three blocks: the cached one is evicted
    assert manager.drain_kv_events() == [BlockRemoved([key_chain([1, 2], 2)[0]], MEDIUM_GPU)]
    manager.free("b")
    manager.reset_prefix_cache()
    assert manager.drain_kv_events() == [AllBlocksCleared()]


def test_the_adapter_and_the_window_are_reported() -> None:
    for adapter, field in [(7, "lora_id"), ("sql", "lora_name")]:
        manager = make(8, kv_events=True, max_size=4)
        manager.add_sequence("a", extra_keys={"adapter": adapter})
        _write(manager, "a", [1, 2])
        (event,) = manager.drain_kv_events()
        assert isinstance(event, BlockStored) and getattr(event, field) == adapter
        assert event.kv_cache_spec_kind == "sliding_window" and event.kv_cache_spec_sliding_window == 4


def test_a_full_buffer_overflows_into_a_resync_of_every_keyed_block() -> None:
    manager = make(16, kv_events=2)
    manager.add_sequence("a")
    for token in range(6):  # three full blocks, stored one by one
        _write(manager, "a", [token])
    # pending: Stored(k0), Stored(k1) | Stored(k2) finds it full -> all three dropped, resync pending
    buffer = manager.kv_events
    assert buffer is not None and (len(buffer), buffer.num_recorded, buffer.num_dropped) == (0, 3, 3)
    assert buffer.resync_pending and buffer.num_overflows == 1
    _write(manager, "a", [6, 7])  # Stored(k3), offered while the resync is pending: the resync reports it
    assert buffer.num_dropped == 4
    buffer.check_invariants()
    # drained: Cleared, then the keyed chain k0 <- k1 <- k2 <- k3 as one run
    assert manager.drain_kv_events() == [
        AllBlocksCleared(),
        BlockStored(key_chain(list(range(8)), 2), None, list(range(8)), 2, None, MEDIUM_GPU, None,
                    kv_cache_spec_kind="full_attention"),
    ]
    assert not buffer.resync_pending and buffer.num_resyncs == 1
    _write(manager, "a", [8, 9])  # after the resync, events flow as before
    (event,) = manager.drain_kv_events()
    assert isinstance(event, BlockStored) and event.token_ids == [8, 9]


def test_a_resync_replays_parents_first_with_the_parent_each_block_was_stored_with() -> None:
    buffer = KVEventBuffer(1)
    buffer.stored([b"a", b"b", b"c"], None, [1, 2, 3, 4, 5, 6], block_size=2, adapter="sql")
    buffer.removed(b"a")  # overflows: c's parent b stays keyed, b's parent a is gone
    buffer.stored([b"a"], None, [1, 2], block_size=2, adapter="sql")  # a keyed again, after its children
    buffer.stored([b"x"], b"c", [7, 8], block_size=2, adapter=3)  # another adapter: a run of its own
    events = buffer.drain()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.lora_name, e.lora_id)
            for e in events if isinstance(e, BlockStored)] == [
        ([b"a", b"b", b"c"], None, [1, 2, 3, 4, 5, 6], "sql", None),
        ([b"x"], b"c", [7, 8], None, 3),
    ]
    index = PrefixIndex()
    index.apply([BlockStored([b"stale"], None, [0, 0], 2, None, MEDIUM_GPU, None), *events])
    assert index.parent_of == {b"a": None, b"b": b"a", b"c": b"b", b"x": b"c"}


def test_request_resync_makes_the_next_drain_a_full_snapshot() -> None:
    buffer = KVEventBuffer(8)
    buffer.stored([b"a"], None, [1, 2], block_size=2)
    buffer.removed(b"a")
    buffer.stored([b"b"], None, [3, 4], block_size=2)
    buffer.request_resync()  # a subscriber lost batches: drop the three pending, replay instead
    assert (len(buffer), buffer.num_dropped, buffer.num_overflows) == (0, 3, 0)
    assert buffer.drain() == buffer.snapshot() == [
        AllBlocksCleared(), BlockStored([b"b"], None, [3, 4], 2, None, MEDIUM_GPU, None,
                                        kv_cache_spec_kind="full_attention"),
    ]
    assert buffer.num_resyncs == 1 and buffer.drain() == []


def test_the_index_answers_leading_blocks_and_forgets_removed_ones() -> None:
    index = PrefixIndex()
    index.apply([BlockStored([b"a", b"b", b"c"], None, [0] * 6, 2, None, MEDIUM_GPU, None),
                 BlockRemoved([b"b"], MEDIUM_GPU)])
    assert index.num_leading_blocks([b"a", b"b", b"c"]) == 1 and index.parent_of[b"c"] == b"b"
    index.apply([AllBlocksCleared()])
    assert len(index) == 0 and index.num_applied == 3


def test_configuration_errors() -> None:
    pool = KVPool(4, head_dim=1)
    with pytest.raises(ConfigError, match="need enable_prefix_caching=True"):
        KVCacheManager(pool, kv_events=True)
    with pytest.raises(ConfigError, match="kv_events"):
        KVCacheManager(pool, enable_prefix_caching=True, kv_events=0)
    with pytest.raises(InputTypeError, match="kv_events"):
        KVCacheManager(pool, enable_prefix_caching=True, kv_events="yes")  # type: ignore[arg-type]
    manager = KVCacheManager(pool, enable_prefix_caching=True)
    assert manager.kv_events is None
    with pytest.raises(ConfigError, match="KV events are off"):
        manager.drain_kv_events()
    events = KVCacheManager(KVPool(4, head_dim=1), enable_prefix_caching=True, kv_events=True).kv_events
    assert events is not None and events.max_events == DEFAULT_MAX_EVENTS
    with pytest.raises(ConfigError, match="max_events"):
        KVEventBuffer(0)


# ---- overflow: the drained stream resynchronises a consumer -------------------------------------

_OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["add", "append", "truncate", "free", "reset", "drain"]), st.integers(0, 2**16)
    ),
    max_size=40,
)


def _cached_keys(manager: KVCacheManager) -> set[bytes]:
    """The keys the manager's prefix cache holds, read through its public ``key_of``."""
    cache = manager.prefix_cache
    assert cache is not None
    keys = (cache.key_of(block_id) for block_id in range(manager.pool.num_blocks))
    return {key for key in keys if key is not None}


def _step(manager: KVCacheManager, operation: str, draw: int, serial: int) -> None:
    """One step of a workload drawn from ``draw``: prompts over three token ids, so prefixes repeat."""
    live = manager.seq_ids
    if operation == "add" or (not live and operation in ("append", "truncate", "free")):
        seq_id = f"s{serial}"
        prompt = [(draw >> (2 * i)) % 3 for i in range(2 + draw % 7)]
        num_hit = manager.add_sequence(seq_id, prompt)
        if manager.can_reserve({seq_id: prompt[num_hit:]}):
            _write(manager, seq_id, prompt[num_hit:])
        else:
            manager.free(seq_id)
        return
    if operation == "reset":
        for seq_id in live:
            manager.free(seq_id)
        manager.reset_prefix_cache()
        return
    seq_id = live[draw % len(live)]
    if operation == "append" and manager.can_reserve({seq_id: [draw % 3]}):
        _write(manager, seq_id, [draw % 3])
    elif operation == "truncate":
        with contextlib.suppress(SequenceStateError):  # refused: tokens already left the window
            manager.truncate(seq_id, draw % (manager.num_tokens(seq_id) + 1))
    elif operation == "free":
        manager.free(seq_id)


@given(
    operations=_OPERATIONS,
    max_events=st.integers(1, 4),
    max_size=st.sampled_from([None, 4]),
)
def test_an_index_rebuilt_from_the_drained_stream_alone_is_right_after_every_drain_even_past_overflow(
    operations: list[tuple[str, int]], max_events: int, max_size: int | None
) -> None:
    manager = make(6, kv_events=max_events, max_size=max_size)
    index = PrefixIndex()
    buffer = manager.kv_events
    assert buffer is not None
    for serial, (operation, draw) in enumerate([*operations, ("drain", 0)]):
        note(f"{operation} {draw}")
        if operation != "drain":
            _step(manager, operation, draw, serial)
            buffer.check_invariants()
            continue
        resync = buffer.resync_pending
        events = manager.drain_kv_events()
        if resync:
            _assert_parents_come_first(events)
        index.apply(events)
        assert index.hashes == _cached_keys(manager), "the index rebuilt from events is not the cache's keys"
        manager.check_invariants()


def _assert_parents_come_first(events: list[KVEvent]) -> None:
    """No ``BlockStored`` of a resync names a parent that a later event of it stores."""
    stored_later: set[bytes] = set()
    for event in reversed(events):
        if isinstance(event, BlockStored):
            assert event.parent_block_hash not in stored_later, "a child is replayed before its parent"
            stored_later.update(event.block_hashes)
