"""The ZMQ publisher speaks vLLM's wire format: a subscriber with vLLM's schema rebuilds the index.

Skipped without the ``events`` extra (pyzmq, msgspec). The decoding side
declares vLLM's structs itself (``vllm/distributed/kv_events.py``, v0.33:
names, fields and options), so it shares nothing with the publisher's
encoder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.prefix import make, prefix_of

from pagedkv.prefix.events import PrefixIndex

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from pagedkv.integrations.zmq_events import END_SEQ, ZmqEventPublisher, encode_batch  # noqa: E402


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc,call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[misc,call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _as_pagedkv(batch: KVEventBatch) -> list[Any]:
    """vLLM's decoded events, turned into pagedkv's (only the fields an index needs)."""
    from pagedkv.prefix import events

    out: list[Any] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            out.append(events.BlockStored(list(event.block_hashes), event.parent_block_hash, event.token_ids,
                                          event.block_size, event.lora_id, event.medium, event.lora_name))
        elif isinstance(event, BlockRemoved):
            out.append(events.BlockRemoved(list(event.block_hashes), event.medium))
        else:
            out.append(events.AllBlocksCleared())
    return out


def _workload(manager: Any, publisher: ZmqEventPublisher) -> None:
    rng = np.random.default_rng(3)
    live: list[str] = []
    for step in range(40):
        action = rng.integers(0, 3)
        if action < 2 or not live:
            seq_id = f"s{step}"
            prompt = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(2, 9)))]
            num_hit = manager.add_sequence(seq_id, prompt)
            if not manager.can_reserve({seq_id: prompt[num_hit:]}):
                manager.free(seq_id)
            else:
                batch = manager.reserve({seq_id: prompt[num_hit:]})
                kv = np.ones((batch.num_tokens, 1, 2))
                manager.write(0, batch, kv, kv)
                live.append(seq_id)
        else:
            manager.free(live.pop(int(rng.integers(0, len(live)))))
        publisher.publish(manager.drain_kv_events())


def test_a_subscriber_rebuilds_the_replica_s_index_through_live_and_replayed_batches() -> None:
    manager = make(12, kv_events=True)
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv") as publisher:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        _workload(manager, publisher)  # early batches may miss the subscriber (ZMQ's slow joiner)
        live = {}
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live[int.from_bytes(seq, "big")] = payload
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert publisher.serve_replay(timeout_ms=5000) == 1
        replayed = {}
        while True:
            assert dealer.poll(5000)
            empty, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert (empty, topic, payload) == (b"", b"", b"")
                break
            replayed[int.from_bytes(seq, "big")] = payload
        sub.close()
        dealer.close()
        context.term()
    assert sorted(replayed) == list(range(publisher.next_seq))  # every batch, in order
    assert all(replayed[seq] == payload for seq, payload in live.items())  # live copies agree
    index = PrefixIndex()
    for seq in sorted(replayed):
        index.apply(_as_pagedkv(DECODER.decode(replayed[seq])))
    assert index.hashes == set(prefix_of(manager)._block_of)


def test_the_payload_is_vllm_s_msgpack() -> None:
    from pagedkv.prefix.events import AllBlocksCleared as Cleared
    from pagedkv.prefix.events import BlockRemoved as Removed

    payload = encode_batch([Removed([b"k"], "GPU"), Cleared()], ts=1.5, data_parallel_rank=2)
    raw = msgspec.msgpack.decode(payload)
    assert raw == [1.5, [{"type": "BlockRemoved", "block_hashes": [b"k"], "medium": "GPU"},
                         {"type": "AllBlocksCleared"}], 2]
    batch = DECODER.decode(payload)
    assert isinstance(batch.events[0], BlockRemoved) and batch.data_parallel_rank == 2


def test_bad_arguments_are_refused() -> None:
    from pagedkv.errors import ConfigError, InputTypeError

    with pytest.raises(ConfigError, match="buffer_steps"):
        ZmqEventPublisher("tcp://127.0.0.1:*", buffer_steps=0)
    with pytest.raises(InputTypeError, match="topic"):
        ZmqEventPublisher("tcp://127.0.0.1:*", topic=b"kv")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="resync must be a callable"):
        ZmqEventPublisher("tcp://127.0.0.1:*", resync="request_resync")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="not a KV event"):
        encode_batch(["BlockStored"], ts=0.0)  # type: ignore[list-item]


def _cached_keys(manager: Any) -> set[bytes]:
    """The keys the manager's prefix cache holds, read through its public ``key_of``."""
    keys = (manager.prefix_cache.key_of(block_id) for block_id in range(manager.pool.num_blocks))
    return {key for key in keys if key is not None}


