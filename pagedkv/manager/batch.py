"""What one forward step works on: the reserved slots of a batch of sequences.

``KVCacheManager.reserve`` returns a :class:`Batch`; every layer's ``write``
and ``attend`` take it. Tokens of all sequences are flattened in batch order,
as in vLLM::

    batch: seq "a" gets 3 new tokens, seq "b" gets 1
    token index      0    1    2  | 3
    seq              a    a    a  | b
    query_start      0            3     4      (cumulative, length num_seqs + 1)
    slot_mapping    [20, 21, 22,    9]         slot = block_id * block_size + offset
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple, NoReturn, Union, overload

import numpy as np
import numpy.typing as npt

from pagedkv.errors import InputTypeError, ReadOnlyArrayError, SequenceStateError
from pagedkv.manager.sequence import RUNNING, SequenceRecord, SequenceRegistry

__all__ = [
    "Batch",
    "SlotPiece",
    "SlotRun",
    "TokenSlot",
    "batch_records",
    "issue_batch",
    "issue_token_batch",
    "issued_slots",
    "token_slot",
]


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


class _ReadOnlyArray:
    """A :class:`Batch` array field: read-only, and built only when first read.

    ``reserve`` hands its Python values over as they are (the slot pieces,
    or the per-sequence counts for ``query_start``); the array is made the
    first time someone reads the field. A single-token decode whose
    ``write`` never reads ``slot_mapping`` (it copies by the slot it keeps)
    builds no array at all. An array given to the constructor is made
    read-only at once; a list of ints is taken as slots.
    """

    __slots__ = ("_from_ints", "_name")

    def __init__(self, from_ints: Any) -> None:
        self._from_ints = from_ints

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, batch: None, owner: type | None = None) -> _ReadOnlyArray: ...
    @overload
    def __get__(self, batch: Batch, owner: type | None = None) -> npt.NDArray[np.int64]: ...
    def __get__(self, batch: Batch | None, owner: type | None = None) -> Any:
        if batch is None:
            raise AttributeError(self._name)  # no class-level default: the field is required
        stored = batch.__dict__
        try:
            value = stored[self._name]
        except KeyError:  # a decode batch: its fields are made when first read
            value = batch.__getattr__(self._name)
        if value.__class__ is not _ReservedArray:
            value = stored[self._name] = _read_only(self._from_ints(value))
        return value

    def __set__(self, batch: Batch, value: Any) -> None:
        batch.__dict__[self._name] = _read_only(value) if isinstance(value, np.ndarray) else value


def _slot_array(pieces: Sequence[SlotPiece]) -> npt.NDArray[np.int64]:
    if all(piece.__class__ is not SlotRun for piece in pieces):
        return np.array(pieces, np.int64)
    return np.concatenate(
        [piece.slots() if isinstance(piece, SlotRun) else np.array([piece], np.int64) for piece in pieces]
    )


def _query_start(counts: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.array([0, *accumulate(counts)], np.int64)


#: Where the one new token of a single-token batch goes, computed once by ``reserve``:
#: ``(seq_id, position, slot, reservation_id)``. A plain tuple: one is built every decode step.
TokenSlot = tuple[Hashable, int, int, int]

_ONE = (1,)  # num_new_tokens of every single-token batch (and its query_start, made when read)

#: The fields a decode batch makes when first read.
_DECODE_FIELDS = frozenset((
    "seq_ids", "num_new_tokens", "first_positions", "reservation_ids",
    "query_start", "slot_mapping", "_slots",
))


@dataclass(frozen=True)
class Batch:
    """Slots reserved for new tokens of several sequences; valid until they are written.

    Attributes:
        seq_ids: the sequences, in the order their tokens are laid out.
        num_new_tokens: new tokens per sequence.
        first_positions: logical index of each sequence's first new token.
        query_start: ``(num_seqs + 1,)`` offsets of each sequence's tokens in
            the flattened token dimension.
        slot_mapping: ``(num_tokens,)`` int64 slot of every new token
            (``block_id * block_size + offset``), vLLM's slot mapping.
        reservation_ids: the manager's stamp per sequence; a batch whose stamp
            no longer matches (the sequence was freed, preempted or reserved
            again) is refused, and so is any batch but the very object
            ``reserve`` returned (a copy, or one built by hand).

    The arrays are read-only (an edit in place raises
    :class:`~pagedkv.errors.ReadOnlyArrayError`, also a ``ValueError``), and
    made when first read (see ``_ReadOnlyArray``); built by hand they take
    arrays or ints.
    """

    seq_ids: tuple[Hashable, ...]
    num_new_tokens: tuple[int, ...]
    first_positions: tuple[int, ...]
    query_start: _ReadOnlyArray = _ReadOnlyArray(_query_start)
    slot_mapping: _ReadOnlyArray = _ReadOnlyArray(_slot_array)
    # mypy counts the descriptors above as defaults; at run time they have none (see _ReadOnlyArray).
    reservation_ids: tuple[int, ...] = field(repr=False)  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        """A field of a decode batch, made from its ``TokenSlot`` when first read (``issue_token_batch``)."""
        fields = self.__dict__
        token: TokenSlot | None = fields.get("_token")
        if token is None or name not in _DECODE_FIELDS or "seq_ids" in fields:
            raise AttributeError(f"'Batch' object has no attribute {name!r}")
        seq_id, position, slot, reservation_id = token
        fields["seq_ids"] = (seq_id,)
        fields["num_new_tokens"] = fields["query_start"] = _ONE
        fields["first_positions"] = (position,)
        fields["slot_mapping"] = fields["_slots"] = [slot]
        fields["reservation_ids"] = (reservation_id,)
        return fields[name]

    @property
    def num_tokens(self) -> int:
        """New tokens across the whole batch (the flattened token dimension)."""
        return sum(self.num_new_tokens)

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.seq_ids)


def issue_batch(
    seq_ids: tuple[Hashable, ...],
    num_new_tokens: tuple[int, ...],
    first_positions: tuple[int, ...],
    slots: list[SlotPiece],
    reservation_ids: tuple[int, ...],
) -> Batch:
    """The :class:`Batch` ``reserve`` returns: its fields as given, its arrays made when first read.

    ``slots`` holds one piece per sequence, in batch order.

    NOTE: it fills the frozen instance's ``__dict__`` directly instead of
    calling ``__init__``, which pays one ``object.__setattr__`` per field and
    a descriptor call per array, a large share of a single-token ``reserve``
    (benchmarks/bench_requests.py). Only this module builds batches so.
    """
    batch = object.__new__(Batch)
    fields = batch.__dict__
    fields["seq_ids"] = seq_ids
    fields["num_new_tokens"] = num_new_tokens
    fields["first_positions"] = first_positions
    fields["query_start"] = num_new_tokens  # made an array of offsets when first read
    fields["slot_mapping"] = fields["_slots"] = slots  # made an array when first read
    fields["reservation_ids"] = reservation_ids
    return batch


def issue_token_batch(seq_id: Hashable, position: int, slot: int, reservation_id: int) -> Batch:
    """The :class:`Batch` of one new token of one sequence (a decode), holding only its ``TokenSlot``.

    Every field ``issue_batch`` would set is made from the ``TokenSlot``
    when first read (``Batch.__getattr__``): an engine's decode ``write``
    reads only the token, so most decode batches never build the tuples.

    >>> batch = issue_token_batch("a", 5, 29, 3)
    >>> token_slot(batch)
    ('a', 5, 29, 3)
    >>> batch.seq_ids, batch.first_positions, batch.slot_mapping.tolist(), batch.query_start.tolist()
    (('a',), (5,), [29], [0, 1])
    """
    batch = object.__new__(Batch)
    batch.__dict__["_token"] = (seq_id, position, slot, reservation_id)
    return batch


def token_slot(batch: Batch) -> TokenSlot | None:
    """The ``TokenSlot`` of a single-token batch ``reserve`` issued; None for any other object.

    Only a batch from :func:`issue_token_batch` has one: a copy, a batch built
    by hand or anything else gets None (and takes the full checks).
    """
    if batch.__class__ is not Batch:
        return None
    token: TokenSlot | None = batch.__dict__.get("_token")
    return token


def issued_slots(batch: Batch) -> list[SlotPiece]:
    """The slot pieces of a batch ``reserve`` issued (and :func:`batch_records` accepted), one a sequence."""
    fields = batch.__dict__
    slots: list[SlotPiece] = fields["_slots"] if "_slots" in fields else batch._slots  # noqa: SIM401 (lazy)
    return slots


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
    if not found:
        raise SequenceStateError("this batch holds no sequence; write and attend take only reserve()'s batch")
    return found
