"""Reserving slots for new tokens: the plan, its commit, and the :class:`Batch` it issues.

Planning is pure (:func:`plan_steps` serves ``plan``, ``can_reserve`` and
``reserve`` alike, so a query predicts exactly what the command does); the
commit changes tables and the allocator only once the plan fits. Per sequence:
evict blocks wholly before the new window start, copy a shared or keyed partly
filled last block (copy-on-write), append new blocks. vLLM: the
``allocate_slots`` half of ``vllm/v1/core/kv_cache_manager.py``; the
:class:`Batch` is its slot mapping and ``query_start_loc``.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple, NoReturn, Union

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable
from pagedkv.counts import check_count
from pagedkv.errors import (
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    PoolExhaustedError,
    ReadOnlyArrayError,
    SequenceStateError,
)
from pagedkv.manager.sequence import (
    RUNNING,
    SequenceRecord,
    SequenceRegistry,
    check_settled,
    is_settled,
)
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import pack_token_ids

__all__ = [
    "Batch",
    "ParsedRequests",
    "Requests",
    "ReservationPlan",
    "SequenceStep",
    "SlotPiece",
    "SlotRun",
    "Step",
    "TokenSlot",
    "batch_records",
    "commit_reservation",
    "commit_step",
    "one_token_id",
    "parse_requests",
    "plan_requests",
    "plan_reservation",
    "plan_step",
    "plan_steps",
    "reserve_one",
    "reserve_requests",
    "resolve_requests",
]

# NOTE: Mapping is invariant in its key type, so Mapping[Hashable, ...] would refuse a
# dict[str, int]; Any keys (validated as hashable at run time) accept every dict.
Requests = Mapping[Any, "int | Sequence[int]"] | Iterable[tuple[Hashable, "int | Sequence[int]"]]

#: One sequence's step of a plan: ``(window_start, copy_on_write, num_new_blocks)``.
Step = tuple[int, bool, int]



class ParsedRequests:
    """The requests of one reservation, their types and token ids validated, as parallel lists.

    Attributes:
        seq_ids: each request's sequence, in order.
        counts: tokens to reserve for each (>= 1 once checked by ``resolve_requests``).
        token_ids: their ids, or None where the caller gave a count.
        packed: the ids as int64 bytes (see ``pack_token_ids``), or None.
    """

    __slots__ = ("counts", "packed", "seq_ids", "token_ids")

    def __init__(self) -> None:
        self.seq_ids: list[Hashable] = []
        self.counts: list[int] = []
        self.token_ids: list[list[int] | None] = []
        self.packed: list[bytes | None] = []

    def __len__(self) -> int:
        return len(self.seq_ids)


@dataclass(frozen=True, slots=True)
class SequenceStep:
    """What a reservation does to one sequence.

    Attributes:
        window_start: the window start for its first new token (its current
            one when nothing is evicted).
        copy_on_write: its shared or keyed, partly filled last block is copied first.
        num_new_blocks: blocks appended for its new tokens.
    """

    window_start: int
    copy_on_write: bool
    num_new_blocks: int


@dataclass(frozen=True)
class ReservationPlan:
    """What ``reserve`` would do, computed without doing it.

    Attributes:
        fits: whether the reservation would succeed now.
        num_new_blocks: blocks it would take from the pool (new blocks plus
            copy-on-write copies); exactly what ``reserve`` then takes.
        num_copy_on_write: of those, copies of shared, partly filled blocks.
        num_released_blocks: blocks that would go back to the pool first
            (wholly outside every window, and held by no one else).
        num_free_blocks: free blocks now.
        steps: one :class:`SequenceStep` per request, in order.
    """

    fits: bool
    num_new_blocks: int
    num_copy_on_write: int
    num_released_blocks: int
    num_free_blocks: int
    steps: tuple[SequenceStep, ...] = field(default=(), repr=False, compare=False)


def parse_requests(requests: Requests) -> ParsedRequests:
    """Every request of ``requests``, its types and token ids validated.

    No request at all (``{}``, ``[]``) parses to no request: an empty step.

    Raises:
        InputTypeError: not a mapping or pairs; a value neither a count nor token ids; a bad id.

    >>> parsed = parse_requests({"a": 2, "b": [5, 7]})
    >>> parsed.seq_ids, parsed.counts, parsed.token_ids
    (['a', 'b'], [2, 2], [None, [5, 7]])
    >>> len(parse_requests({}))
    0
    """
    if requests.__class__ is dict:
        pairs: Iterable[tuple[Any, Any]] = requests.items()
    else:
        try:
            items = list(requests.items() if isinstance(requests, Mapping) else requests)
            pairs = [(seq_id, value) for seq_id, value in items]
        except (TypeError, ValueError) as error:
            raise InputTypeError(
                f"requests must be a mapping or (seq_id, num_new_tokens) pairs, got {requests!r}"
            ) from error
    parsed = ParsedRequests()
    seq_ids, counts, token_lists, packed_lists = (
        parsed.seq_ids, parsed.counts, parsed.token_ids, parsed.packed
    )
    for seq_id, value in pairs:
        seq_ids.append(seq_id)
        if value.__class__ is int or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
            counts.append(int(value))
            token_lists.append(None)
            packed_lists.append(None)
            continue
        if one_token_id(value):
            token_ids, packed = [value[0]], None  # one decode token: packed only if it is needed
        else:
            token_ids, packed = pack_token_ids(
                value, f"sequence {seq_id!r}: give a token count or a list of token ids"
            )
        counts.append(len(token_ids))
        token_lists.append(token_ids)
        packed_lists.append(packed)
    return parsed


def one_token_id(value: Any) -> bool:
    """Whether ``value`` is a list of one valid token id (a decode token), checked without packing it."""
    if value.__class__ is not list or len(value) != 1:
        return False
    token_id = value[0]
    return token_id.__class__ is int and 0 <= token_id < 1 << 63


def resolve_requests(
    records: SequenceRegistry, requests: ParsedRequests, *, keyed: bool
) -> list[SequenceRecord]:
    """Each request's record, every request checked: known, once, a count >= 1, settled.

    Args:
        records: the manager's records.
        requests: from :func:`parse_requests`.
        keyed: prefix caching is on, so a keyed sequence needs token ids, not a count.

    Raises:
        UnknownSequenceError, DuplicateSequenceError, ConfigError, InputTypeError,
        SequenceStateError: as ``KVCacheManager.reserve`` documents.
    """
    seen: set[Hashable] | None = set() if len(requests.seq_ids) > 1 else None
    resolved = []
    for seq_id, count, token_ids in zip(requests.seq_ids, requests.counts, requests.token_ids):
        try:
            record = records[seq_id]
        except (KeyError, TypeError):
            record = records.record(seq_id)  # raises the typed error
        if seen is not None:
            if seq_id in seen:
                raise DuplicateSequenceError(f"sequence {seq_id!r} appears twice in one reservation")
            seen.add(seq_id)
        if count < 1:
            check_count(f"tokens for sequence {seq_id!r}", count)
        if not is_settled(record):  # running, and every layer wrote every reserved token
            check_settled(record, "reserve for")
        if keyed and token_ids is None and record.token_ids is not None:
            raise ConfigError(
                f"sequence {seq_id!r} caches its blocks by prefix, so its reservations need "
                f"token ids ({{{seq_id!r}: [17, 4, ...]}}), not a count; or add it with "
                "add_sequence(..., cache_blocks=False)"
            )
        resolved.append(record)
    return resolved


def plan_step(
    table: BlockTable, count: int, allocator: BlockAllocator, window: int | None, ref_drops: dict[int, int]
) -> tuple[Step, int]:
    """One sequence's step of a plan, and how many blocks its evictions give back to the pool.

    ``ref_drops`` counts the references the plan's other steps drop from
    each block (evictions and copies); this step adds its own.
    """
    window_start, num_released = _plan_eviction(table, allocator, window, ref_drops)
    return (window_start, *_plan_growth(table, count, allocator, ref_drops)), num_released


def _plan_eviction(
    table: BlockTable, allocator: BlockAllocator, window: int | None, ref_drops: dict[int, int]
) -> tuple[int, int]:
    """The window start of ``table``'s next token and the blocks its eviction releases; counts its drops."""
    num_released = 0
    if window is None:
        return table.window_start, 0
    window_start = table.num_tokens + 1 - window
    for block_id in table.window_block_ids(table.num_blocks_released_by(window_start)):
        ref_drops[block_id] = ref_drops.get(block_id, 0) + 1
        if ref_drops[block_id] == allocator.ref_count(block_id):
            num_released += 1
    return window_start, num_released


