"""KV events: the buffer, what each prefix-cache change reports, and the configuration's errors.

The stateful prefix machine (tests/test_stateful_prefix.py) replays every
event into a ``PrefixIndex`` after every step and compares it with the
manager's keys; the cases here pin each kind of event to its cause.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.prefix import key_chain, make

from pagedkv import KVCacheManager, KVPool
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.events import (
    DEFAULT_MAX_EVENTS,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
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


def test_a_full_buffer_drops_new_events_and_counts_them() -> None:
    manager = make(16, kv_events=2)
    manager.add_sequence("a")
    for token in range(6):  # three full blocks, stored one by one
        _write(manager, "a", [token])
    buffer = manager.kv_events
    assert buffer is not None and (len(buffer), buffer.num_recorded, buffer.num_dropped) == (2, 3, 1)
    assert len(manager.drain_kv_events()) == 2 and len(buffer) == 0
    buffer.check_invariants()


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
