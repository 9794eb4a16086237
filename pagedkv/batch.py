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

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pagedkv.errors import InputTypeError, SequenceStateError
from pagedkv.sequence import SequenceRecord, SequenceRegistry, SequenceState

__all__ = ["Batch", "batch_records"]


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

    The arrays are read-only.
    """

    seq_ids: tuple[Hashable, ...]
    num_new_tokens: tuple[int, ...]
    first_positions: tuple[int, ...]
    query_start: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    reservation_ids: tuple[int, ...] = field(repr=False)

    def __post_init__(self) -> None:
        # NOTE: read-only views of read-only arrays: neither the view's nor its
        # base's flags can be turned writable again, so the slots the manager
        # handed out cannot be edited in place (they would aim another
        # sequence's keys and values).
        for name in ("query_start", "slot_mapping"):
            array = np.asarray(getattr(self, name))
            if array.flags.writeable:
                array.flags.writeable = False
            view = array.view()
            view.flags.writeable = False
            object.__setattr__(self, name, view)

    @property
    def num_tokens(self) -> int:
        """New tokens across the whole batch (the flattened token dimension)."""
        return int(self.query_start[-1])

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.seq_ids)


def batch_records(records: SequenceRegistry, batch: Batch) -> list[SequenceRecord]:
    """The records of ``batch``'s sequences, each still holding the reservation the batch stamps.

    Raises:
        InputTypeError: ``batch`` is not a Batch.
        SequenceStateError: a sequence was freed, preempted or reserved again since.
    """
    if not isinstance(batch, Batch):
        raise InputTypeError(f"batch must be a Batch from reserve(), got {type(batch).__name__}")
    found = []
    for seq_id, stamp in zip(batch.seq_ids, batch.reservation_ids):
        record = records.get(seq_id)
        if record is None or record.reservation_id != stamp or record.state is not SequenceState.RUNNING:
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
    return found
