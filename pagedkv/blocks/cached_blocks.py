"""Cached marks on blocks: the part of the allocator that prefix caching uses.

A block marked *cached* holds contents worth keeping (it has a prefix key).
When its ref count drops to zero it waits in the allocator's cached free
queue, least recently freed first, where a prefix hit can take it back
(``revive``) until allocation, out of plain free blocks, evicts it. This
mixin holds those commands and queries; :class:`~pagedkv.blocks.allocator.BlockAllocator`
owns the state and inherits them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedkv.errors import BlockStateError

__all__ = ["CachedBlockMarks"]


class CachedBlockMarks:
    """Marking blocks cached, and reviving cached free ones (mixed into ``BlockAllocator``)."""

    __slots__ = ()

    _cached: set[int]
    _cached_free: OrderedDict[int, None]
    _ref_counts: list[int]
    _queue: list[int]
    _check_id: Callable[[int], None]  # BlockAllocator's: UnknownBlockError for a bad id

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