def _plan_growth(
    table: BlockTable, count: int, allocator: BlockAllocator, ref_drops: dict[int, int]
) -> tuple[bool, int]:
    """Whether ``table``'s partly filled last block is copied first, and how many new blocks it takes."""
    bs = table.block_size
    num_tokens = table.num_tokens
    copy_on_write = False
    if num_tokens % bs and table.num_blocks:  # a partly filled last block: copied first if shared or keyed
        last = table.last_block_id
        if allocator.must_copy_before_append(last, ref_drops.get(last, 0)):
            copy_on_write = True
            ref_drops[last] = ref_drops.get(last, 0) + 1
    # ceil((num_tokens + count) / bs) - ceil(num_tokens / bs): BlockTable.num_new_blocks, inlined
    num_blocks = (num_tokens // -bs) - ((num_tokens + count) // -bs)
    return copy_on_write, num_blocks


def plan_steps(
    tables: Sequence[BlockTable],
    counts: Sequence[int],
    allocator: BlockAllocator,
    window: int | None,
) -> tuple[int, int, int, list[Step]]:
    """Plan ``counts`` new tokens (validated) for the sequences of ``tables``; change nothing.

    Returns:
        ``(num_new_blocks, num_copy_on_write, num_released_blocks, steps)``
        as :class:`ReservationPlan` names them, each step a
        ``(window_start, copy_on_write, num_new_blocks)`` tuple.

    ``reserve`` evicts for every sequence first, so every sequence's evictions
    are counted before any copy-on-write is decided: a block another
    sequence's window lets go of is no longer shared for this one, whatever
    the order of the request. A block released by a later sequence counts as
    available to an earlier sequence's new blocks.
    """
    ref_drops: dict[int, int] = {}
    evictions = [_plan_eviction(table, allocator, window, ref_drops) for table in tables]
    steps: list[Step] = []
    num_new = num_cow = num_released = 0
    for table, count, (window_start, released) in zip(tables, counts, evictions):
        copy_on_write, num_blocks = _plan_growth(table, count, allocator, ref_drops)
        num_new += num_blocks + copy_on_write
        num_cow += copy_on_write
        num_released += released
        steps.append((window_start, copy_on_write, num_blocks))
    return num_new, num_cow, num_released, steps


def plan_reservation(
    tables: Sequence[BlockTable],
    counts: Sequence[int],
    allocator: BlockAllocator,
    window: int | None,
) -> ReservationPlan:
    """:func:`plan_steps` as a :class:`ReservationPlan` (what ``KVCacheManager.plan`` returns).

    Args:
        tables: the block table of each request's sequence, in order.
        counts: new tokens per sequence, each sequence once.
        allocator: the pool's allocator (only its ref counts and free count are read).
        window: the window that frees blocks, or None.
    """
    num_new, num_cow, num_released, steps = plan_steps(tables, counts, allocator, window)
    num_free = allocator.num_free_blocks
    return ReservationPlan(
        fits=num_new <= num_free + num_released,
        num_new_blocks=num_new,
        num_copy_on_write=num_cow,
        num_released_blocks=num_released,
        num_free_blocks=num_free,
        steps=tuple(SequenceStep(*step) for step in steps),
    )


def plan_requests(
    records: SequenceRegistry, requests: Requests, pool: KVPool, window: int | None, keyed: bool
) -> ReservationPlan:
    """``KVCacheManager.plan``: parse and resolve ``requests``, then plan them; change nothing.

    Raises:
        what ``KVCacheManager.reserve`` documents for bad requests.
    """
    parsed = parse_requests(requests)
    chosen = resolve_requests(records, parsed, keyed=keyed)
    return plan_reservation([record.table for record in chosen], parsed.counts, pool.allocator, window)


# ------------------------------------------------------------------ the batch


class SlotRun(NamedTuple):
    """The slots of ``num_tokens`` new tokens from ``offset`` in the first of ``block_ids``.

    ``block_ids`` are consecutive logical blocks of one table, so this is
    ``BlockTable.slot``'s rule (``block_id * block_size + offset``) for a run
    of new tokens, kept as the ids until someone reads the batch's
    ``slot_mapping``: a prefill's reservation builds no per-token ints.

    >>> SlotRun([7, 2], 3, 3, 4).slots().tolist()
    [31, 8, 9]
    """

    block_ids: list[int]
    offset: int
    num_tokens: int
    block_size: int

    def slots(self) -> npt.NDArray[np.int64]:
        """The slots, as a new int64 array ``(num_tokens,)``."""
        ids = np.array(self.block_ids, np.int64)  # (num_blocks,)
        grid = ids[:, None] * self.block_size + np.arange(self.block_size)  # (num_blocks, block_size)
        return grid.ravel()[self.offset : self.offset + self.num_tokens]


#: One sequence's slots as ``reserve`` keeps them: an int for one token, a :class:`SlotRun` for more.
SlotPiece = Union[int, SlotRun]  # noqa: UP007 (a runtime alias: py3.10 has no `int | NamedTuple`)

#: Where the one new token of a decode batch goes, computed once by ``reserve``:
#: ``(seq_id, position, slot, reservation_id)``. A plain tuple: one is built every decode step.
TokenSlot = tuple[Hashable, int, int, int]

_ONE = (1,)  # num_new_tokens of every decode batch


class _ReservedArray(np.ndarray):
    """A :class:`Batch` array: read-only, and an edit in place raises :class:`ReadOnlyArrayError`.

    numpy itself refuses the edit with a bare ``ValueError``; this subclass
    only names what was refused. Arithmetic on it gives plain arrays.
    """

    def __setitem__(self, index: Any, value: Any) -> None:
        if not self.flags.writeable:
            _refuse_edit(f"[{index!r}] = {value!r}")
        super().__setitem__(index, value)

    def fill(self, value: Any) -> None:
        if not self.flags.writeable:
            _refuse_edit(f".fill({value!r})")
        super().fill(value)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        if out is not None:
            if any(isinstance(target, _ReservedArray) and not target.flags.writeable for target in out):
                _refuse_edit(f"an in-place {ufunc.__name__}")
            kwargs["out"] = tuple(_plain(target) for target in out)
        return getattr(ufunc, method)(*(_plain(value) for value in inputs), **kwargs)


def _plain(value: Any) -> Any:
    return value.view(np.ndarray) if isinstance(value, _ReservedArray) else value


def _refuse_edit(edit: str) -> NoReturn:
    raise ReadOnlyArrayError(
        f"a Batch's arrays are read-only (they are the slots reserve() handed out), got {edit}; "
        "reserve again for other slots, or compute on a copy: np.array(batch.slot_mapping)"
    )


def _read_only(value: Any) -> npt.NDArray[np.int64]:
    """A read-only view (a ``_ReservedArray``) of a read-only array of ``value``.

    NOTE: neither the view's nor its base's flags can be turned writable
    again, so the slots the manager handed out cannot be edited in place
    (they would aim another sequence's keys and values).
    """
    array = np.asarray(value)
    if array.flags.writeable:
        array.flags.writeable = False
    view: npt.NDArray[np.int64] = array.view(_ReservedArray)
    view.flags.writeable = False
    return view


def _slot_array(pieces: Sequence[SlotPiece]) -> npt.NDArray[np.int64]:
    if all(piece.__class__ is not SlotRun for piece in pieces):
        return np.array(pieces, np.int64)
    return np.concatenate(
        [piece.slots() if isinstance(piece, SlotRun) else np.array([piece], np.int64) for piece in pieces]
    )


class Batch:
    """Slots reserved for new tokens of several sequences; valid until they are written.

    Tokens of all sequences are flattened in batch order, as in vLLM::

        seq "a" gets 3 new tokens, seq "b" gets 1
        token index      0    1    2  | 3
        query_start      0            3     4      (cumulative, length num_seqs + 1)
        slot_mapping    [20, 21, 22,    9]         slot = block_id * block_size + offset

    Attributes:
        seq_ids: the sequences, in the order their tokens are laid out.
        num_new_tokens: new tokens per sequence.
        first_positions: logical index of each sequence's first new token.
        query_start: ``(num_seqs + 1,)`` offsets of each sequence's tokens in
            the flattened token dimension.
        slot_mapping: ``(num_tokens,)`` int64 slot of every new token, vLLM's slot mapping.
        reservation_ids: the manager's stamp per sequence; a batch whose stamp
            no longer matches (the sequence was freed, preempted or reserved
            again) is refused, and so is any batch but the very object
            ``reserve`` returned (a copy, or one built by hand).

    ``reserve({})`` issues the empty batch: no sequence, ``query_start`` ``[0]``,
    an empty ``slot_mapping``; ``write`` and ``attend`` take it with inputs of
    ``0`` tokens, store nothing and return ``0`` rows (a serving loop whose
    running set is empty runs its step unchanged).

    The arrays are read-only (an edit in place raises
    :class:`~pagedkv.errors.ReadOnlyArrayError`, also a ``ValueError``).
    NOTE: ``reserve`` keeps its Python values (slot pieces, counts) and makes
    each array the first time it is read, cached in its slot: a decode whose
    ``write`` copies by its :data:`TokenSlot` builds no array at all.
    """

    __slots__ = (
        "_query_start",
        "_slot_mapping",
        "_slots",
        "_token",
        "first_positions",
        "num_new_tokens",
        "reservation_ids",
        "seq_ids",
    )

    seq_ids: tuple[Hashable, ...]
    num_new_tokens: tuple[int, ...]
    first_positions: tuple[int, ...]
    reservation_ids: tuple[int, ...]
    _token: TokenSlot | None  # a decode batch's token; None for every other batch
    _slots: list[SlotPiece]  # one piece per sequence (a decode batch has none: see _slot_pieces)
    _query_start: npt.NDArray[np.int64]  # made when first read
    _slot_mapping: npt.NDArray[np.int64]  # made when first read

    def __init__(
        self,
        seq_ids: tuple[Hashable, ...],
        num_new_tokens: tuple[int, ...],
        first_positions: tuple[int, ...],
        query_start: Any,
        slot_mapping: Any,
        reservation_ids: tuple[int, ...],
    ) -> None:
        """A batch built by hand (write and attend refuse it: only ``reserve``'s own batch is taken)."""
        self.seq_ids = seq_ids
        self.num_new_tokens = num_new_tokens
        self.first_positions = first_positions
        self._query_start = _read_only(query_start)
        self._slot_mapping = _read_only(slot_mapping)
        self.reservation_ids = reservation_ids
        self._token = None
        self._slots = []

    @classmethod
    def _issue(
        cls,
        seq_ids: tuple[Hashable, ...],
        num_new_tokens: tuple[int, ...],
        first_positions: tuple[int, ...],
        slots: list[SlotPiece],
        reservation_ids: tuple[int, ...],
    ) -> Batch:
        """The batch ``reserve`` returns: its fields as given, arrays made when read.

        ``slots`` holds one piece per sequence, in batch order.
        """
        batch = object.__new__(cls)
        batch.seq_ids = seq_ids
        batch.num_new_tokens = num_new_tokens
        batch.first_positions = first_positions
        batch.reservation_ids = reservation_ids
        batch._token = None
        batch._slots = slots
        return batch

    @classmethod
    def for_token(cls, seq_id: Hashable, position: int, slot: int, reservation_id: int) -> Batch:
        """The batch of one new token of one sequence (a decode), as ``reserve`` issues it.

        >>> batch = Batch.for_token("a", 5, 29, 3)
        >>> batch.seq_ids, batch.first_positions, batch.slot_mapping.tolist(), batch.query_start.tolist()
        (('a',), (5,), [29], [0, 1])
        """
        batch = object.__new__(cls)
        batch._token = (seq_id, position, slot, reservation_id)
        batch.seq_ids = (seq_id,)
        batch.num_new_tokens = _ONE
        batch.first_positions = (position,)
        batch.reservation_ids = (reservation_id,)
        return batch

    @property
    def query_start(self) -> npt.NDArray[np.int64]:
        """``(num_seqs + 1,)`` offsets of each sequence's tokens (read-only)."""
        try:
            return self._query_start
        except AttributeError:  # an issued batch: made now, once
            self._query_start = _read_only(np.array([0, *accumulate(self.num_new_tokens)], np.int64))
            return self._query_start

    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """``(num_tokens,)`` int64 slot of every new token (read-only)."""
        try:
            return self._slot_mapping
        except AttributeError:  # an issued batch: made now, once
            self._slot_mapping = _read_only(_slot_array(self._slot_pieces()))
            return self._slot_mapping

    @property
    def num_tokens(self) -> int:
        """New tokens across the whole batch (the flattened token dimension)."""
        return sum(self.num_new_tokens)

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.seq_ids)

    def __repr__(self) -> str:
        return (
            f"Batch(seq_ids={self.seq_ids!r}, num_new_tokens={self.num_new_tokens!r}, "
            f"first_positions={self.first_positions!r}, query_start={self.query_start!r}, "
            f"slot_mapping={self.slot_mapping!r})"
        )

    def _slot_pieces(self) -> list[SlotPiece]:
        """The slot pieces ``reserve`` kept, one a sequence (a decode batch's is its token's slot)."""
        token = self._token
        return [token[2]] if token is not None else self._slots


