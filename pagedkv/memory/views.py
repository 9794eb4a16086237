"""Page views: a block table's blocks mapped side by side, so one array reads them all.

vAttention's idea on a CPU: each (table, layer, K/V) gets an address range
(:class:`~pagedkv.memory.vmem.Reservation`) into which its window blocks are mapped in logical
order, so attention reads one contiguous ``(num_tokens, num_kv_heads, head_dim)`` array whatever
the block ids. Every read first syncs the range with the table (remapping what changed, zeroing
what left, moving the ring's base), so no read sees a block the table no longer holds; released
views read zeros. vLLM and SGLang gather instead; vAttention is the counterpart. The ring, the
sync and the safety rules: docs/paging.md ("How a view is mapped", "Safety rules").
"""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.table import BlockTable, check_block_ids
from pagedkv.memory.vmem import MapBudget, Reservation, populate

__all__ = ["MIN_CAPACITY", "PageFile", "PageViews", "ViewStats"]

#: Fewest block positions a range reserves (address space only; it costs no memory).
MIN_CAPACITY = 16

#: Areas charged per range beyond its mapped blocks: the zero pages on either side.
_AREAS_PER_RANGE = 2

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class PageFile:
    """Where blocks live in the shared page file: layer ``l``, side ``s`` (0 keys, 1 values).

    In a forked child ``fd`` names a copy of the parent's file
    (:mod:`pagedkv.memory.fork`), or, when the child's pages were copied into
    private memory instead, still the parent's file, which nothing maps again.

    Attributes:
        fd: the file's descriptor.
        num_blocks: blocks per (layer, side).
        block_bytes: bytes of one block of one side of one layer (a multiple of the page size).
        token_shape: ``(num_kv_heads, head_dim)``.
        dtype: the pages' dtype.
        num_layers: layers in the file.
        address: where the pool's own (read-write) mapping of the whole file starts.
        mapping: that mapping; held here so ``address`` stays mapped while this object lives.
        resident: one byte per block, 1 once :meth:`make_resident` has seen it.
        value_dtype: the values' dtype, of ``dtype``'s width (None: ``dtype``;
            float16 keys may sit beside bfloat16 values).
    """

    fd: int
    num_blocks: int
    block_bytes: int
    token_shape: tuple[int, int]
    dtype: np.dtype[Any]
    num_layers: int
    address: int
    mapping: mmap.mmap
    resident: bytearray
    value_dtype: np.dtype[Any] | None = None

    def side_dtype(self, side: int) -> np.dtype[Any]:
        """The dtype of side ``side`` (0 keys, 1 values)."""
        return self.dtype if side == 0 or self.value_dtype is None else self.value_dtype

    @property
    def size(self) -> int:
        """Bytes of the whole file: every layer, both sides."""
        return 2 * self.num_layers * self.num_blocks * self.block_bytes

    def offset(self, layer: int, side: int, block_id: int) -> int:
        """Byte offset of a block in the file::

            | L0 keys: blk 0 .. n-1 | L0 values: blk 0 .. n-1 | L1 keys ... |
        """
        return ((2 * layer + side) * self.num_blocks + block_id) * self.block_bytes

    def make_resident(self, block_ids: list[int]) -> None:
        """Allocate every layer's pages of ``block_ids`` now, as the pool hands them out to be written.

        Once per block for the file's lifetime (pages are never given back),
        one :func:`~pagedkv.memory.vmem.populate` per run of consecutive new ids and
        (layer, side). A hint: the bytes do not change, nothing fails.
        """
        resident = self.resident
        fresh = [block_id for block_id in block_ids if not resident[block_id]]
        if not fresh:
            return
        runs: list[list[int]] = []  # [first id, count] of each run of consecutive fresh ids
        for block_id in sorted(fresh):
            if runs and block_id == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([block_id, 1])
        for first, count in runs:
            resident[first : first + count] = b"\x01" * count
            for layer_side in range(2 * self.num_layers):
                offset = (layer_side * self.num_blocks + first) * self.block_bytes
                populate(self.address + offset, count * self.block_bytes)


@dataclass
class ViewStats:
    """Counters of one pool's page views (all reads since the pool was made).

    Attributes:
        num_view_reads: reads served by a mapped view.
        num_gather_reads: reads that gathered (sinks in front of the window,
            a padded batch, the map budget, a refused mapping). Every read
            counts once, here or in ``num_view_reads``.
        num_maps: blocks mapped (``mmap`` calls).
        num_zeroes: position runs zeroed (eviction, truncation, release).
        num_fallbacks: reads refused by the map budget or the kernel.
    """

    num_view_reads: int = 0
    num_gather_reads: int = 0
    num_maps: int = 0
    num_zeroes: int = 0
    num_fallbacks: int = 0


