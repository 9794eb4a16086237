"""Counting live token slots over block tables: the one rule ``metrics()`` and the simulator share.

A slot is *live* when it holds a token some table still attends to (not evicted,
not an empty tail); blocks shared by several tables (forks, prefix hits) count
once. Only the blocks at the ends of a table's sink and window parts can be partly
live (``BlockTable.live_blocks``), so the count costs O(blocks held), O(1) per
table that shares nothing. vLLM counts blocks only (``BlockPool.get_usage``)::

    block_size 4, window start 5, 14 tokens:   _xxx|xxxx|xxxx|xx__
                                               first  whole whole last
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable

__all__ = ["count_live_slots"]


def count_live_slots(tables: Iterable[BlockTable], allocator: BlockAllocator) -> tuple[int, int]:
    """``(live slots, block ids held summed over the tables)`` of ``tables`` on one pool.

    Args:
        tables: the block tables, each holding blocks of the same pool.
        allocator: the pool's allocator; a table whose blocks all have ref
            count 1 shares nothing and is counted directly.

    A slot shared by several tables counts once in the first number; the
    second counts every table's blocks (its excess over the used blocks is
    what sharing saved).

    >>> allocator = BlockAllocator(4)
    >>> table = BlockTable(block_size=4)
    >>> table.append(6, allocator.allocate(2))
    >>> twin = table.copy()  # a fork: both tables hold blocks 0 and 1
    >>> allocator.share(twin.block_ids)
    >>> count_live_slots([table, twin], allocator)
    (6, 4)
    """
    whole: set[int] = set()
    masks: dict[int, int] = {}
    num_live = num_held = 0
    block_size = 0
    for table in tables:
        block_ids = table.block_ids
        num_held += len(block_ids)
        block_size = table.block_size
        if allocator.max_ref_count(block_ids) <= 1:
            num_live += table.num_live_tokens  # nothing shared: no other table counts these slots
            continue
        table_whole, table_masks = table.live_blocks()
        whole.update(table_whole)
        for block_id, mask in table_masks.items():
            masks[block_id] = masks.get(block_id, 0) | mask
    num_live += block_size * len(whole)
    num_live += sum(mask.bit_count() for block_id, mask in masks.items() if block_id not in whole)
    return num_live, num_held