def batch_records(records: SequenceRegistry, batch: Batch) -> list[SequenceRecord]:
    """The records of ``batch``'s sequences, each still holding the reservation the batch stamps.

    One identity test per sequence on the common path: a record's ``batch``
    is the very object ``reserve`` returned for its newest reservation, and
    ``free``, ``preempt`` and ``cancel_reservation`` clear it. Anything else
    takes the full check, which says what is wrong.

    Raises:
        InputTypeError: ``batch`` is not a Batch.
        SequenceStateError: a sequence was freed, preempted or reserved again
            since, or ``batch`` is not the object ``reserve`` returned.

    An empty batch (no sequence, no token) gives no record: an empty step.
    """
    found = []
    get = records.get
    for seq_id in batch.seq_ids if batch.__class__ is Batch else ():
        record = get(seq_id)
        if record is None or record.batch is not batch or record.state is not RUNNING:
            return _diagnose(records, batch)
        found.append(record)
    if not found:
        return _diagnose(records, batch)
    return found


def _diagnose(records: SequenceRegistry, batch: Batch) -> list[SequenceRecord]:
    """The full check of :func:`batch_records`, in the order its errors are meant to be found."""
    if not isinstance(batch, Batch):
        raise InputTypeError(f"batch must be a Batch from reserve(), got {type(batch).__name__}")
    found = []
    for seq_id, stamp in zip(batch.seq_ids, batch.reservation_ids):
        record = records.get(seq_id)
        if record is None or record.reservation_id != stamp or record.state is not RUNNING:
            raise SequenceStateError(
                f"this batch's slots for sequence {seq_id!r} are no longer reserved (it was "
                "freed, preempted or reserved again); reserve again (cancel_reservation() "
                "takes back the other sequences' unwritten tokens)"
            )
        if record.batch is not batch:
            raise SequenceStateError(
                f"this batch is not the one reserve() returned for sequence {seq_id!r} (a copy or a "
                "batch built by hand); write and attend take only the manager's own batch"
            )
        found.append(record)
    if not found and batch.num_new_tokens:
        raise SequenceStateError(
            f"this batch holds no sequence but {batch.num_new_tokens!r} new tokens; "
            "write and attend take only reserve()'s batch"
        )
    # NOTE: the empty batch is taken whoever built it: it names no slot, so it
    # cannot aim keys and values at any sequence's blocks.
    return found


