"""A read plan: where the tokens to read lie in the pool, in logical order.

A :class:`~pagedkv.blocks.table.BlockTable` makes plans (it alone knows where
logical index ``i`` lives); a :class:`~pagedkv.memory.pool.KVPool` executes them (it
knows only block ids, slots and arrays, nothing of sinks or windows)::

    table.read_plan(ranges)  ->  ReadPlan  ->  pool.gather(layer, plan)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.errors import UnknownBlockError

__all__ = ["ReadPlan", "check_block_ids"]


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> None:
    """Raise ``UnknownBlockError`` unless every id is in ``0 .. num_blocks - 1``.

    The one range check of a read: a page view maps each id's file offset,
    and an id past the pool's end maps past the end of the file (the first
    touch kills the process with SIGBUS), so ids are checked before any read.

    >>> check_block_ids([3, 0, 7], 8)
    >>> check_block_ids([3, 9], 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pagedkv.errors.UnknownBlockError: block id 9 is not in this pool (ids 0 to 7); ...
    """
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
        bad = next(block_id for block_id in block_ids if not 0 <= block_id < num_blocks)
        raise UnknownBlockError(f"block id {bad} is not in this pool (ids 0 to {num_blocks - 1}); "
                                "the block table names a block the pool does not have")


class ReadPlan(NamedTuple):
    """Where the tokens to read lie in the pool, in logical order: what a pool executes.

    Either *blocks*: the tokens are ``num_tokens`` consecutive slots of the
    blocks ``block_ids`` laid end to end, starting ``offset`` slots into the
    first (``slots`` is None); or *slots*: the tokens are at ``slots``, one
    slot each (sinks in front of a window, or any other gap).

    ::

        block_size 4, blocks (7, 3), offset 2, num_tokens 5:
            block 7: . . x x   block 3: x x x .      slots 30 31 12 13 14

    Attributes:
        num_tokens: tokens to read.
        block_ids: the blocks, in logical order (blocks plans only; empty for slots plans).
        offset: slots to skip in the first block (blocks plans only).
        is_run: the block ids are consecutive (``7, 8, 9``), so the tokens
            are one contiguous stretch of the pool: readable as a view.
        slots: the slot of every token (slots plans only).

    NOTE: a NamedTuple, not a frozen dataclass: every attention call makes
    one, and a tuple is built several times faster.
    """

    num_tokens: int
    block_ids: tuple[int, ...] = ()
    offset: int = 0
    is_run: bool = False
    slots: npt.NDArray[np.intp] | None = None

    def check(self, num_blocks: int, block_size: int) -> None:
        """Raise ``UnknownBlockError`` unless every block (or slot) lies in a pool of ``num_blocks``.

        O(1) for a run (its first and last id), one pass otherwise.

        >>> ReadPlan(5, (7, 3), offset=2).check(8, 4)
        >>> ReadPlan(2, slots=np.array([30, 33])).check(8, 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pagedkv.errors.UnknownBlockError: slot 33 is not in this pool (slots 0 to 31); ...
        """
        if self.slots is not None:
            slots = self.slots
            num_slots = num_blocks * block_size
            if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
                bad = int(slots[(slots < 0) | (slots >= num_slots)][0])
                raise UnknownBlockError(f"slot {bad} is not in this pool (slots 0 to {num_slots - 1}); "
                                        "the block table names a block the pool does not have")
        elif self.is_run and self.block_ids:
            check_block_ids((self.block_ids[0], self.block_ids[-1]), num_blocks)
        else:
            check_block_ids(self.block_ids, num_blocks)

    def slot_array(self, block_size: int) -> npt.NDArray[np.intp]:
        """The slot of every token, whichever kind of plan this is.

        >>> ReadPlan(5, (7, 3), offset=2).slot_array(4).tolist()
        [30, 31, 12, 13, 14]
        """
        if self.slots is not None:
            return self.slots
        ids = np.array(self.block_ids, np.intp)
        every: npt.NDArray[np.intp] = (ids[:, None] * block_size + np.arange(block_size)).ravel()
        return every[self.offset : self.offset + self.num_tokens]
