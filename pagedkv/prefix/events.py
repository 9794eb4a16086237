"""KV cache events: what a replica tells a cluster router about the prefixes it holds.

:class:`BlockStored`, :class:`BlockRemoved` and :class:`AllBlocksCleared` mirror vLLM's
``vllm.distributed.kv_events`` (v0.33) field for field, so a router written for vLLM reads
them unchanged. :class:`KVEventBuffer` is bounded and never blocks the engine: when it
overflows, the next drain is a resync (``AllBlocksCleared``, then every keyed block), so a
consumer that applies every drained event in order holds exactly the replica's keys;
:class:`PrefixIndex` is such a consumer. See "KV events" in docs/prefix_caching.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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
        group_idx: the KV-cache group (a hybrid manager's), else None.
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
        group_idx: the KV-cache group (a hybrid manager's), else None.
        locality, ownership: vLLM fields pagedkv has no value for (None).
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
    """A bounded, first-in first-out buffer of one manager's KV events, which resyncs on overflow.

    Besides the pending events it keeps which blocks are keyed now, each
    with the ``BlockStored`` that reported it, whether that event was
    delivered or not: that is what a resync replays.

    NOTE: the resync is built at drain time from the keyed blocks, not from
    the events lost, so its size is bounded by the pool's blocks (not by how
    long the consumer was away) and it is exact even if the consumer never
    saw a single earlier event. vLLM's consumers treat ``AllBlocksCleared``
    as "forget this replica", so the replay starts with one.

    Invariants:
        * it holds at most ``max_events`` events, oldest first, and none
          while a resync is pending;
        * ``num_recorded`` counts every event offered, ``num_dropped`` those
          that will never be drained as themselves (lost to an overflow or a
          ``request_resync``, or offered while a resync was pending);
        * every keyed hash maps to a ``BlockStored`` that holds it.

    Args:
        max_events: the bound (>= 1).
        sliding_window: the manager's window, reported in ``BlockStored``; None if unbounded.

    Raises:
        InputTypeError, ConfigError: ``max_events`` is not an int >= 1.

    Example:
        >>> buffer = KVEventBuffer(max_events=2)
        >>> buffer.stored([b"k0", b"k1"], None, [1, 2, 3, 4], block_size=2)
        >>> buffer.removed(b"k1")
        >>> buffer.stored([b"k2"], b"k0", [5, 6], block_size=2)  # full: overflows
        >>> [(type(e).__name__, getattr(e, "block_hashes", None)) for e in buffer.drain()]
        [('AllBlocksCleared', None), ('BlockStored', [b'k0', b'k2'])]
        >>> buffer.num_dropped, buffer.num_overflows
        (3, 1)
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, *, sliding_window: int | None = None) -> None:
        self.max_events = check_count("max_events", max_events)
        self.sliding_window = sliding_window
        #: The KV-cache group whose blocks this buffer reports (``BlockStored`` / ``BlockRemoved``
        #: ``group_idx``, as vLLM's hybrid manager sends it); None for a manager of one group.
        self.group_idx: int | None = None
        self._events: deque[KVEvent] = deque()
        # Each keyed hash -> (the BlockStored that reported it, its index in that event's block_hashes).
        self._keyed: dict[bytes, tuple[BlockStored, int]] = {}
        self._resync_pending = False
        #: Events offered so far, and of those, events that will never be drained as themselves.
        self.num_recorded = 0
        self.num_dropped = 0
        #: Times an event found the buffer full, and drains that were a resync.
        self.num_overflows = 0
        self.num_resyncs = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def resync_pending(self) -> bool:
        """Whether the next drain is a resync (``AllBlocksCleared``, then every keyed block)."""
        return self._resync_pending

    @property
    def keyed_hashes(self) -> set[bytes]:
        """The hashes keyed now, by the events offered so far (a copy)."""
        return set(self._keyed)

    def _record(self, event: KVEvent) -> None:
        self.num_recorded += 1
        if self._resync_pending:
            self.num_dropped += 1  # the resync will report its effect
            return
        if len(self._events) >= self.max_events:
            self.num_overflows += 1
            self.request_resync()
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
        event = BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=adapter if isinstance(adapter, int) else None,
            medium=MEDIUM_GPU,
            lora_name=adapter if isinstance(adapter, str) else None,
            kv_cache_spec_kind="sliding_window" if windowed else "full_attention",
            kv_cache_spec_sliding_window=self.sliding_window,
            group_idx=self.group_idx,
        )
        for index, block_hash in enumerate(block_hashes):
            self._keyed[block_hash] = (event, index)
        self._record(event)

    def removed(self, block_hash: bytes) -> None:
        """Record that the block keyed ``block_hash`` lost its key."""
        self._keyed.pop(block_hash, None)
        self._record(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=self.group_idx))

    def cleared(self) -> None:
        """Record that every key was dropped."""
        self._keyed.clear()
        self._record(AllBlocksCleared())

    def request_resync(self) -> None:
        """Drop the pending events; the next drain is a resync.

        For a consumer that lost events downstream of the buffer (a new
        subscriber, or one whose missed batches are past the publisher's
        replay): what it drains next rebuilds its index from empty.
        """
        self.num_dropped += len(self._events)
        self._events.clear()
        self._resync_pending = True

    def drain(self) -> list[KVEvent]:
        """Every buffered event, oldest first, or the resync if one is pending; the buffer is empty after.

        A consumer that applies every drain in order holds the keyed hashes
        (``keyed_hashes``) after each, overflow or not.
        """
        if self._resync_pending:
            self._resync_pending = False
            self.num_resyncs += 1
            return self.snapshot()
        events = list(self._events)
        self._events.clear()
        return events

    def snapshot(self) -> list[KVEvent]:
        """``AllBlocksCleared``, then ``BlockStored`` events of every keyed block, parents first.

        Applied to any index, it leaves exactly the keyed hashes, each with the
        parent its storing event gave. Runs of blocks that chain (a block's
        parent is the one before it) share one ``BlockStored``.

        >>> buffer = KVEventBuffer()
        >>> buffer.stored([b"b"], b"a", [3, 4], block_size=2)  # a child keyed before its parent
        >>> buffer.stored([b"a"], None, [1, 2], block_size=2)
        >>> [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in buffer.snapshot()[1:]]
        [([b'a', b'b'], None, [1, 2, 3, 4])]
        """
        events: list[KVEvent] = [AllBlocksCleared()]
        run: list[bytes] = []
        for block_hash in self._parents_first():
            extends_run = run and self._parent(block_hash) == run[-1] and _same_blocks(
                self._keyed[block_hash][0], self._keyed[run[-1]][0]
            )
            if not extends_run:
                self._flush(run, events)
                run = []
            run.append(block_hash)
        self._flush(run, events)
        return events

    def _parent(self, block_hash: bytes) -> bytes | None:
        event, index = self._keyed[block_hash]
        return event.block_hashes[index - 1] if index else event.parent_block_hash

    def _parents_first(self) -> list[bytes]:
        """The keyed hashes, each after its parent when the parent is keyed too.

        Keying order alone is not enough: a parent evicted and keyed again
        comes after its children.
        """
        keyed, placed = self._keyed, set()
        order: list[bytes] = []
        for block_hash in keyed:
            chain: list[bytes] = []
            ancestor: bytes | None = block_hash
            while ancestor is not None and ancestor in keyed and ancestor not in placed:
                chain.append(ancestor)
                placed.add(ancestor)
                ancestor = self._parent(ancestor)
            order.extend(reversed(chain))
        return order

    def _flush(self, run: list[bytes], events: list[KVEvent]) -> None:
        """Append one ``BlockStored`` of ``run``, consecutive chained keyed blocks."""
        if not run:
            return
        token_ids: list[int] = []
        for block_hash in run:
            event, index = self._keyed[block_hash]
            bs = event.block_size
            token_ids += event.token_ids[index * bs : (index + 1) * bs]
        first, _ = self._keyed[run[0]]
        parent = self._parent(run[0])
        events.append(replace(first, block_hashes=run, parent_block_hash=parent, token_ids=token_ids))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if len(self._events) > self.max_events:
            raise AssertionError(f"{len(self._events)} events buffered, bound {self.max_events}")
        if self._resync_pending and self._events:
            raise AssertionError(f"{len(self._events)} events buffered while a resync is pending")
        if not 0 <= self.num_dropped <= self.num_recorded:
            raise AssertionError(f"{self.num_dropped} dropped of {self.num_recorded} recorded")
        for block_hash, (event, index) in self._keyed.items():
            if event.block_hashes[index] != block_hash:
                raise AssertionError(f"keyed hash {block_hash!r} is not in the event that stored it")


def _same_blocks(event: BlockStored, other: BlockStored) -> bool:
    """Whether blocks of ``event`` and ``other`` may share one ``BlockStored`` (all but the blocks agree)."""
    fields_of = (event.block_size, event.lora_id, event.lora_name)
    return fields_of == (other.block_size, other.lora_id, other.lora_name)


class PrefixIndex:
    """A router's view of one replica's prefix cache, rebuilt from its KV events alone.

    It keeps each stored hash with its parent, so it answers what a
    prefix-aware router asks: how many leading blocks of a prompt's key
    chain the replica holds.

    Applied to every drain of a replica, in order, it holds that replica's
    keys after each, through buffer overflows too (a drain after one starts
    with ``AllBlocksCleared`` and stores every keyed block again).

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