# ------------------------------------------------------------------ the commit

# NOTE: one counter for every manager, so a Batch from another manager never
# matches a stamp here (per-manager counters both start at 1).
_RESERVATION_IDS = itertools.count(1)


def reserve_requests(
    records: SequenceRegistry,
    requests: Requests,
    pool: KVPool,
    window: int | None,
    keyed: bool,
    counters: dict[str, int],
) -> Batch:
    """``KVCacheManager.reserve`` on its general path: parse, resolve, plan, and commit if it fits.

    Raises:
        what ``KVCacheManager.reserve`` documents; nothing changes.
    """
    parsed = parse_requests(requests)
    if not parsed:  # an empty step: nothing to plan, stamp or take
        return Batch._issue((), (), (), [], ())
    chosen = resolve_requests(records, parsed, keyed=keyed)
    allocator = pool.allocator
    tables = [record.table for record in chosen]
    num_new, num_cow, num_released, steps = plan_steps(tables, parsed.counts, allocator, window)
    num_available = allocator.num_free_blocks + num_released
    if num_new > num_available:
        raise PoolExhaustedError(
            num_new,
            num_available,
            pool.num_blocks,
            "free or preempt a sequence, reserve fewer tokens, or give the pool more blocks",
        )
    # ---- validated: nothing below can fail ----
    batch = commit_reservation(chosen, parsed, steps, pool, window is not None)
    if num_cow:
        counters["copy_on_write"] += num_cow
    return batch