def _subscribe(context: Any, publisher: ZmqEventPublisher) -> Any:
    """A SUB socket that has joined: publish ``AllBlocksCleared`` batches until one arrives (slow joiner)."""
    from pagedkv.prefix.events import AllBlocksCleared as Cleared

    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    for _ in range(100):
        publisher.publish([Cleared()])
        if sub.poll(50):
            while sub.poll(50):  # the joining batches (all AllBlocksCleared): nothing to index
                sub.recv_multipart()
            return sub
    raise AssertionError("the subscriber never joined")


def test_a_subscriber_s_index_is_right_after_every_batch_through_buffer_overflows() -> None:
    manager = make(8, kv_events=2)  # a tiny buffer: most drains follow an overflow
    buffer = manager.kv_events
    rng = np.random.default_rng(5)
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv") as publisher:
        context = zmq.Context()
        sub = _subscribe(context, publisher)
        index, expected_seq = PrefixIndex(), publisher.next_seq
        for step in range(60):
            seq_id = f"s{step}"
            prompt = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(2, 9)))]
            num_hit = manager.add_sequence(seq_id, prompt)
            if manager.can_reserve({seq_id: prompt[num_hit:]}):
                batch = manager.reserve({seq_id: prompt[num_hit:]})
                kv = np.ones((batch.num_tokens, 1, 2))
                manager.write(0, batch, kv, kv)
            for live in manager.seq_ids[: -2 if rng.integers(0, 2) else None]:
                manager.free(live)
            if rng.integers(0, 3) and publisher.publish(manager.drain_kv_events()) is not None:
                assert sub.poll(5000)
                _, seq, payload = sub.recv_multipart()
                assert int.from_bytes(seq, "big") == expected_seq  # no gap on the wire
                expected_seq += 1
                index.apply(_as_pagedkv(DECODER.decode(payload)))
                assert index.hashes == _cached_keys(manager)
        sub.close()
        context.term()
    assert buffer is not None and buffer.num_overflows > 0 and buffer.num_resyncs > 0


def test_a_replay_request_for_batches_no_longer_kept_resyncs_the_next_batch() -> None:
    from pagedkv.prefix.events import AllBlocksCleared as Cleared

    manager = make(8, kv_events=True)
    buffer = manager.kv_events
    assert buffer is not None
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv",
                           buffer_steps=2, resync=buffer.request_resync) as publisher:
        for step in range(4):  # batches 0..3; only 2 and 3 are kept
            manager.add_sequence(f"s{step}", [step, step])
            batch = manager.reserve({f"s{step}": [step, step]})
            kv = np.ones((2, 1, 2))
            manager.write(0, batch, kv, kv)
            publisher.publish(manager.drain_kv_events())
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # a subscriber that missed everything
        assert publisher.serve_replay(timeout_ms=5000) == 1
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, _, seq, _ = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append(int.from_bytes(seq, "big"))
        dealer.close()
        context.term()
        assert replayed == [2, 3] and publisher.num_replay_gaps == 1 and buffer.resync_pending
        events = manager.drain_kv_events()
    assert isinstance(events[0], Cleared)
    index = PrefixIndex()
    index.apply(events)  # the resync alone rebuilds the index from empty
    assert index.hashes == _cached_keys(manager) and len(index) == 4
