"""Where a block table's logical indices live: the slot arithmetic, written once.

:class:`~pagedkv.blocks.table.BlockTable` owns the state (its sink block ids,
its window block ids and the logical block the window part starts at) and
calls these functions with it; nothing else computes a slot. Its queries of
where indices live are the :class:`TableLayout` mixin at the end.

Logical index ``i`` lives in logical block ``i // block_size`` at offset
``i % block_size``. A logical block below ``num_sink_blocks`` is a sink
block (``sink_ids[j]``); any other is ``window_ids[j - first_block]``::

    block_size 4, 2 sinks, window start 9, 18 tokens:
        logical block   0    | 1       | 2    | 3    | 4
        held            xx__ | evicted | _xxx | xxxx | xx__
                        sink             first  whole  last
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice, pairwise

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.read_plan import ReadPlan
from pagedkv.counts import ceil_div

__all__ = ["Ranges", "TableLayout", "count_breaks", "live_blocks", "read_plan", "slot_array"]

#: Logical index ranges ``[start, end)``, in order.
Ranges = list[tuple[int, int]]


def count_breaks(block_ids: Iterable[int]) -> int:
    """How many adjacent pairs of ``block_ids`` are not consecutive ids (0: one run).

    >>> count_breaks([3, 4, 5, 9, 10])
    1
    """
    return sum(1 for a, b in pairwise(block_ids) if a + 1 != b)


def read_plan(
    block_size: int,
    num_sink_blocks: int,
    segments: tuple[tuple[int, Sequence[int]], tuple[int, deque[int]]],
    num_breaks: int,
    ranges: Ranges,
) -> ReadPlan:
    """How to read the held logical indices in ``ranges`` of one table.

    One range that lies after the sink blocks becomes a *blocks* plan (whole
    blocks and an offset; a zero-copy view when their ids are one run);
    anything else (sinks in front of a window) a *slots* plan. ``num_breaks``
    is ``count_breaks`` of the window ids, kept up to date by the table.

    >>> read_plan(4, 0, ((0, []), (1, deque([7, 8]))), 0, [(5, 9)])
    ReadPlan(num_tokens=4, block_ids=(7, 8), offset=1, is_run=True, slots=None)
    """
    num_tokens = sum(end - start for start, end in ranges)
    if not num_tokens:
        return ReadPlan(0, is_run=True)
    start, end = ranges[0]
    if len(ranges) > 1 or start // block_size < num_sink_blocks:
        return ReadPlan(num_tokens, slots=slot_array(block_size, segments, ranges))
    first_window, window_ids = segments[1]
    lo = start // block_size - first_window
    hi = ceil_div(end, block_size) - first_window
    if lo == 0 and hi == len(window_ids):
        ids = tuple(window_ids)
        is_run = num_breaks == 0
    else:
        ids = tuple(islice(window_ids, lo, hi))
        is_run = all(a + 1 == b for a, b in pairwise(ids))
    return ReadPlan(num_tokens, ids, start - (lo + first_window) * block_size, is_run)


def slot_array(
    block_size: int, segments: Sequence[tuple[int, Sequence[int]]], ranges: Ranges
) -> npt.NDArray[np.intp]:
    """Slots of the held logical indices in ``ranges``, in order.

    ``segments`` are ``(first logical block, ids)`` of the sink part and of
    the window part of one table, as for :func:`live_blocks`.

    >>> slot_array(4, [(0, []), (0, [7, 2])], [(2, 6)]).tolist()
    [30, 31, 8, 9]
    """
    if not ranges:
        return np.empty(0, np.intp)
    (_, sink_ids), (first_window, window_ids) = segments
    ids = np.array([*sink_ids, *window_ids], np.intp)
    positions = np.concatenate([np.arange(start, end) for start, end in ranges])
    logical_block = positions // block_size
    # Held logical blocks below the window part's first one are sink blocks.
    window_index = logical_block - first_window + len(sink_ids)
    index = np.where(logical_block < first_window, logical_block, window_index)
    slots: npt.NDArray[np.intp] = ids[index] * block_size + positions % block_size
    return slots


def live_blocks(
    block_size: int, segments: Sequence[tuple[int, Sequence[int]]], ranges: Ranges
) -> tuple[list[int], dict[int, int]]:
    """Which blocks hold live tokens: ``(wholly live ids, {partly live id: offset mask})``.

    Args:
        block_size: token slots per block.
        segments: ``(first logical block, ids)`` of the sink part and of the
            window part of one table.
        ranges: the live logical index ranges.

    Bit ``o`` of a mask is set when offset ``o`` of that block holds a live
    token. A block with no live offset (the evicted part of the window's
    first block only) is in neither. Only the blocks at the ends of the sink
    and window parts can be partly live.

    >>> live_blocks(4, [(0, [5]), (2, [6, 7, 8])], [(0, 2), (9, 18)])
    ([7], {5: 3, 6: 14, 8: 3})
    """
    whole: list[int] = []
    masks: dict[int, int] = {}
    for start, end in ranges:
        for first_logical, ids in segments:
            lo_block = max(start // block_size, first_logical)
            hi_block = min(ceil_div(end, block_size), first_logical + len(ids))  # exclusive
            if lo_block >= hi_block:
                continue
            # Blocks strictly between the range's first and last are whole.
            whole.extend(islice(ids, lo_block + 1 - first_logical, hi_block - 1 - first_logical))
            for logical in sorted({lo_block, hi_block - 1}):
                block_id = ids[logical - first_logical]
                lo, hi = max(start - logical * block_size, 0), min(end - logical * block_size, block_size)
                # A sink block the window range reaches too gets both ranges' bits.
                masks[block_id] = masks.get(block_id, 0) | ((1 << hi) - (1 << lo))
    full = (1 << block_size) - 1
    whole.extend(block_id for block_id, mask in masks.items() if mask == full)
    return whole, {block_id: mask for block_id, mask in masks.items() if mask != full}


class TableLayout:
    """``BlockTable``'s queries of where its logical indices live (a mixin: the table holds the state).

    Every method reads the table's state and asks the functions above; none
    changes anything.
    """

    __slots__ = ()

    # The state ``BlockTable`` keeps (its slots); see its docstring.
    block_size: int
    num_sink_tokens: int
    num_sink_blocks: int
    num_tokens: int
    window_start: int
    _sink_ids: list[int]
    _ids: deque[int]
    _first_block: int
    _num_breaks: int

    def holds_block(self, logical_block: int) -> bool:
        """Whether logical block ``logical_block`` is held (a sink block, or in the window part)."""
        last = ceil_div(self.num_tokens, self.block_size)
        if logical_block < self.num_sink_blocks:
            return logical_block < len(self._sink_ids)
        return self._first_block <= logical_block < last

    def ids_of_blocks(self, logical_blocks: range) -> list[int | None]:
        """Each of ``logical_blocks``' id when it is held, else None (:meth:`holds_block`, :meth:`block_id`).

        A range wholly in the window part (every block of a sequence with no
        sinks and no window) is one slice of the ids.
        """
        start, stop = logical_blocks.start, logical_blocks.stop
        if (
            logical_blocks.step == 1
            and start >= self.num_sink_blocks
            and start >= self._first_block
            and stop <= ceil_div(self.num_tokens, self.block_size)
        ):
            first = self._first_block
            return list(islice(self._ids, start - first, max(start, stop) - first))
        return [self.block_id(block) if self.holds_block(block) else None for block in logical_blocks]

    def block_id(self, logical_block: int) -> int:
        """The id of the block holding logical block ``logical_block`` (it must be held)."""
        if logical_block < self.num_sink_blocks:
            return self._sink_ids[logical_block]
        return self._ids[logical_block - self._first_block]

    def slot(self, index: int) -> int:
        """The slot (``block_id * block_size + offset``) of held logical index ``index``.

        The one scalar form of the rule the class docstring draws;
        ``slot_array`` is its vectorized form.
        """
        logical_block, offset = divmod(index, self.block_size)
        return self.block_id(logical_block) * self.block_size + offset

    def slot_array(self, ranges: Ranges) -> npt.NDArray[np.intp]:
        """Slots of the held logical indices in ``ranges``, in order.

        >>> from pagedkv.blocks.table import BlockTable
        >>> table = BlockTable(block_size=4)
        >>> table.append(6, [7, 2])
        >>> table.slot_array([(2, 6)]).tolist()
        [30, 31, 8, 9]
        """
        return slot_array(self.block_size, ((0, self._sink_ids), (self._first_block, self._ids)), ranges)

    def read_plan(self, ranges: Ranges | None = None) -> ReadPlan:
        """How to read the held logical indices in ``ranges`` (default: every held one).

        One range that lies after the sink blocks becomes a *blocks* plan
        (whole blocks and an offset; a zero-copy view when their ids are one
        run); anything else (sinks in front of a window) a *slots* plan.

        >>> from pagedkv.blocks.table import BlockTable
        >>> table = BlockTable(block_size=4)
        >>> table.append(6, [7, 8])
        >>> table.read_plan()
        ReadPlan(num_tokens=6, block_ids=(7, 8), offset=0, is_run=True, slots=None)
        >>> table.read_plan([(5, 6)]).block_ids
        (8,)
        """
        if ranges is None:
            ranges = self.live_ranges()
        segments = ((0, self._sink_ids), (self._first_block, self._ids))
        return read_plan(self.block_size, self.num_sink_blocks, segments, self._num_breaks, ranges)

    def live_blocks(self) -> tuple[list[int], dict[int, int]]:
        """Which held blocks hold live tokens: ``(wholly live ids, {partly live id: offset mask})``.

        Bit ``o`` of a mask is set when offset ``o`` of that block holds a live
        token; see :func:`pagedkv.blocks.layout.live_blocks`.
        """
        segments = ((0, self._sink_ids), (self._first_block, self._ids))
        return live_blocks(self.block_size, segments, self.live_ranges())

    def live_ranges(self) -> list[tuple[int, int]]:
        """Held logical index ranges ``[start, end)``, sinks first, in order."""
        num_sinks = min(self.num_sink_tokens, self.num_tokens)
        ranges = [(0, num_sinks)] if num_sinks else []
        if self.num_tokens > self.window_start:
            ranges.append((self.window_start, self.num_tokens))
        return ranges
