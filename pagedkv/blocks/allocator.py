"""The block allocator: block ids, their ref counts, the free queues and the cached marks.

The allocator never sees tokens or arrays (it imports no numpy); it only decides
which block ids are in use, how many block tables hold each one, and which free
blocks prefix caching can still revive. Storage (:mod:`pagedkv.memory.pool`) pairs
it with the arrays the ids index. vLLM: ``BlockPool`` and ``FreeKVCacheBlockQueue``
(``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``); nano-vllm: ``BlockManager``.
Design notes (the queue, FIFO order, cached free blocks): docs/design.md, "Block ids".
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedkv.counts import check_count
from pagedkv.errors import (
    BlockStateError,
    ConfigError,
    DoubleFreeError,
    PoolExhaustedError,
    PoolTooLargeError,
    UnknownBlockError,
)

__all__ = ["BOOKKEEPING_BYTES_PER_BLOCK", "AllocatorState", "BlockAllocator"]

#: Bytes of Python bookkeeping one block costs a fresh allocator: a ref count
#: slot (8 bytes, pointing at the cached int 0) and a queue slot (8 bytes plus a
#: 28-byte int object).
BOOKKEEPING_BYTES_PER_BLOCK = 44


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """An allocator's whole state as plain ints (what a snapshot saves).

    Attributes:
        ref_counts: the ref count of every block id.
        free: the plain free queue, next to hand out first.
        cached_free: the cached free queue, next to evict first.
        cached: every block marked cached (used or free), ascending.
    """

    ref_counts: list[int]
    free: list[int]
    cached_free: list[int]
    cached: list[int]


class BlockAllocator:
    """Hands out fixed-size blocks by id from one pool and counts their references.

    Free ids wait in a FIFO queue: allocating takes from the head and freeing
    appends to the tail, so both cost O(1) per block and never scan the pool.
    The queue is a list with a head index (not a deque): taking ``n`` ids is
    one slice, and the consumed prefix is dropped once it passes half the
    list, amortized O(1) per id (faster than a deque: docs/design.md, "Block
    ids", and ``benchmarks/bench_allocator.py``).

    NOTE: a FIFO (not a LIFO stack) is deliberate. A cache that owns a pool on
    its own gets consecutive ids back in order, which lets attention read its
    blocks as one array view instead of gathering them (see ``pagedkv.cache``).

    Prefix caching (:mod:`pagedkv.prefix.cache`) marks blocks whose contents
    are worth keeping as *cached*. A cached block whose ref count drops to zero
    waits in a second queue, in least-recently-freed order, where a prefix hit
    can take it back (``revive``). Allocation hands out plain free blocks
    first and evicts cached ones, oldest first, only when none are left,
    telling the prefix cache through ``on_evict`` so the key is dropped the
    moment the block is reused.

    Invariants:
        * every id in ``range(num_blocks)`` is in exactly one state: used (ref
          count >= 1), plain free (ref count 0, in the free queue once, not
          cached), or cached free (ref count 0, in the cached queue, cached);
        * ``num_free_blocks + num_used_blocks == num_blocks``, where the free
          blocks are the plain and the cached free ones.

    >>> alloc = BlockAllocator(4)
    >>> alloc.allocate(2)
    [0, 1]
    >>> alloc.free([0])
    >>> alloc.num_free_blocks, alloc.ref_count(1)
    (3, 1)
    """

    __slots__ = (
        "_cached",
        "_cached_free",
        "_deferred",
        "_head",
        "_num_blocks",
        "_queue",
        "_ref_counts",
        "on_evict",
        "on_take",
    )

    def __init__(self, num_blocks: int) -> None:
        """Create a pool of ``num_blocks`` free blocks with ids ``0 .. num_blocks - 1``.

        Args:
            num_blocks: how many blocks the pool holds; a positive int.

        Raises:
            InputTypeError: ``num_blocks`` is not an int.
            ConfigError: ``num_blocks`` is below 1.
        """
        num_blocks = check_count("num_blocks", num_blocks)
        self._num_blocks = num_blocks
        try:
            self._ref_counts: list[int] = [0] * num_blocks
            # The plain free ids are _queue[_head:], oldest (next to hand out) first.
            self._queue: list[int] = list(range(num_blocks))
        except (MemoryError, OverflowError):
            wanted = num_blocks * BOOKKEEPING_BYTES_PER_BLOCK
            raise PoolTooLargeError(
                f"an allocator of {num_blocks:,} blocks wants about {wanted:,} bytes of bookkeeping "
                "(two Python lists); give it fewer blocks",
                wanted,
            ) from None
        self._head = 0
        #: Blocks marked cached by the prefix cache, used or free.
        self._cached: set[int] = set()
        #: Cached blocks with ref count 0, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        #: Called with a cached block's id when allocation evicts it for reuse.
        self.on_evict: Callable[[int], None] | None = None
        #: Called with the ids ``allocate``/``allocate_one`` hand out, before they
        #: return (a pool whose pages sit in a page file makes them resident).
        self.on_take: Callable[[list[int]], None] | None = None
        # Actions handed over by ``defer`` (a finalizer that could not take the
        # pool's lock); the next ``allocate`` or ``release_deferred`` runs them.
        self._deferred: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        """How many blocks the pool holds, free and used."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """How many blocks can be allocated right now (plain and cached free ones)."""
        return (len(self._queue) - self._head) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """How many blocks have a ref count of at least one."""
        return self._num_blocks - (len(self._queue) - self._head) - len(self._cached_free)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now.

        >>> BlockAllocator(2).can_allocate(3)
        False
        """
        return 0 <= num_blocks <= (len(self._queue) - self._head) + len(self._cached_free)

    def max_ref_count(self, block_ids: Iterable[int]) -> int:
        """The largest ref count among ``block_ids`` (0 for none); ids are not checked.

        >>> BlockAllocator(2).max_ref_count([0, 1])
        0
        """
        ref_counts = self._ref_counts
        return max((ref_counts[block_id] for block_id in block_ids), default=0)

    def is_shared(self, block_id: int) -> bool:
        """Whether more than one table holds ``block_id``; the id is not checked (as ``max_ref_count``).

        >>> BlockAllocator(2).is_shared(0)
        False
        """
        return self._ref_counts[block_id] > 1

    def must_copy_before_append(self, block_id: int, num_dropped: int = 0) -> bool:
        """Whether an append into ``block_id``, a table's partly filled last block, must copy it first.

        It must when another table holds it (copy-on-write), or when it is
        cached: a prefix key promises the block's full contents to every
        later hit, so a keyed block is never written, even by its only
        holder (a table ``truncate`` cut into it while others held it full).
        ``num_dropped`` references are not counted: a reservation's plan
        drops them earlier in the same step. The id is not checked (as
        ``is_shared``).

        >>> alloc = BlockAllocator(2)
        >>> block_id = alloc.allocate_one()
        >>> alloc.must_copy_before_append(block_id)
        False
        >>> alloc.mark_cached(block_id)
        >>> alloc.must_copy_before_append(block_id)
        True
        """
        return self._ref_counts[block_id] - num_dropped > 1 or block_id in self._cached

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``.

        Raises:
            UnknownBlockError: ``block_id`` is not an id of this pool.
        """
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def next_free_block_id(self) -> int:
        """The id the next ``allocate`` hands out first.

        Raises:
            PoolExhaustedError: no block is free.
        """
        if self._head < len(self._queue):
            return self._queue[self._head]
        if self._cached_free:
            return next(iter(self._cached_free))
        raise PoolExhaustedError(1, 0, self._num_blocks)

    def free_block_ids(self) -> list[int]:
        """The plain free ids in the order they will be handed out (a copy)."""
        return self._queue[self._head :]

    # --------------------------------------------------------------- commands

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with ref count 1, in queue order.

        Args:
            num_blocks: how many blocks to take; zero gives an empty list.

        Returns:
            The new block ids.

        Raises:
            InputTypeError, ConfigError: ``num_blocks`` is not an int >= 0.
            PoolExhaustedError: fewer than ``num_blocks`` are free; nothing changes.
        """
        if num_blocks.__class__ is not int or num_blocks < 0:
            num_blocks = check_count("num_blocks", num_blocks, minimum=0)
        if self._deferred:
            self.release_deferred()
        head = self._head
        end = head + num_blocks
        queue = self._queue
        if end > len(queue):  # every plain free block, then the least recently freed cached ones
            cached_free = self._cached_free
            num_free = len(queue) - head + len(cached_free)
            if num_blocks > num_free:
                raise PoolExhaustedError(num_blocks, num_free, self._num_blocks)
            evicted = [cached_free.popitem(last=False)[0] for _ in range(end - len(queue))]
            self._cached.difference_update(evicted)
            block_ids = queue[head:] + evicted
            self._head = len(queue)
            if self.on_evict is not None:
                for block_id in evicted:
                    self.on_evict(block_id)
        else:
            block_ids = queue[head:end]
            self._head = end
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        if self.on_take is not None:
            self.on_take(block_ids)
        return block_ids

    def allocate_one(self) -> int:
        """Take one free block (ref count 1); the fast path of ``allocate(1)``.

        Raises:
            PoolExhaustedError: no block is free; nothing changes.
        """
        if self._deferred:
            self.release_deferred()
        head = self._head
        if head < len(self._queue):
            block_id = self._queue[head]
            self._head = head + 1
        elif self._cached_free:
            block_id = self._cached_free.popitem(last=False)[0]
            self._cached.discard(block_id)
            if self.on_evict is not None:
                self.on_evict(block_id)
        else:
            raise PoolExhaustedError(1, 0, self._num_blocks)
        self._ref_counts[block_id] = 1
        if self.on_take is not None:
            self.on_take([block_id])
        return block_id

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each used block (a fork, or a prefix hit on a used block).

        Raises:
            UnknownBlockError: an id is not an id of this pool.
            BlockStateError: an id is free, so there is nothing to share; nothing changes.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise BlockStateError(f"block {block_id} is free; only used blocks can be shared")
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each id; ids that reach zero rejoin the free queue.

        An id may appear several times; each appearance drops one reference.

        Raises:
            UnknownBlockError: an id is not an id of this pool; nothing changes.
            DoubleFreeError: an id would drop below zero references; nothing changes.
        """
        if block_ids.__class__ is not list:
            block_ids = list(block_ids)
        ref_counts = self._ref_counts
        num_total = self._num_blocks
        # Fast path, one pass: every id an exact int in range held by exactly
        # one table. Anything else (shared, already free, a duplicate, a bad
        # id) undoes the pass and takes the general path, which checks all
        # first and raises with nothing changed.
        done = 0
        for block_id in block_ids:
            if block_id.__class__ is not int or not 0 <= block_id < num_total or ref_counts[block_id] != 1:
                break
            ref_counts[block_id] = 0
            done += 1
        else:
            self._release(block_ids)
            return
        for block_id in block_ids[:done]:
            ref_counts[block_id] = 1
        for block_id in block_ids:
            self._check_id(block_id)
        for block_id, num_drops in Counter(block_ids).items():
            if ref_counts[block_id] < num_drops:
                raise DoubleFreeError(
                    f"block {block_id} has ref count {ref_counts[block_id]} but was freed "
                    f"{num_drops} time{'s' if num_drops != 1 else ''}; a block table freed it twice"
                )
        released = []
        for block_id in block_ids:
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                released.append(block_id)
        self._release(released)

    def _release(self, block_ids: list[int]) -> None:
        """Queue blocks whose ref count just reached zero: cached ones wait apart."""
        if self._cached:
            cached, cached_free = self._cached, self._cached_free
            plain = []
            for block_id in block_ids:
                if block_id in cached:
                    cached_free[block_id] = None
                else:
                    plain.append(block_id)
            block_ids = plain
        queue = self._queue
        queue.extend(block_ids)
        if self._head > 64 and 2 * self._head > len(queue):
            del queue[: self._head]
            self._head = 0

    def defer(self, action: Callable[[], None]) -> None:
        """Hand over ``action`` (a dropped owner's frees) to run at the next ``allocate``; change nothing now.

        For finalizers: appending to a list is safe at any moment, even in the
        middle of another command of this allocator.
        """
        self._deferred.append(action)

    def release_deferred(self) -> None:
        """Run the actions ``defer`` handed over, oldest first (the caller holds the pool's lock)."""
        while self._deferred:  # an action may defer more: run those too
            actions, self._deferred = self._deferred, []
            for action in actions:
                action()

    def free_one(self, block_id: int) -> None:
        """Drop one reference from ``block_id``; the fast path of ``free([block_id])``."""
        self._check_id(block_id)
        count = self._ref_counts[block_id]
        if count == 0:
            raise DoubleFreeError(f"block {block_id} is already free; a block table freed it twice")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            if block_id in self._cached:
                self._cached_free[block_id] = None
                return
            queue = self._queue
            queue.append(block_id)
            if self._head > 64 and 2 * self._head > len(queue):
                del queue[: self._head]
                self._head = 0

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` free blocks with the next ids; existing ids stay valid.

        Raises:
            InputTypeError, ConfigError: ``num_new_blocks`` is not an int >= 1.
        """
        num_new_blocks = check_count("num_new_blocks", num_new_blocks)
        start = self._num_blocks
        self._num_blocks += num_new_blocks
        self._ref_counts.extend([0] * num_new_blocks)
        self._queue.extend(range(start, self._num_blocks))

    # ------------------------------------------------------------ cached marks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose cached contents a prefix hit can still take back."""
        return len(self._cached_free)

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is marked cached (its contents are findable by key)."""
        return block_id in self._cached

    def cached_free_block_ids(self) -> list[int]:
        """Cached free ids, the next to be evicted first (a copy)."""
        return list(self._cached_free)

    def mark_cached(self, block_id: int) -> None:
        """Mark a used block as cached: when freed it waits to be revived or evicted.

        Raises:
            UnknownBlockError: not an id of this pool.
            BlockStateError: the block is free; only used blocks can be marked.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockStateError(f"block {block_id} is free; only used blocks can be marked cached")
        self._cached.add(block_id)

    def mark_cached_blocks(self, block_ids: list[int]) -> None:
        """:meth:`mark_cached` of each of ``block_ids``: all of them, or (raising) none.

        Raises:
            UnknownBlockError, BlockStateError: as :meth:`mark_cached`, for the first bad id.
        """
        ref_counts = self._ref_counts
        num_blocks = len(ref_counts)
        for block_id in block_ids:
            if block_id.__class__ is not int or not 0 <= block_id < num_blocks or not ref_counts[block_id]:
                self.mark_cached(block_id)  # raises what is wrong with it
        self._cached.update(block_ids)

    def unmark_cached(self, block_id: int) -> None:
        """Drop a block's cached mark; a cached free block becomes a plain free one.

        Raises:
            UnknownBlockError: not an id of this pool.
        """
        self._check_id(block_id)
        if block_id not in self._cached:
            return
        self._cached.discard(block_id)
        if block_id in self._cached_free:
            del self._cached_free[block_id]
            self._queue.append(block_id)

    def revive(self, block_id: int) -> None:
        """Take a cached free block back into use (ref count 1): a prefix hit.

        Raises:
            UnknownBlockError: not an id of this pool.
            BlockStateError: the block is not a cached free block.
        """
        self._check_id(block_id)
        if block_id not in self._cached_free:
            raise BlockStateError(f"block {block_id} is not a cached free block; nothing to revive")
        del self._cached_free[block_id]
        self._ref_counts[block_id] = 1

    # --------------------------------------------------------- internal hooks

    def _take_back(self, freed: list[int], taken: int | None) -> None:
        """Undo ``free(freed)`` followed by an ``allocate_one()`` that returned ``taken``.

        The internal hook of a failed ``KVCache.attend`` (the caller holds the
        pool's lock, as it did for both commands). ``taken`` goes back to the
        head of the plain free queue, then each id of ``freed`` that rejoined a
        free queue leaves it again (the last place it holds, so frees that
        ``defer`` handed over and the take ran stay done), and every id gets
        its reference back: the queues, ref counts and cached marks are as
        before both commands. ``taken`` may be an id of ``freed`` (the freed
        block was handed out again). Not undone: a take that evicted a cached
        block (``on_evict`` told its owner); it comes back as a plain free block.
        """
        ref_counts, queue = self._ref_counts, self._queue
        if taken is not None:
            ref_counts[taken] = 0
            if self._head:
                self._head -= 1
                queue[self._head] = taken
            else:
                queue.insert(0, taken)
        for block_id in reversed(freed):  # the last freed id was queued last
            if ref_counts[block_id] == 0:
                if block_id in self._cached_free:
                    del self._cached_free[block_id]
                else:
                    index = len(queue) - 1
                    while queue[index] != block_id:
                        index -= 1
                    del queue[index]
            ref_counts[block_id] += 1

    def _export_state(self) -> AllocatorState:
        """This allocator's state (copies); with ``_restore_state`` the internal snapshot hook."""
        return AllocatorState(
            ref_counts=list(self._ref_counts),
            free=self._queue[self._head :],
            cached_free=list(self._cached_free),
            cached=sorted(self._cached),
        )

    def _restore_state(self, state: AllocatorState) -> None:
        """Take ``state`` whole (same ``num_blocks``); the caller checks ``check_invariants`` after.

        The ``on_evict`` and ``on_take`` callbacks stay as they are.
        """
        if len(state.ref_counts) != self._num_blocks:
            raise ConfigError(
                f"a state of {len(state.ref_counts)} blocks for an allocator of {self._num_blocks}"
            )
        self._ref_counts = list(state.ref_counts)
        self._queue = list(state.free)
        self._head = 0
        self._cached = set(state.cached)
        self._cached_free = OrderedDict.fromkeys(state.cached_free)

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant in the class docstring is broken."""
        free = self._queue[self._head :]
        free_set = set(free)
        if len(free_set) != len(free):
            raise AssertionError(f"a block is in the free queue twice: {sorted(free)}")
        cached_free = set(self._cached_free)
        if free_set & cached_free:
            raise AssertionError(f"blocks {sorted(free_set & cached_free)} are in both free queues")
        for block_id in range(self._num_blocks):
            count = self._ref_counts[block_id]
            if count < 0:
                raise AssertionError(f"block {block_id} has negative ref count {count}")
            is_free = block_id in free_set or block_id in cached_free
            if (count == 0) != is_free:
                raise AssertionError(
                    f"block {block_id} has ref count {count} but is {'' if is_free else 'not '}free"
                )
            if block_id in cached_free and block_id not in self._cached:
                raise AssertionError(f"block {block_id} waits in the cached queue but is not cached")
            if block_id in free_set and block_id in self._cached:
                raise AssertionError(f"block {block_id} is cached but in the plain free queue")
        if len(self._ref_counts) != self._num_blocks:
            raise AssertionError("ref count table and num_blocks disagree")

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise UnknownBlockError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._num_blocks:
            raise UnknownBlockError(
                f"block id {block_id} is not in this pool (ids 0 to {self._num_blocks - 1})"
            )

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self._num_blocks}, num_free_blocks={self.num_free_blocks})"
