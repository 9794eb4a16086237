"""One sequence as the manager keeps it: its block table, its state, and what each layer has written.

A record moves between three states::

    RUNNING --preempt("recompute")--> PREEMPTED --resume--> RUNNING (empty, or a prefix hit)
    RUNNING --preempt("swap")-------> SWAPPED ----resume--> RUNNING (every token back)

The manager (:mod:`pagedkv.manager`) owns the records and every change to
them; this module only says what a record holds, and reports to a pool which
blocks the records of one state hold (:class:`SequenceHolder`).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from pagedkv.block_table import BlockTable, TableState

__all__ = ["RecordState", "SequenceHolder", "SequenceRecord", "SequenceState"]


class SequenceState(enum.Enum):
    """Where a sequence's blocks are."""

    RUNNING = "running"  #: on the device pool
    PREEMPTED = "preempted"  #: freed for recompute; the caller re-feeds its tokens
    SWAPPED = "swapped"  #: copied to the host pool


@dataclass(frozen=True, slots=True)
class RecordState:
    """A record's whole state as plain values (what a snapshot saves).

    Attributes:
        seq_id: the sequence id.
        state: where its blocks are.
        table: its block table's state.
        num_written: tokens written, per layer.
        token_ids: every token id so far, or None once prefix keying is off for it.
        block_keys: the chained prefix key of each full logical block from 0.
        extras: the encoded extra keys.
    """

    seq_id: Hashable
    state: SequenceState
    table: TableState
    num_written: list[int]
    token_ids: list[int] | None
    block_keys: list[bytes]
    extras: bytes


class SequenceRecord:
    """The manager's record of one sequence.

    Invariants (checked by ``KVCacheManager.check_invariants``):
        * every entry of ``num_written`` is at most ``table.num_tokens``;
        * a PREEMPTED record holds no blocks;
        * with prefix keying on, ``token_ids`` has one id per token and
          ``block_keys`` no key for a block some layer has not written.
    """

    __slots__ = (
        "block_keys",
        "extras",
        "num_written",
        "reservation_id",
        "seq_id",
        "state",
        "table",
        "token_ids",
    )

    def __init__(self, seq_id: Hashable, table: BlockTable, num_layers: int) -> None:
        self.seq_id = seq_id
        self.table = table
        self.state = SequenceState.RUNNING
        #: Tokens whose k/v are written, per layer.
        self.num_written = [0] * num_layers
        #: The stamp of the newest reservation (0: none outstanding).
        self.reservation_id = 0
        #: Prefix caching: every token id so far (None: keying is off for this
        #: sequence), the chained key of each full logical block from 0, and
        #: the encoded extra keys (salt, adapter, multimodal).
        self.token_ids: list[int] | None = []
        self.block_keys: list[bytes] = []
        self.extras = b""

    def fork(self, child: Hashable) -> SequenceRecord:
        """A record for ``child`` with a copy of this table and keys (the caller shares the blocks)."""
        twin = SequenceRecord(child, self.table.copy(), len(self.num_written))
        twin.num_written = list(self.num_written)
        twin.token_ids = None if self.token_ids is None else list(self.token_ids)
        twin.block_keys = list(self.block_keys)
        twin.extras = self.extras
        return twin

    def pending_layers(self) -> list[int]:
        """Layers that have not written every reserved token."""
        return [layer for layer, n in enumerate(self.num_written) if n != self.table.num_tokens]

    def export_state(self) -> RecordState:
        """This record as plain values (copies)."""
        return RecordState(
            seq_id=self.seq_id,
            state=self.state,
            table=self.table._export_state(),
            num_written=list(self.num_written),
            token_ids=None if self.token_ids is None else list(self.token_ids),
            block_keys=list(self.block_keys),
            extras=self.extras,
        )

    @classmethod
    def from_state(cls, state: RecordState, block_size: int, num_sink_tokens: int) -> SequenceRecord:
        """A record rebuilt from ``state`` (the caller validated it and owns the blocks' ref counts)."""
        table = BlockTable(block_size, num_sink_tokens)
        table._restore_state(state.table)
        record = cls(state.seq_id, table, len(state.num_written))
        record.state = state.state
        record.num_written = list(state.num_written)
        record.token_ids = None if state.token_ids is None else list(state.token_ids)
        record.block_keys = list(state.block_keys)
        record.extras = state.extras
        return record


class SequenceHolder:
    """Reports to a pool the block ids that a manager's records in one state hold.

    A pool counts every holder's blocks in ``check_invariants``; the manager
    registers one holder per pool (RUNNING records on the device pool,
    SWAPPED ones on the host pool).
    """

    __slots__ = ("__weakref__", "_records", "_state")

    def __init__(self, records: Mapping[Hashable, SequenceRecord], state: SequenceState) -> None:
        self._records = records
        self._state = state

    def held_block_ids(self) -> list[int]:
        """Every block id held by a record in this holder's state, once per table."""
        state = self._state
        return [
            block_id
            for record in self._records.values()
            if record.state is state
            for block_id in record.table.block_ids
        ]