class _Range:
    """One (table, layer, side) address range and what is mapped in it."""

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.reservation = Reservation(capacity * block_bytes)
        self.capacity = capacity
        self.base = 0  # logical block at position 0
        self.lo = 0  # first mapped position; mapped are lo .. lo + len(ids) - 1
        self.ids: list[int] = []
        self.num_charged = 0


#: What a table's window looked like when its views were last synced (see ``_window_state``).
_State = tuple[int, int]


def _window_state(table: BlockTable, first: int) -> _State:
    """What decides the table's mappings: its first window block's logical index, and its version.

    ``BlockTable.blocks_version`` grows with every command that changes the
    held block ids or their places, so two reads that see equal states see
    the same blocks at the same positions: the second maps nothing and reuses
    the first's arrays, in O(1).
    """
    return first, table.blocks_version


class _RefusedError(Exception):
    """The kernel refused to map a block (inside ``PageViews`` only: the read gathers)."""


class _Account:
    """Areas one registry holds of the budget, kept apart so its finalizer can give them back."""

    def __init__(self) -> None:
        self.num_charged = 0


def _give_back(budget: MapBudget, account: _Account) -> None:
    budget.give(account.num_charged)
    account.num_charged = 0


class _TableViews:
    """One table's ranges, and the window arrays read from them while its state holds."""

    def __init__(self) -> None:
        self.ranges: dict[tuple[int, int], _Range] = {}  # (layer, side) -> range
        self.state: _State | None = None
        self.arrays: dict[int, tuple[Array, Array]] = {}  # layer -> the window's keys and values


