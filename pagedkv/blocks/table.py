"""The block table: which block holds each logical index of one sequence, and its read plans.

:class:`BlockTable` is bookkeeping in Python ints (numpy only for slot arrays); it
never touches the allocator or the pool's arrays. It alone knows where logical
index ``i`` lives (the slot arithmetic, drawn in its docstring), and it makes the
:class:`ReadPlan` a pool executes: ``table.read_plan(ranges) -> ReadPlan ->
pool.gather(layer, plan)``. vLLM: the block tables of
``vllm/v1/core/single_type_kv_cache_manager.py``; SGLang: ``ReqToTokenPool``.
Design notes (the owner's protocol, sinks, windows): docs/design.md, "Block ids".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.counts import ceil_div, check_count
from pagedkv.errors import BlockTableError, UnknownBlockError

__all__ = ["BlockTable", "Ranges", "ReadPlan", "TableState", "check_block_ids", "count_breaks"]

#: Logical index ranges ``[start, end)``, in order.
Ranges = list[tuple[int, int]]


def count_breaks(block_ids: Iterable[int]) -> int:
    """How many adjacent pairs of ``block_ids`` are not consecutive ids (0: one run).

    >>> count_breaks([3, 4, 5, 9, 10])
    1
    """
    return sum(1 for a, b in pairwise(block_ids) if a + 1 != b)


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

    A :class:`BlockTable` makes plans (it alone knows where logical index ``i``
    lives); a :class:`~pagedkv.memory.pool.KVPool` executes them (it knows only
    block ids, slots and arrays, nothing of sinks or windows).

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


@dataclass(frozen=True, slots=True)
class TableState:
    """A table's whole state as plain ints: what a snapshot saves (see ``BlockTable._export_state``).

    Attributes:
        num_tokens: logical length.
        window_start: first held logical index after the sinks.
        first_block: logical block index of the first held window block.
        sink_ids: held sink block ids.
        window_ids: held window block ids, oldest first.
    """

    num_tokens: int
    window_start: int
    first_block: int
    sink_ids: list[int]
    window_ids: list[int]


class BlockTable:
    """One sequence's ordered block ids and the range of logical indices they hold.

    The owner (a cache or the manager) asks the table how many blocks an
    operation needs, takes them from the allocator, hands them to the table,
    and frees what the table gives back. The first ``num_sink_blocks``
    logical blocks hold the attention sinks and are never freed; the window
    part starts after them.

    Logical index ``i`` lives in logical block ``i // block_size`` at offset
    ``i % block_size``. A logical block below ``num_sink_blocks`` is a sink
    block (``sink_ids[j]``); any other is ``window_ids[j - first_block_index]``.
    The methods under "where logical indices live" compute that, from the
    table's state only; nothing else computes a slot::

        block_size 4, 2 sinks, window start 9, 18 tokens:
            logical block   0    | 1       | 2    | 3    | 4
            held            xx__ | evicted | _xxx | xxxx | xx__
                            sink             first  whole  last

    Invariants:
        * held logical blocks are ``0 .. num_sink_blocks - 1`` (sink blocks, as
          far as the sequence reaches) and ``first_block_index .. last`` with
          ``first_block_index >= num_sink_blocks``;
        * ``len(block_ids) == ceil(num_tokens / block_size) - first_block_index
          + len(sink part)``: every logical block from the first held one to the
          one holding the newest token is present, none beyond;
        * ``num_sink_tokens <= window_start <= num_tokens`` once past the sinks,
          and no held window block lies wholly before ``window_start``;
        * no block id appears twice.

    >>> table = BlockTable(block_size=4)
    >>> table.num_new_blocks(5)
    2
    >>> table.append(5, [7, 3])
    >>> table.block_ids, table.slot(4)
    ([7, 3], 12)
    """

    __slots__ = (
        "__weakref__",
        "_first_block",
        "_ids",
        "_num_breaks",
        "_sink_ids",
        "block_size",
        "blocks_version",
        "num_sink_blocks",
        "num_sink_tokens",
        "num_tokens",
        "window_start",
    )

    def __init__(self, block_size: int, num_sink_tokens: int = 0) -> None:
        """Create an empty table.

        Args:
            block_size: token slots per block.
            num_sink_tokens: leading tokens that are never evicted.

        Raises:
            InputTypeError, ConfigError: a size is not an int (>= 1; sinks >= 0).
        """
        if block_size.__class__ is not int or block_size < 1:  # the common case costs one test
            block_size = check_count("block_size", block_size)
        if num_sink_tokens.__class__ is not int or num_sink_tokens < 0:
            num_sink_tokens = check_count("num_sink_tokens", num_sink_tokens, minimum=0)
        self.block_size = block_size
        self.num_sink_tokens = num_sink_tokens
        self.num_sink_blocks = ceil_div(num_sink_tokens, block_size)
        #: Logical length: every token ever appended, evicted ones included.
        self.num_tokens = 0
        #: First logical index after the sinks that is still held.
        self.window_start = num_sink_tokens
        self._sink_ids: list[int] = []
        self._ids: deque[int] = deque()
        self._first_block = self.num_sink_blocks
        # Adjacent pairs in ``_ids`` that are not consecutive block ids; zero
        # means the window part is one run, readable as an array view.
        self._num_breaks = 0
        #: Grows whenever the held block ids or their logical places change
        #: (page views compare it to know a table is unchanged in O(1)).
        self.blocks_version = 0

    @classmethod
    def restored(
        cls, block_size: int, num_sink_tokens: int, num_tokens: int, window_start: int, block_ids: list[int]
    ) -> BlockTable:
        """A table of ``num_tokens`` tokens whose held blocks are ``block_ids``.

        ``block_ids`` are the sink blocks (as far as the tokens reach) followed
        by the window blocks from the one holding ``window_start`` on; used
        when a prefix-cache hit hands a new sequence existing blocks, and by
        snapshots.
        """
        table = cls(block_size, num_sink_tokens)
        num_sink = min(table.num_sink_blocks, ceil_div(num_tokens, block_size))
        window_ids = list(block_ids[num_sink:])
        # Tokens that end inside the sink blocks leave the window part empty at num_sink_blocks.
        first_block = max(table.num_sink_blocks, ceil_div(num_tokens, block_size) - len(window_ids))
        table._restore_state(TableState(
            num_tokens=num_tokens,
            window_start=max(num_sink_tokens, min(window_start, num_tokens)),
            first_block=first_block,
            sink_ids=list(block_ids[:num_sink]),
            window_ids=window_ids,
        ))
        return table

    def _export_state(self) -> TableState:
        """The table's state as plain ints (a copy); ``_restore_state`` takes it back.

        With ``_restore_state`` this is the table's internal hook for
        snapshots and sequence records: no other module reads or writes the
        table's private fields.
        """
        return TableState(self.num_tokens, self.window_start, self._first_block,
                          list(self._sink_ids), list(self._ids))

    def _restore_state(self, state: TableState) -> None:
        """Take every field from ``state``, in place (the caller checks the invariants after)."""
        self.num_tokens = state.num_tokens
        self.window_start = state.window_start
        self._first_block = state.first_block
        self._sink_ids = list(state.sink_ids)
        self._ids = deque(state.window_ids)
        self._num_breaks = count_breaks(state.window_ids)
        self.blocks_version += 1

    # ---------------------------------------------------------------- queries

    @property
    def block_ids(self) -> list[int]:
        """Held block ids in logical order (a copy)."""
        return self._sink_ids + list(self._ids)

    @property
    def num_blocks(self) -> int:
        """How many blocks the table holds."""
        return len(self._sink_ids) + len(self._ids)

    @property
    def num_window_blocks(self) -> int:
        """How many blocks the window part (after the sink blocks) holds."""
        return len(self._ids)

    def window_block_ids(self, num_blocks: int) -> list[int]:
        """The ``num_blocks`` oldest window block ids (the next ``evict_to`` candidates)."""
        return list(islice(self._ids, num_blocks))

    @property
    def first_block_index(self) -> int:
        """Logical block index of the first held window block."""
        return self._first_block

    @property
    def num_live_tokens(self) -> int:
        """How many tokens are held (sinks plus window), not counting evicted ones."""
        num_sinks = min(self.num_sink_tokens, self.num_tokens)
        return num_sinks + max(0, self.num_tokens - self.window_start)

    @property
    def is_one_run(self) -> bool:
        """Whether the held blocks are consecutive ids with no sinks in front."""
        return self._num_breaks == 0 and not self._sink_ids

    @property
    def last_block_id(self) -> int:
        """Id of the block that holds the newest token."""
        return self._ids[-1] if self._ids else self._sink_ids[-1]

    def num_new_blocks(self, num_tokens: int) -> int:
        """How many blocks appending ``num_tokens`` more tokens needs."""
        bs = self.block_size
        return ceil_div(self.num_tokens + num_tokens, bs) - ceil_div(self.num_tokens, bs)

    def num_blocks_released_by(self, window_start: int) -> int:
        """How many blocks ``evict_to(window_start)`` would give back."""
        end = min(window_start, self.num_tokens)
        num_whole = end // self.block_size - self._first_block
        return max(0, min(num_whole, len(self._ids)))

    # --------------------------------------------------------------- commands

    def append(self, num_tokens: int, new_block_ids: list[int]) -> None:
        """Record ``num_tokens`` new tokens stored in the held blocks and ``new_block_ids``.

        ``new_block_ids`` must hold exactly ``num_new_blocks(num_tokens)`` ids.
        """
        if len(new_block_ids) != self.num_new_blocks(num_tokens):
            raise BlockTableError(
                f"appending {num_tokens} tokens needs {self.num_new_blocks(num_tokens)} "
                f"new blocks, got {len(new_block_ids)}"
            )
        if not new_block_ids:
            self.num_tokens += num_tokens
            return
        sink_ids, ids = self._sink_ids, self._ids
        window_ids = new_block_ids
        if len(sink_ids) < self.num_sink_blocks:
            num_sinks = self.num_sink_blocks - len(sink_ids)
            sink_ids.extend(new_block_ids[:num_sinks])
            window_ids = new_block_ids[num_sinks:]
        if window_ids:
            first = window_ids[0]
            if ids and ids[-1] + 1 != first:
                self._num_breaks += 1
            # NOTE: one C-level compare finds the common cases (a prefill's new
            # blocks are consecutive ids: ascending from a fresh pool, descending
            # as a freed sequence's blocks come back, tail first); only other
            # lists are walked.
            num_new = len(window_ids)
            if window_ids == list(range(first, first - num_new, -1)):
                self._num_breaks += num_new - 1
            elif window_ids != list(range(first, first + num_new)):
                self._num_breaks += count_breaks(window_ids)
            ids.extend(window_ids)
        self.blocks_version += 1
        self.num_tokens += num_tokens

    def append_token(self, new_block_id: int | None) -> None:
        """``append(1, [new_block_id])``, or ``append(1, [])`` for None (the last block has room).

        A decode's append: no list to check when the last block has room.

        >>> table = BlockTable(block_size=2)
        >>> table.append_token(5); table.append_token(None); table.append_token(6)
        >>> table.block_ids, table.num_tokens
        ([5, 6], 3)
        """
        if new_block_id is not None or not self.num_tokens % self.block_size:
            self.append(1, [] if new_block_id is None else [new_block_id])  # (it says what is wrong)
        else:
            self.num_tokens += 1

    def evict_to(self, window_start: int) -> list[int]:
        """Evict every window index below ``window_start``; return the blocks now unused.

        Indices below ``num_sink_tokens`` are never evicted. The returned ids
        are newest first (as ``clear`` and vLLM free): with prefix caching the
        caller's frees put a longer prefix's block in the cached free queue
        before a shorter one's, so the longer is evicted first and no chain
        loses a middle block while its tail is still findable.
        """
        window_start = min(max(window_start, self.window_start), self.num_tokens)
        if window_start <= self.window_start:
            return []
        self.window_start = window_start
        released = []
        ids = self._ids
        bs = self.block_size
        first_block = self._first_block
        while ids and (self._first_block + 1) * bs <= window_start:
            block_id = ids.popleft()
            if ids and ids[0] != block_id + 1:
                self._num_breaks -= 1
            released.append(block_id)
            self._first_block += 1
        if not ids:
            # Nothing held in the window: the next token's block starts it again.
            self._first_block = max(self._first_block, ceil_div(self.num_tokens, bs))
        if released or self._first_block != first_block:
            self.blocks_version += 1  # a start inside the same first block maps nothing new
        released.reverse()
        return released

    def replace_last(self, block_id: int) -> int:
        """Swap the block holding the newest token for ``block_id``; return the old id.

        Used by copy-on-write: the caller copied the old block's contents first.
        """
        if self._ids:
            old = self._ids.pop()
            if self._ids and self._ids[-1] + 1 != old:
                self._num_breaks -= 1
            if self._ids and self._ids[-1] + 1 != block_id:
                self._num_breaks += 1
            self._ids.append(block_id)
        else:
            old = self._sink_ids[-1]
            self._sink_ids[-1] = block_id
        self.blocks_version += 1
        return old

    def replace_all(self, block_ids: list[int]) -> list[int]:
        """Swap every held id for the one at the same place in ``block_ids``; return the old ids."""
        if len(block_ids) != self.num_blocks:
            raise BlockTableError(f"table holds {self.num_blocks} blocks, got {len(block_ids)} ids")
        old = self.block_ids
        num_sink = len(self._sink_ids)
        self._sink_ids = list(block_ids[:num_sink])
        self._ids = deque(block_ids[num_sink:])
        self._num_breaks = count_breaks(self._ids)
        self.blocks_version += 1
        return old

    def truncate(self, num_tokens: int) -> list[int]:
        """Forget the tokens from ``num_tokens`` on; return blocks now unused, newest first.

        Only held tokens can be taken back: none of ``num_tokens .. end`` may
        have been evicted.

        >>> table = BlockTable(block_size=2)
        >>> table.append(5, [4, 5, 6])
        >>> table.truncate(2), table.block_ids
        ([6, 5], [4])
        """
        evicted_lo = max(num_tokens, self.num_sink_tokens)
        evicted_hi = min(self.num_tokens, self.window_start)
        if not 0 <= num_tokens <= self.num_tokens or evicted_lo < evicted_hi:
            raise BlockTableError(
                f"cannot truncate {self.num_tokens} tokens to {num_tokens}: "
                f"tokens {evicted_lo}..{evicted_hi - 1} are already evicted"
            )
        bs = self.block_size
        self.num_tokens = num_tokens
        released = []
        needed = ceil_div(num_tokens, bs)
        while self._ids and self._first_block + len(self._ids) > needed:
            block_id = self._ids.pop()
            if self._ids and self._ids[-1] + 1 != block_id:
                self._num_breaks -= 1
            released.append(block_id)
        while len(self._sink_ids) > min(self.num_sink_blocks, needed):
            released.append(self._sink_ids.pop())
        if not self._ids:
            self._first_block = max(self.num_sink_blocks, min(self._first_block, needed))
        self.blocks_version += 1
        return released

    def clear(self) -> list[int]:
        """Drop every block and token; return the ids, newest first (tail first)."""
        released = list(self._ids)[::-1] + self._sink_ids[::-1]
        self._sink_ids = []
        self._ids = deque()
        self._first_block = self.num_sink_blocks
        self._num_breaks = 0
        self.num_tokens = 0
        self.window_start = self.num_sink_tokens
        self.blocks_version += 1
        return released

    def copy(self) -> BlockTable:
        """An independent table with the same ids (the caller shares the blocks)."""
        twin = BlockTable(self.block_size, self.num_sink_tokens)
        twin._restore_state(self._export_state())
        return twin

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant in the class docstring is broken."""
        bs = self.block_size
        ids = self.block_ids
        if len(set(ids)) != len(ids):
            raise AssertionError(f"a block id appears twice in one table: {ids}")
        expected_sink = min(self.num_sink_blocks, ceil_div(self.num_tokens, bs))
        if len(self._sink_ids) != expected_sink:
            raise AssertionError(
                f"{len(self._sink_ids)} sink blocks held, expected {expected_sink}"
            )
        if self._first_block < self.num_sink_blocks:
            raise AssertionError("window part starts inside the sink blocks")
        last_block = ceil_div(self.num_tokens, bs)
        expected_window = max(0, last_block - self._first_block)
        if len(self._ids) != expected_window:
            raise AssertionError(
                f"{len(self._ids)} window blocks held for logical blocks "
                f"{self._first_block}..{last_block - 1}, expected {expected_window}"
            )
        if self._ids and (self._first_block + 1) * bs <= self.window_start:
            raise AssertionError(
                f"block {self._ids[0]} lies wholly before window_start {self.window_start}"
            )
        if self.num_tokens > self.num_sink_tokens and not (
            self.num_sink_tokens <= self.window_start <= self.num_tokens
        ):
            raise AssertionError(
                f"window_start {self.window_start} outside [{self.num_sink_tokens}, {self.num_tokens}]"
            )
        breaks = count_breaks(self._ids)
        if breaks != self._num_breaks:
            raise AssertionError(f"run breaks counted {self._num_breaks}, actual {breaks}")

    # ------------------------------------- where logical indices live (queries)

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
        :meth:`slot_array` is its vectorized form.
        """
        logical_block, offset = divmod(index, self.block_size)
        return self.block_id(logical_block) * self.block_size + offset

    def slot_array(self, ranges: Ranges) -> npt.NDArray[np.intp]:
        """Slots of the held logical indices in ``ranges``, in order (a new array).

        >>> table = BlockTable(block_size=4)
        >>> table.append(6, [7, 2])
        >>> table.slot_array([(2, 6)]).tolist()
        [30, 31, 8, 9]
        """
        if not ranges:
            return np.empty(0, np.intp)
        block_size, sink_ids, first_window = self.block_size, self._sink_ids, self._first_block
        start, end = ranges[0]
        if len(ranges) == 1 and start // block_size >= first_window and start < end:
            # One range of window blocks (a decode's read): block by block, one
            # array the size of the result (the general form below makes eight).
            first, last = start // block_size - first_window, (end - 1) // block_size - first_window
            ids = np.fromiter(islice(self._ids, first, last + 1), np.intp, last + 1 - first)
            by_block = (ids * block_size)[:, None] + np.arange(block_size)
            offset = start % block_size
            run: npt.NDArray[np.intp] = by_block.reshape(-1)[offset : offset + end - start]
            return run
        ids = np.array([*sink_ids, *self._ids], np.intp)
        positions = np.concatenate([np.arange(start, end) for start, end in ranges])
        logical_block = positions // block_size
        # Held logical blocks below the window part's first one are sink blocks.
        window_index = logical_block - first_window + len(sink_ids)
        index = np.where(logical_block < first_window, logical_block, window_index)
        slots: npt.NDArray[np.intp] = ids[index] * block_size + positions % block_size
        return slots

    def read_plan(self, ranges: Ranges | None = None) -> ReadPlan:
        """How to read the held logical indices in ``ranges`` (default: every held one).

        One range that lies after the sink blocks becomes a *blocks* plan
        (whole blocks and an offset; a zero-copy view when their ids are one
        run); anything else (sinks in front of a window) a *slots* plan.

        >>> table = BlockTable(block_size=4)
        >>> table.append(6, [7, 8])
        >>> table.read_plan()
        ReadPlan(num_tokens=6, block_ids=(7, 8), offset=0, is_run=True, slots=None)
        >>> table.read_plan([(5, 6)]).block_ids
        (8,)
        >>> window = BlockTable.restored(4, 0, num_tokens=12, window_start=4, block_ids=[7, 8])
        >>> window.read_plan([(5, 9)])  # logical blocks 1 and 2, from offset 1
        ReadPlan(num_tokens=4, block_ids=(7, 8), offset=1, is_run=True, slots=None)
        """
        if ranges is None:
            ranges = self.live_ranges()
        num_tokens = sum(end - start for start, end in ranges)
        if not num_tokens:
            return ReadPlan(0, is_run=True)
        block_size = self.block_size
        start, end = ranges[0]
        if len(ranges) > 1 or start // block_size < self.num_sink_blocks:
            return ReadPlan(num_tokens, slots=self.slot_array(ranges))
        first_window, window_ids = self._first_block, self._ids
        lo = start // block_size - first_window
        hi = ceil_div(end, block_size) - first_window
        if lo == 0 and hi == len(window_ids):
            ids = tuple(window_ids)
            is_run = self._num_breaks == 0
        else:
            ids = tuple(islice(window_ids, lo, hi))
            is_run = all(a + 1 == b for a, b in pairwise(ids))
        return ReadPlan(num_tokens, ids, start - (lo + first_window) * block_size, is_run)

    def live_blocks(self) -> tuple[list[int], dict[int, int]]:
        """Which held blocks hold live tokens: ``(wholly live ids, {partly live id: offset mask})``.

        Bit ``o`` of a mask is set when offset ``o`` of that block holds a live
        token. A block with no live offset (the evicted part of the window's
        first block only) is in neither. Only the blocks at the ends of the sink
        and window parts can be partly live.

        >>> table = BlockTable.restored(4, 2, num_tokens=18, window_start=9, block_ids=[5, 6, 7, 8])
        >>> table.live_blocks()  # the class docstring's drawing
        ([7], {5: 3, 6: 14, 8: 3})
        """
        block_size = self.block_size
        segments: tuple[tuple[int, Sequence[int]], ...] = (
            (0, self._sink_ids), (self._first_block, self._ids)
        )
        whole: list[int] = []
        masks: dict[int, int] = {}
        for start, end in self.live_ranges():
            for first_logical, ids in segments:
                lo_block = max(start // block_size, first_logical)
                hi_block = min(ceil_div(end, block_size), first_logical + len(ids))  # exclusive
                if lo_block >= hi_block:
                    continue
                # Blocks strictly between the range's first and last are whole.
                whole.extend(islice(ids, lo_block + 1 - first_logical, hi_block - 1 - first_logical))
                for logical in sorted({lo_block, hi_block - 1}):
                    block_id = ids[logical - first_logical]
                    lo = max(start - logical * block_size, 0)
                    hi = min(end - logical * block_size, block_size)
                    # A sink block the window range reaches too gets both ranges' bits.
                    masks[block_id] = masks.get(block_id, 0) | ((1 << hi) - (1 << lo))
        full = (1 << block_size) - 1
        whole.extend(block_id for block_id, mask in masks.items() if mask == full)
        return whole, {block_id: mask for block_id, mask in masks.items() if mask != full}

    def live_ranges(self) -> list[tuple[int, int]]:
        """Held logical index ranges ``[start, end)``, sinks first, in order."""
        num_sinks = min(self.num_sink_tokens, self.num_tokens)
        ranges = [(0, num_sinks)] if num_sinks else []
        if self.num_tokens > self.window_start:
            ranges.append((self.window_start, self.num_tokens))
        return ranges

    # ------------------------------------------------------------- the holder

    def held_block_ids(self) -> list[int]:
        """The held block ids, once each: a table is a :class:`~pagedkv.memory.pool.BlockHolder`."""
        return self.block_ids

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_ids={self.block_ids}, num_tokens={self.num_tokens}, "
            f"window_start={self.window_start})"
        )