def commit_reservation(
    records: Sequence[SequenceRecord],
    requests: ParsedRequests,
    steps: Sequence[Step],
    pool: KVPool,
    windowed: bool,
) -> Batch:
    """Carry out a plan that fits: evict, copy on write, append; stamp each record; return the batch.

    Nothing here can fail: the plan was made from these records and the
    pool's current state, and it fits.
    """
    allocator = pool.allocator
    if windowed:
        # Every eviction first: the plan counts a later sequence's released
        # blocks as available to an earlier sequence's new blocks.
        for record, step in zip(records, steps):
            if step[0] > record.table.window_start:
                released = record.table.evict_to(step[0])
                if released:
                    allocator.free(released)
    pieces: list[SlotPiece] = []
    first_positions = []
    stamp = next(_RESERVATION_IDS)
    for record, token_ids, packed, count, step in zip(
        records, requests.token_ids, requests.packed, requests.counts, steps
    ):
        start, piece = commit_step(record, count, token_ids, packed, step, pool)
        first_positions.append(start)
        pieces.append(piece)
        record.reservation_id = stamp
    batch = Batch._issue(
        tuple(requests.seq_ids), tuple(requests.counts), tuple(first_positions), pieces,
        (stamp,) * len(records),
    )
    for record in records:
        record.batch = batch
    return batch


