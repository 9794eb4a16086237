"""Counting live token slots from a manager's block tables, in O(sequences).

``KVCacheManager.metrics()`` counts live slots block by block. The simulator
measures memory often, so it counts the same number from the tables' ends:
between a table's first and last block every held block is full and live
(the window only ever starts inside the first one), so only the two end
blocks need their live ranges, merged over the tables that share them::

    block_size 4, window start 5, 14 tokens:   _xxx|xxxx|xxxx|xx__
                                               first  full  full  last
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedkv.manager import KVCacheManager

__all__ = ["count_live_slots"]


def count_live_slots(manager: KVCacheManager, seq_ids: Iterable[Hashable]) -> tuple[int, int]:
    """``(live slots, block ids held summed over the tables)`` of running sequences ``seq_ids``.

    A slot shared by several tables counts once in the first number; the
    second counts every table's blocks (its excess over the used blocks is
    what sharing saved). Sequences with attention sinks are not supported
    (the simulator runs none).

    >>> import numpy as np
    >>> from pagedkv import KVPool
    >>> manager = KVCacheManager(KVPool(8, block_size=4, head_dim=1))
    >>> manager.add_sequence("a")
    0
    >>> batch = manager.reserve({"a": 6})
    >>> manager.write(0, batch, np.zeros((6, 1, 1)), np.zeros((6, 1, 1)))
    >>> manager.fork("a", "b")
    >>> count_live_slots(manager, ["a", "b"]), manager.metrics().num_live_slots
    ((6, 4), 6)
    """
    full: set[int] = set()
    ends: dict[int, tuple[int, int]] = {}
    num_held = 0
    bs = manager.pool.block_size
    for seq_id in seq_ids:
        table = manager.block_table(seq_id)
        block_ids = table.block_ids
        num_held += len(block_ids)
        if not block_ids:
            continue
        num_tokens, window_start = table.num_tokens, table.window_start
        if len(block_ids) > 2:
            full.update(block_ids[1:-1])
        first = table.first_block_index * bs
        last = first + (len(block_ids) - 1) * bs
        for block_id, base in ((block_ids[0], first), (block_ids[-1], last)):
            lo, hi = max(0, window_start - base), min(bs, num_tokens - base)
            old = ends.get(block_id)
            ends[block_id] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    num_live = bs * len(full)
    for block_id, (lo, hi) in ends.items():
        if block_id not in full:
            num_live += hi - lo
    return num_live, num_held