class PageViews:
    """Every page view of one pool, one registry per pool, safe to use from many threads.

    Invariants:
        * each range maps exactly ``ids`` at positions ``lo .. lo + len(ids) - 1``
          and zeros everywhere else;
        * the areas charged to the budget are ``len(ids) + 2`` per range, and
          this registry holds exactly their sum, stale ranges' included (given
          back when it is collected);
        * a range belongs to a live table, or is *stale*: dropped, but the
          kernel refused to zero it yet (every later call tries again);
        * a collected table's ranges are released;
        * a table's window arrays exist only for layers whose two ranges exist
          (they were read from them since the table's state last changed).
    """

    def __init__(self, pages: PageFile, budget: MapBudget) -> None:
        self.pages = pages
        self.budget = budget
        self.stats = ViewStats()
        # NOTE: a pool dropped with views still mapped never calls _drop; its
        # areas go back to the process-wide budget when this registry is
        # collected (its ranges, unmapped with it, no longer hold them).
        self._account = _Account()
        weakref.finalize(self, _give_back, budget, self._account)
        self._lock = threading.Lock()
        # id(table) -> its ranges and window arrays; the finalizer releases them.
        self._tables: dict[int, _TableViews] = {}
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        # NOTE: a collected table's key waits here for the next call that holds
        # the lock: a finalizer may run inside any allocation, even one made
        # while this thread holds the lock, so it must not take it.
        self._dead: list[int] = []
        # Dropped ranges the kernel would not zero yet (see _drop); each holds its areas.
        self._stale: list[_Range] = []

    @property
    def lock(self) -> threading.Lock:
        """The registry's lock; :mod:`pagedkv.memory.fork` holds it across a fork, after the pool's."""
        return self._lock

    @property
    def num_mapped_blocks(self) -> int:
        """Blocks mapped now, over every range (an upper bound on the areas they take)."""
        with self._lock:
            self._release_dead()
            live = sum(len(r.ids) for views in self._tables.values() for r in views.ranges.values())
            return live + sum(len(piece.ids) for piece in self._stale)

    def read(self, table: BlockTable, layer: int, start: int, end: int) -> tuple[Array, Array] | None:
        """Tokens ``start .. end - 1`` of ``table`` in layer ``layer`` as ``(n, H, d)`` views, or None.

        The range must lie in the window part (after the sink blocks). None
        means the views cannot be had now (the budget, or the kernel refused):
        the caller gathers. The arrays are read-only and valid until this
        table's next read or release; they keep their memory mapped.

        A read of a table whose window blocks are as they were at its last
        read of this layer (every decode step but one in ``block_size``)
        maps nothing: it slices the arrays that read made (see
        :func:`_window_state`). Only a read served here counts (as a view
        read); the caller counts a gather with :meth:`count_gather_reads`.

        Raises:
            UnknownBlockError: a window block id is past the pool's end (it
                would map past the end of the file); nothing changes.
        """
        bs = table.block_size
        num_window = table.num_window_blocks
        first = table.first_block_index
        if not num_window or start < first * bs or end > (first + num_window) * bs:
            return None
        state = _window_state(table, first)
        key = id(table)
        with self._lock:
            if self._dead or self._stale:
                self._release_dead()
            views = self._tables.get(key)
            # NOTE: the common case (a decode step inside a block: nothing changed
            # since this layer's last read) is tested first and slices at once.
            whole = views.arrays.get(layer) if views is not None and views.state == state else None
            if whole is None:
                whole = self._window_arrays(table, views, layer, first, state)
                if whole is None:
                    return None
            self.stats.num_view_reads += 1
        lo = start - first * bs
        hi = end - first * bs
        return whole[0][lo:hi], whole[1][lo:hi]

    def count_gather_reads(self, num_reads: int) -> None:
        """Count ``num_reads`` reads of this pool that gathered instead of reading a view."""
        with self._lock:
            self.stats.num_gather_reads += num_reads

    def release_all_after_fork(self, *, mappable: bool = True) -> None:
        """In a forked child, before any other thread exists: zero and drop every range.

        The ranges map the parent's file; the next read maps the child's
        (``pages.fd``). When the child has no file of its own (``mappable``
        False: its pages were copied into private memory, which no view can
        map) the registry maps nothing more: its budget becomes an empty one,
        so every read gathers. The lock is made anew: another thread of the
        parent may have held it at the fork.
        """
        self._lock = threading.Lock()
        self._release_dead()
        for key in list(self._tables):
            self._release_locked(key)
        if not mappable:
            # NOTE: after the release above, whose areas went back to the process's budget.
            self.budget = MapBudget(limit=0)

    def release(self, table: BlockTable) -> None:
        """Zero and drop every range of ``table`` (a closed cache, a freed sequence)."""
        with self._lock:
            self._release_dead()
            self._release_locked(id(table))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a range's bookkeeping disagrees with the docstring."""
        with self._lock:
            self._release_dead()
            total = 0
            for views in self._tables.values():
                unmapped = [layer for layer in views.arrays
                            if (layer, 0) not in views.ranges or (layer, 1) not in views.ranges]
                if unmapped:
                    raise AssertionError(f"window arrays of layers {unmapped} without their ranges")
                for piece in views.ranges.values():
                    total += piece.num_charged
                    if piece.num_charged != len(piece.ids) + _AREAS_PER_RANGE:
                        raise AssertionError(
                            f"range charges {piece.num_charged} areas for {len(piece.ids)} blocks")
                    if piece.lo < 0 or piece.lo + len(piece.ids) > piece.capacity:
                        raise AssertionError(
                            f"mapped positions {piece.lo}+{len(piece.ids)} past {piece.capacity}")
            total += sum(piece.num_charged for piece in self._stale)
            if total != self._account.num_charged:
                raise AssertionError(f"ranges charge {total} areas but the registry holds "
                                     f"{self._account.num_charged}")
        self.budget.check_invariants()

    # ---------------------------------------------------------------- private

    def _window_arrays(
        self, table: BlockTable, views: _TableViews | None, layer: int, first: int, state: _State
    ) -> tuple[Array, Array] | None:
        """``read``'s slow part (under the lock): the layer's window arrays, mapped now; None on refusal."""
        key = id(table)
        ids = table.window_block_ids(table.num_window_blocks)
        check_block_ids(ids, self.pages.num_blocks)  # before anything maps an offset past the file
        if views is None:
            views = self._tables[key] = _TableViews()
            self._finalizers[key] = weakref.finalize(table, self._forget, key)
        if views.state != state:
            views.state, views.arrays = state, {}
        whole = self._map_window(table, views, layer, first, ids)
        if whole is None:
            self.stats.num_fallbacks += 1
            self._release_locked(key)
            return None
        views.arrays[layer] = whole
        return whole

    def _map_window(
        self, table: BlockTable, views: _TableViews, layer: int, first: int, ids: list[int]
    ) -> tuple[Array, Array] | None:
        """Sync layer ``layer``'s two ranges: the window's keys and values ``(num_window * bs, H, d)``.

        None when the budget or the kernel refused a mapping (any ``OSError``
        included): the areas this call charged are given back, and the caller
        releases the table's ranges, with the areas they hold.
        """
        num_window = len(ids)
        # NOTE: both sides' areas are claimed before either is mapped: a budget
        # with room for one side only must refuse at once, not map keys, fail
        # on values, release, and map the keys again at every read.
        wanted = len(ids) + _AREAS_PER_RANGE
        held = [piece.num_charged if piece is not None else 0
                for piece in (views.ranges.get((layer, 0)), views.ranges.get((layer, 1)))]
        if not self._charge(2 * wanted - sum(held)):
            return None
        # Areas charged for each side that its range has not taken yet (a range
        # takes them when its sync succeeds); a refusal gives back what is left.
        owed = [wanted - held[0], wanted - held[1]]
        sides = []
        try:
            for side in (0, 1):
                piece = self._sync(views.ranges, layer, side, first, ids)
                owed[side] = 0
                offset = (first - piece.base) * self.pages.block_bytes
                flat = piece.reservation.array(offset, num_window * self.pages.block_bytes,
                                               self.pages.side_dtype(side))
                sides.append(flat.reshape(num_window * table.block_size, *self.pages.token_shape))
        except (_RefusedError, OSError, ValueError, OverflowError):
            self._uncharge(sum(owed))
            return None
        return sides[0], sides[1]

    def _sync(
        self, ranges: dict[tuple[int, int], _Range], layer: int, side: int, first: int, ids: list[int]
    ) -> _Range:
        """Make the range of (layer, side) map ``ids`` as logical blocks ``first ..``.

        The caller has charged the budget for ``len(ids) + 2`` areas for this
        range, less what it held; the range takes them (``num_charged``) only
        once it maps ``ids``. A range that replaces another takes over its areas.

        Raises:
            _RefusedError: the kernel refused a mapping.
            OSError, ValueError, OverflowError: a new range could not be reserved,
                or zeros could not be mapped; the caller releases the table's ranges.
        """
        num = len(ids)
        piece = ranges.get((layer, side))
        turns = piece is not None and (first < piece.base or first + num > piece.base + piece.capacity)
        # NOTE: a turn remaps every held block, so the range keeps room for as
        # many again: one extra mapping per appended block, amortised.
        if piece is None or num > piece.capacity or (turns and 2 * num > piece.capacity):
            fresh = _Range(max(2 * num, MIN_CAPACITY), self.pages.block_bytes)  # the old one stays on failure
            fresh.base = first
            if piece is not None:
                fresh.num_charged, piece.num_charged = piece.num_charged, 0  # its areas pass to the new range
                self._drop(piece)
            ranges[(layer, side)] = piece = fresh
        elif turns:
            piece.base = first  # the ring turns: positions are recomputed below
        lo = first - piece.base
        block_bytes = self.pages.block_bytes
        # Zero what lies outside the new mapped positions, then map what differs.
        old_lo, old_ids = piece.lo, piece.ids
        old_hi = old_lo + len(old_ids)
        for zero_lo, zero_hi in ((old_lo, min(old_hi, lo)), (max(old_lo, lo + num), old_hi)):
            if zero_lo < zero_hi:
                piece.reservation.zero(zero_lo * block_bytes, (zero_hi - zero_lo) * block_bytes)
                self.stats.num_zeroes += 1
        if old_lo != lo or old_ids != ids:
            new_ids: list[int] = []
            for position, block_id in enumerate(ids, start=lo):
                index = position - old_lo
                if not (0 <= index < len(old_ids) and old_ids[index] == block_id):
                    file_offset = self.pages.offset(layer, side, block_id)
                    if not piece.reservation.map(position * block_bytes, block_bytes, self.pages.fd,
                                                 file_offset):
                        piece.lo, piece.ids = lo, new_ids  # what is mapped; the release zeroes it all
                        raise _RefusedError
                    self.stats.num_maps += 1
                new_ids.append(block_id)
            piece.lo, piece.ids = lo, new_ids
        piece.num_charged = num + _AREAS_PER_RANGE
        return piece

    def _charge(self, num_areas: int) -> bool:
        if num_areas <= 0:
            self._uncharge(-num_areas)
            return True
        if not self.budget.take(num_areas):
            return False
        self._account.num_charged += num_areas
        return True

    def _uncharge(self, num_areas: int) -> None:
        self.budget.give(num_areas)
        self._account.num_charged -= num_areas

    def _drop(self, piece: _Range) -> None:
        """Zero a range and give its areas back; one the kernel will not zero waits in ``_stale``."""
        try:
            piece.reservation.zero(0, piece.reservation.size)
        except OSError:
            # NOTE: never give up a range still showing blocks: arrays into it
            # could read a block after it passes to another sequence. It keeps
            # its areas and is zeroed again by every later call until it works.
            if piece not in self._stale:
                self._stale.append(piece)
            return
        self.stats.num_zeroes += 1
        self._uncharge(piece.num_charged)
        piece.num_charged = 0
        piece.ids = []

    def _release_locked(self, key: int) -> None:
        for piece in self._tables.pop(key, _TableViews()).ranges.values():
            self._drop(piece)
        finalizer = self._finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()

    def _forget(self, key: int) -> None:
        self._dead.append(key)  # atomic; released under the lock by the next call

    def _release_dead(self) -> None:
        while self._dead:
            self._release_locked(self._dead.pop())  # its finalizer has run: detaching it does nothing
        if self._stale:
            stale, self._stale = self._stale, []
            for piece in stale:
                self._drop(piece)  # back into _stale if the kernel still refuses
