"""A read plan: where the tokens to read lie in the pool, in logical order.

A :class:`~pagedkv.block_table.BlockTable` makes plans (it alone knows where
logical index ``i`` lives); a :class:`~pagedkv.pool.KVPool` executes them (it
knows only block ids, slots and arrays, nothing of sinks or windows)::

    table.read_plan(ranges)  ->  ReadPlan  ->  pool.gather(layer, plan)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["ReadPlan"]


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
