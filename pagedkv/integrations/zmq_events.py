"""Publishing KV events on vLLM's wire format, so a router built for vLLM subscribes unchanged.

The ``events`` extra (pyzmq, msgspec). :class:`ZmqEventPublisher` is vLLM's
``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) on the wire: msgpack
``KVEventBatch``es as ``[topic, sequence number, payload]`` on a PUB socket, and a replay
socket that resends the last ``buffer_steps`` batches or asks for a resync when they are gone.
Unlike vLLM's, it sends from the caller's thread. The wire format and the replay protocol:
"On the wire" in docs/prefix_caching.md. An engine step::

    publisher.publish(manager.drain_kv_events())
"""

from __future__ import annotations

import importlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields
from functools import cache
from types import ModuleType
from typing import Any, get_type_hints

from pagedkv.counts import check_count
from pagedkv.errors import InputTypeError
from pagedkv.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["END_SEQ", "ZmqEventPublisher", "encode_batch"]

#: The sequence number that ends a replay.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(
            f"publishing KV events needs {name}: pip install 'pagedkv[events]' (pyzmq and msgspec)"
        ) from error


@cache
def _wire() -> dict[str, Any]:
    """msgspec structs with vLLM's names, fields and options, made from :mod:`pagedkv.prefix.events`' classes.

    Built once, on first use: events as maps tagged with the class name,
    fields at their default left out; the batch as an array.
    """
    msgspec = _load("msgspec")
    base = msgspec.defstruct("KVCacheEvent", [], omit_defaults=True, gc=False, tag=True)
    wire: dict[str, Any] = {
        "batch": msgspec.defstruct(
            "EventBatch",
            [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
            array_like=True, omit_defaults=True, gc=False,
        ),
        "encoder": msgspec.msgpack.Encoder(),
    }
    for event_class in (BlockStored, BlockRemoved, AllBlocksCleared):
        hints = get_type_hints(event_class)
        spec = [
            (item.name, hints[item.name]) if item.default is MISSING else (item.name, hints[item.name], None)
            for item in fields(event_class)
        ]
        wire[event_class.__name__] = msgspec.defstruct(
            event_class.__name__, spec, bases=(base,), omit_defaults=True, gc=False, tag=True
        )
    return wire


def _to_wire(event: KVEvent, wire: dict[str, Any]) -> Any:
    if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
        raise InputTypeError(f"not a KV event: {type(event).__name__}")
    return wire[type(event).__name__](**{item.name: getattr(event, item.name) for item in fields(event)})


def encode_batch(events: Sequence[KVEvent], ts: float, data_parallel_rank: int | None = None) -> bytes:
    """One ``KVEventBatch`` as vLLM's msgpack payload.

    Raises:
        InputTypeError: an entry is not a KV event.
        ImportError: msgspec is missing (the ``events`` extra).
    """
    wire = _wire()
    batch = wire["batch"](ts=ts, events=[_to_wire(event, wire) for event in events],
                          data_parallel_rank=data_parallel_rank)
    payload: bytes = wire["encoder"].encode(batch)
    return payload


class ZmqEventPublisher:
    """Publish KV event batches on a PUB socket, and replay recent ones to subscribers that ask.

    Invariants:
        * sequence numbers start at 0 and grow by one per published batch;
        * at most ``buffer_steps`` batches are kept for replay, the newest;
        * a replay request from before the oldest kept batch calls ``resync``.

    Args:
        endpoint: where the PUB socket binds (``"tcp://*:5557"``, vLLM's default).
        replay_endpoint: where the ROUTER socket for replay binds, or None (no replay).
        topic: the first frame of every message.
        buffer_steps: batches kept for replay.
        data_parallel_rank: written into every batch (vLLM's field), or None.
        resync: called when a replay cannot fill a subscriber's gap
            (``manager.kv_events.request_resync``), or None.

    Raises:
        InputTypeError, ConfigError: a bad argument.
        ImportError: pyzmq or msgspec is missing (the ``events`` extra).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        resync: Callable[[], None] | None = None,
    ) -> None:
        for name, value in (("endpoint", endpoint), ("topic", topic)):
            if not isinstance(value, str):
                raise InputTypeError(f"{name} must be a str, got {value!r}")
        if resync is not None and not callable(resync):
            raise InputTypeError(
                f"resync must be a callable (kv_events.request_resync) or None, got {resync!r}"
            )
        self.buffer_steps = check_count("buffer_steps", buffer_steps)
        zmq = _load("zmq")
        _wire()
        self._zmq = zmq
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self._data_parallel_rank = data_parallel_rank
        self._resync = resync
        #: Replay requests that asked for batches no longer kept (each called ``resync``).
        self.num_replay_gaps = 0
        #: The sequence number the next batch gets.
        self.next_seq = 0

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound address (with the port ZMQ chose for ``tcp://...:*``)."""
        address: str = self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)
        return address

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's bound address, or None."""
        if self._replay is None:
            return None
        address: str = self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT)
        return address

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        """Send ``events`` as one batch (none: nothing is sent); return its sequence number.

        Waiting replay requests are served first.
        """
        self.serve_replay()
        if not events:
            return None
        payload = encode_batch(events, time.time() if ts is None else ts, self._data_parallel_rank)
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        return seq

    def serve_replay(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting (or arriving within ``timeout_ms``); return how many."""
        replay = self._replay
        if replay is None:
            return 0
        served = 0
        while replay.poll(timeout_ms if not served else 0):
            frames = replay.recv_multipart()
            served += 1
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: ignored, as vLLM does
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            oldest_seq = self._buffer[0][0] if self._buffer else self.next_seq
            if start_seq < oldest_seq:  # batches lost for good: only a resync repairs the subscriber
                self.num_replay_gaps += 1
                if self._resync is not None:
                    self._resync()
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
        return served

    def close(self) -> None:
        """Close the sockets (the publisher cannot be used after)."""
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