def commit_step(
    record: SequenceRecord,
    count: int,
    token_ids: list[int] | None,
    packed: bytes | None,
    step: Step,
    pool: KVPool,
) -> tuple[int, SlotPiece]:
    """One sequence's part of a commit after its eviction: ids, copy-on-write, append.

    Returns:
        ``(start, piece)``: its first new token's logical index, and the new
        tokens' slots (an int for one token, else a :class:`SlotRun`).
    """
    record.note_reserved(token_ids, packed)
    allocator = pool.allocator
    table = record.table
    if step[1]:
        copy = allocator.allocate_one()
        pool.copy_blocks([table.last_block_id], [copy])
        allocator.free_one(table.replace_last(copy))
    start = table.num_tokens
    num_blocks = step[2]
    if count == 1:
        table.append(1, [allocator.allocate_one()] if num_blocks else [])
        return start, table.slot(start)
    new_ids = allocator.allocate(num_blocks) if num_blocks else []
    offset = start % table.block_size
    covering = [table.last_block_id, *new_ids] if offset else new_ids  # the blocks from ``start`` on
    table.append(count, new_ids)
    return start, SlotRun(covering, offset, count, table.block_size)


def reserve_one(
    records: SequenceRegistry,
    seq_id: Any,
    value: Any,
    pool: KVPool,
    window: int | None,
    keyed: bool,
) -> Batch | None:
    """``reserve`` of one sequence on its common path, or None where that path does not apply.

    The common path: a count or one plain int id, a known, running, settled
    sequence, no copy-on-write, and room in the pool. It checks what
    ``parse_requests`` and ``resolve_requests`` would; anything else (every
    error included) is left to the general path, which raises. Nothing
    changes before the plan is known to fit. A window's eviction comes first,
    as in :func:`commit_reservation`.

    NOTE: the decode token (one token, no window) is planned and committed
    here by hand: its plan is "a new block iff the last one is full; a
    shared or keyed, partly filled last block means copy-on-write, which the general
    path does". An engine makes this call for every sequence every step, and
    two more calls (:func:`plan_step`, :func:`commit_step`) are a large part
    of it. A windowed sequence (a sliding-window group of a hybrid model)
    takes those two calls, without the general path's parse and resolve
    (reserve and write of one decode token, three layers: 18.7 -> 13.0 us; a
    Gemma 3 step of 6 groups and 18 layers 108 -> 81 us).
    tests/manager/test_manager_speed_paths.py feeds the same calls to this
    path and the general one and compares every state, batch and error, and
    runs the state machines with this path off. Its batch carries the
    token's slot (``Batch.for_token``), so each layer's
    ``write`` copies the row without reading any array.
    """
    if value.__class__ is int:
        if value < 1:
            return None
        count, token_ids = value, None
    elif one_token_id(value):
        count, token_ids = 1, value  # only read (note_reserved copies the id)
    else:
        return None
    try:
        record = records[seq_id]
    except (KeyError, TypeError):
        return None
    if not is_settled(record):
        return None
    table = record.table
    num_tokens = table.num_tokens
    if keyed and token_ids is None and record.token_ids is not None:
        return None
    allocator = pool.allocator
    if count > 1 or window is not None:
        step, num_released = plan_step(table, count, allocator, window, {})
        if step[1] or step[2] > allocator.num_free_blocks + num_released:
            return None
        # ---- validated: nothing below can fail ----
        if step[0] > table.window_start:  # the eviction first: its blocks count as room
            released = table.evict_to(step[0])
            if released:
                allocator.free(released)
        start, piece = commit_step(record, count, token_ids, None, step, pool)
        record.reservation_id = stamp = next(_RESERVATION_IDS)
        if piece.__class__ is int:  # one token: commit_step's slot
            batch = Batch.for_token(seq_id, start, piece, stamp)
        else:
            batch = Batch._issue((seq_id,), (count,), (start,), [piece], (stamp,))
        record.batch = batch
        return batch
    # The token lands in the last block when it has room, else in a new one.
    bs = table.block_size
    offset = num_tokens % bs
    if offset:
        block_id = table.last_block_id
        if allocator.must_copy_before_append(block_id):
            return None  # a shared or keyed, partly filled last block: copy-on-write
        new_id = None
    else:
        try:
            block_id = new_id = allocator.allocate_one()  # raises with nothing changed
        except PoolExhaustedError:
            return None  # the general path raises it with the pool's numbers
    # ---- validated (and any new block taken): nothing below can fail ----
    own = record.token_ids
    if own is not None:  # keying is on for it (off: nothing to note)
        if token_ids is None or record.prompt_keys:
            record.note_reserved(token_ids, None)
        else:
            own.append(token_ids[0])  # note_reserved's common case: no prompt keys left to compare
    table.append_token(new_id)
    record.reservation_id = stamp = next(_RESERVATION_IDS)
    record.batch = batch = Batch.for_token(seq_id, num_tokens, block_id * bs + offset, stamp)
    return batch
