"""KV cache events: what a replica tells a cluster router about the prefixes it holds.

With ``KVCacheManager(..., enable_prefix_caching=True, kv_events=True)`` the
manager records an event whenever its prefix cache changes, and
``drain_kv_events()`` hands them over, oldest first:

* :class:`BlockStored` — full blocks got keys (their hashes, the parent
  block's hash, their token ids), after every layer wrote them;
* :class:`BlockRemoved` — a keyed block lost its key (evicted for reuse, or
  rolled back by ``truncate``);
* :class:`AllBlocksCleared` — ``reset_prefix_cache`` dropped every key.

The classes mirror vLLM's ``vllm.distributed.kv_events`` (v0.33) field for
field, so a router written for vLLM (llm-d's KV-cache indexer, Dynamo's KV
router) reads them unchanged; fields pagedkv has no value for stay ``None``.
A block hash is pagedkv's key (``bytes``, 32 of sha256 or 16 of xxh3_128),
which vLLM's ``ExternalBlockHash`` allows. ``medium`` is ``"GPU"``: the
device pool stands for a GPU's memory, as the host pool stands for the CPU's.

The buffer is bounded: when it is full, a new event is dropped and counted
(``KVEventBuffer.num_dropped``), never blocking the engine. A consumer that
sees drops must rebuild its view from scratch. :class:`PrefixIndex` is such a
consumer: it rebuilds a replica's set of cached hashes from the events alone.

>>> buffer = KVEventBuffer(max_events=2)
>>> buffer.stored([b"k0", b"k1"], None, [1, 2, 3, 4], block_size=2)
>>> buffer.removed(b"k1")
>>> buffer.cleared()  # full: dropped and counted
>>> [type(event).__name__ for event in buffer.drain()], buffer.num_dropped
(['BlockStored', 'BlockRemoved'], 1)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.counts import check_count

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBuffer",
    "PrefixIndex",
]

#: The storage tier of the device pool, in vLLM's words.
MEDIUM_GPU = "GPU"
#: Events a buffer holds before it drops new ones, when ``kv_events=True``.
DEFAULT_MAX_EVENTS = 10_000


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks got keys; ``block_hashes[i]`` chains ``block_hashes[i - 1]`` (the first, ``parent``).

    Attributes:
        block_hashes: the keys, in logical order.
        parent_block_hash: the key of the block before the first, None at a sequence's start.
        token_ids: the token ids the blocks hold, ``block_size`` per block.
        block_size: tokens per block.
        lora_id: the sequence's ``adapter`` extra key when it is an int.
        medium: the storage tier, ``"GPU"``.
        lora_name: the ``adapter`` extra key when it is a str.
        extra_keys: per-block extra keys (not reported by pagedkv: None).
        group_idx: the KV cache group (pagedkv has one: None).
        kv_cache_spec_kind: ``"full_attention"`` or ``"sliding_window"``.
        kv_cache_spec_sliding_window: the window, for a sliding-window manager.
        locality, ownership, session_id, lookahead_token_ids: vLLM fields
            pagedkv has no value for (None).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
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


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keyed blocks lost their keys (one hash per event, as vLLM sends them).

    Attributes:
        block_hashes: the keys dropped.
        medium: the storage tier, ``"GPU"``.
        group_idx, locality, ownership: vLLM fields pagedkv has no value for (None).
    """

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every key was dropped at once (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBuffer:
    """A bounded, first-in first-out buffer of one manager's KV events.

    Invariants:
        * it holds at most ``max_events`` events, oldest first;
        * ``num_recorded`` counts every event offered, ``num_dropped`` those
          refused because the buffer was full.

    Args:
        max_events: the bound (>= 1).
        sliding_window: the manager's window, reported in ``BlockStored``; None if unbounded.

    Raises:
        InputTypeError, ConfigError: ``max_events`` is not an int >= 1.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, *, sliding_window: int | None = None) -> None:
        self.max_events = check_count("max_events", max_events)
        self.sliding_window = sliding_window
        self._events: deque[KVEvent] = deque()
        #: Events offered so far, and of those, events refused because the buffer was full.
        self.num_recorded = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def _record(self, event: KVEvent) -> None:
        self.num_recorded += 1
        if len(self._events) >= self.max_events:
            self.num_dropped += 1
            return
        self._events.append(event)

    def stored(
        self,
        block_hashes: list[bytes],
        parent_block_hash: bytes | None,
        token_ids: list[int],
        *,
        block_size: int,
        adapter: str | int | None = None,
    ) -> None:
        """Record that ``block_hashes`` (consecutive blocks holding ``token_ids``) got keys."""
        windowed = self.sliding_window is not None
        self._record(BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=adapter if isinstance(adapter, int) else None,
            medium=MEDIUM_GPU,
            lora_name=adapter if isinstance(adapter, str) else None,
            kv_cache_spec_kind="sliding_window" if windowed else "full_attention",
            kv_cache_spec_sliding_window=self.sliding_window,
        ))

    def removed(self, block_hash: bytes) -> None:
        """Record that the block keyed ``block_hash`` lost its key."""
        self._record(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        """Record that every key was dropped."""
        self._record(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        """Every buffered event, oldest first; the buffer is empty after."""
        events = list(self._events)
        self._events.clear()
        return events

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if len(self._events) > self.max_events:
            raise AssertionError(f"{len(self._events)} events buffered, bound {self.max_events}")
        if not 0 <= self.num_dropped <= self.num_recorded:
            raise AssertionError(f"{self.num_dropped} dropped of {self.num_recorded} recorded")


class PrefixIndex:
    """A router's view of one replica's prefix cache, rebuilt from its KV events alone.

    It keeps each stored hash with its parent, so it answers what a
    prefix-aware router asks: how many leading blocks of a prompt's key
    chain the replica holds.

    Invariants:
        * every hash it holds was stored by an event and not removed since;
        * ``parent_of[h]`` is the parent hash the storing event gave.

    >>> index = PrefixIndex()
    >>> index.apply([BlockStored([b"a", b"b"], None, [1, 2, 3, 4], 2, None, "GPU", None)])
    >>> index.num_leading_blocks([b"a", b"b", b"c"]), len(index)
    (2, 2)
    """

    def __init__(self) -> None:
        #: Each held hash and its parent's hash (None at a sequence's start).
        self.parent_of: dict[bytes, bytes | None] = {}
        #: Events applied so far.
        self.num_applied = 0

    def __len__(self) -> int:
        return len(self.parent_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.parent_of

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Take a replica's events, oldest first."""
        for event in events:
            self.num_applied += 1
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    self.parent_of[block_hash] = parent
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.parent_of.pop(block_hash, None)
            else:
                self.parent_of.clear()

    def num_leading_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the replica holds."""
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in self.parent_of:
                return count
        return len(block_hashes)

    @property
    def hashes(self) -> set[bytes]:
        """The held hashes (a copy)."""
        return set(self.parent_of)
