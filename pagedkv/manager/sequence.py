"""One sequence as the manager keeps it: its block table, its state, and what each layer has written.

A record moves between three states::

    RUNNING --preempt("recompute")--> PREEMPTED --resume--> RUNNING (empty, or a prefix hit)
    RUNNING --preempt("swap")-------> SWAPPED ----resume--> RUNNING (every token back)

The manager (:mod:`pagedkv.manager.manager`) owns the records and every change to
them; this module only says what a record holds, and reports to a pool which
blocks the records of one state hold (:class:`SequenceHolder`).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.blocks.table import BlockTable, TableState
from pagedkv.counts import check_count
from pagedkv.errors import (
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    SequenceStateError,
    UnknownSequenceError,
)

__all__ = [
    "RUNNING",
    "ManagerState",
    "RecordState",
    "SequenceHolder",
    "SequenceRecord",
    "SequenceRegistry",
    "SequenceState",
    "check_settled",
    "is_settled",
    "pending_layers",
]


class SequenceState(enum.Enum):
    """Where a sequence's blocks are."""

    RUNNING = "running"  #: on the device pool
    PREEMPTED = "preempted"  #: freed for recompute; the caller re-feeds its tokens
    SWAPPED = "swapped"  #: copied to the host pool


#: ``SequenceState.RUNNING`` as a module global, for the checks every decode makes.
#: NOTE: CPython 3.11 does not specialize reading an attribute off a class
#: with a metaclass, so ``SequenceState.RUNNING`` costs several times a global
#: read; ``reserve`` and ``write`` each compare a record's state once a token.
RUNNING = SequenceState.RUNNING

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


@dataclass(frozen=True, slots=True)
class ManagerState:
    """A manager's state beyond its configuration and pools (what a snapshot saves).

    Attributes:
        max_abs_key: the largest |key| written so far, per layer.
        counters: the event counters (``pagedkv.manager.manager.COUNTERS``).
        records: every sequence's record, in the order they were added.
        prefix_keys: ``(block_id, key)`` of every prefix key in insertion order
            (empty without prefix caching).
        num_prefix_evictions: prefix keys dropped for reuse so far.
    """

    max_abs_key: list[float]
    counters: dict[str, int]
    records: list[RecordState]
    prefix_keys: list[tuple[int, bytes]]
    num_prefix_evictions: int


class SequenceRecord:
    """The manager's record of one sequence.

    Invariants (checked by ``KVCacheManager.check_invariants``):
        * every entry of ``num_written`` is at most ``table.num_tokens``;
        * a PREEMPTED record holds no blocks;
        * with prefix keying on, ``token_ids`` has one id per token and
          ``block_keys`` no key for a block some layer has not written;
        * ``prompt_keys`` (keys computed at admission for the blocks after
          ``block_keys``) name blocks wholly inside ``prompt_tokens``, whose
          ids equal the record's own ids wherever both have them; keying off
          (``token_ids is None``) means no prompt keys.

    NOTE: prompt keys are how each block of a request is hashed once. The
    lookup at admission hashes the prompt's full blocks anyway; the keys
    past the hit are kept here, and each is registered as it stands when its
    block is full and written, instead of being hashed again. Every
    reservation's token ids are compared with ``prompt_tokens`` (one bytes
    comparison); from the first id that differs on, the prompt keys are
    dropped, so a kept key always names its block's contents.
    """

    __slots__ = (
        "batch",
        "block_keys",
        "extras",
        "num_written",
        "prompt_keys",
        "prompt_tokens",
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
        #: The stamp of the newest reservation (0: none outstanding) and the
        #: batch object it returned (write and attend accept only that one).
        self.reservation_id = 0
        self.batch: Any = None
        #: Prefix caching: every token id so far (None: keying is off for this
        #: sequence), the chained key of each full logical block from 0, and
        #: the encoded extra keys (salt, adapter, multimodal).
        self.token_ids: list[int] | None = []
        self.block_keys: list[bytes] = []
        self.extras = b""
        #: Keys computed ahead at admission for logical blocks ``len(block_keys)`` on,
        #: and the packed token ids (int64 bytes, from index 0) they were computed from.
        self.prompt_keys: list[bytes] = []
        self.prompt_tokens = b""

    def fork(self, child: Hashable) -> SequenceRecord:
        """A record for ``child`` with a copy of this table and keys (the caller shares the blocks)."""
        twin = SequenceRecord(child, self.table.copy(), len(self.num_written))
        twin.num_written = list(self.num_written)
        twin.token_ids = None if self.token_ids is None else list(self.token_ids)
        twin.block_keys = list(self.block_keys)
        twin.extras = self.extras
        twin.prompt_keys = list(self.prompt_keys)
        twin.prompt_tokens = self.prompt_tokens
        return twin

    def note_reserved(self, token_ids: list[int] | None, packed: bytes | None) -> None:
        """Take the ids of newly reserved tokens (``packed``: their int64 bytes, None if not at hand).

        A count instead of ids (``token_ids`` None) ends keying for good.
        Prompt keys whose blocks the new ids do not match are dropped, from
        the first block that differs on (see the class docstring).
        """
        own = self.token_ids
        if own is None:
            return  # keying is off for this sequence: its ids are not kept
        if token_ids is None:
            self.stop_keying()
            return
        start = len(own)
        own.extend(token_ids)
        if not self.prompt_keys:
            return
        if packed is None:
            packed = array("q", token_ids).tobytes()  # validated ids: only their bytes are wanted
        reference = self.prompt_tokens[8 * start : 8 * start + len(packed)]
        if packed.startswith(reference):
            return
        first = next(i for i in range(0, len(reference), 8) if packed[i : i + 8] != reference[i : i + 8])
        self.drop_prompt_keys((start + first // 8) // self.table.block_size)

    def drop_prompt_keys(self, logical_block: int = 0) -> None:
        """Forget the prompt keys of logical blocks from ``logical_block`` on."""
        del self.prompt_keys[max(0, logical_block - len(self.block_keys)) :]
        if not self.prompt_keys:
            self.prompt_tokens = b""

    def stop_keying(self) -> None:
        """Forget this sequence's token ids for good: its blocks are never keyed from here on."""
        self.token_ids = None
        self.prompt_keys = []
        self.prompt_tokens = b""

    def pending_layers(self) -> list[int]:
        """Layers that have not written every reserved token."""
        return pending_layers(self.num_written, self.table.num_tokens)

    def take_back_unwritten(self) -> list[int]:
        """Return to the tokens every layer wrote; give back the blocks that then hold nothing.

        Any outstanding reservation becomes stale. The caller frees the returned ids.
        """
        keep = min(self.num_written)
        if keep == self.table.num_tokens:
            return []
        return self.truncate(keep)

    def check_truncate(self, num_tokens: object, window: int | None) -> int:
        """Validate ``num_tokens`` for ``truncate`` under ``window`` (the one that frees blocks); return it.

        Raises:
            InputTypeError, ConfigError: not an int in ``0 .. table.num_tokens``.
            SequenceStateError: not running; some layer has not written
                tokens it would keep; the token after the kept ones would
                attend to tokens the window already evicted.
        """
        seq_id, table = self.seq_id, self.table
        if self.state is not SequenceState.RUNNING:
            raise SequenceStateError(f"sequence {seq_id!r} is {self.state.value}, not running")
        num = check_count("num_tokens", num_tokens, minimum=0)
        if num > table.num_tokens:
            raise ConfigError(f"sequence {seq_id!r} holds {table.num_tokens} tokens; cannot keep {num}")
        if num == table.num_tokens:
            return num
        if num > min(self.num_written):
            raise SequenceStateError(
                f"sequence {seq_id!r}: layers {self.pending_layers()} have not written every token "
                f"below {num}; write them or cancel_reservation first"
            )
        # The next token (index ``num``) attends from here on; every such token must still be held.
        needed = table.num_sink_tokens if window is None else max(table.num_sink_tokens, num + 1 - window)
        if needed < table.window_start:
            raise SequenceStateError(
                f"sequence {seq_id!r}: tokens {needed}..{table.window_start - 1} already left the "
                f"window, and the token after the first {num} would attend to them; cannot truncate"
            )
        return num

    def truncate(self, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` tokens in every layer; return the blocks that then hold nothing.

        ``num_tokens`` passed ``check_truncate``. Any outstanding reservation
        becomes stale. Keys of blocks no longer full are forgotten here (the
        caller retracts them from the prefix cache); prompt keys stay valid,
        as the next reservation's ids are compared with the prompt's. The
        caller frees the returned ids.
        """
        released = self.table.truncate(num_tokens)
        self.num_written = [min(num, num_tokens) for num in self.num_written]
        if self.token_ids is not None:
            del self.token_ids[num_tokens:]
        num_full = num_tokens // self.table.block_size
        if num_full < len(self.block_keys):
            del self.block_keys[num_full:]
            self.drop_prompt_keys()  # they named the blocks after the dropped keys
        self.reservation_id = 0
        self.batch = None
        return released

    def check_invariants(self, *, keyed: bool) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken.

        Args:
            keyed: the manager runs prefix caching.
        """
        self.table.check_invariants()
        name = f"sequence {self.seq_id!r}"
        if keyed and self.token_ids is not None and self.state is not SequenceState.PREEMPTED:
            if len(self.token_ids) != self.table.num_tokens:
                raise AssertionError(f"{name}: token ids and table disagree")
            if len(self.block_keys) > min(self.num_written) // self.table.block_size:
                raise AssertionError(f"{name} has keys for unwritten blocks")
        if self.prompt_keys:
            self._check_prompt_keys(name)
        if self.state is SequenceState.PREEMPTED and self.table.num_blocks:
            raise AssertionError(f"preempted {name} still holds blocks")
        if any(n > self.table.num_tokens for n in self.num_written):
            raise AssertionError(f"{name} has more written than reserved")

    def _check_prompt_keys(self, name: str) -> None:
        block_bytes = 8 * self.table.block_size
        end = (len(self.block_keys) + len(self.prompt_keys)) * block_bytes
        if self.token_ids is None:
            raise AssertionError(f"{name} keeps prompt keys with keying off")
        if end > len(self.prompt_tokens):
            raise AssertionError(f"{name} has prompt keys past its prompt")
        start = len(self.block_keys) * block_bytes
        num_own = min(len(self.token_ids) * 8, end)
        own = array("q", self.token_ids[start // 8 : num_own // 8]).tobytes()
        if start < num_own and own != self.prompt_tokens[start:num_own]:
            raise AssertionError(f"{name} keeps prompt keys for blocks whose ids differ from its prompt")

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


class SequenceRegistry(dict[Hashable, SequenceRecord]):
    """A manager's records by sequence id, in the order they were added; lookups fail typed."""

    def record(self, seq_id: Hashable) -> SequenceRecord:
        """The record of ``seq_id``.

        Raises:
            UnknownSequenceError: no such sequence (or it was freed).
            InputTypeError: ``seq_id`` is not hashable.
        """
        try:
            return self[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"no sequence {seq_id!r}; known: {_preview(list(self))}") from None
        except TypeError as error:
            raise InputTypeError(f"sequence ids must be hashable, got {seq_id!r}") from error

    def check_invariants(self, *, keyed: bool, has_host_pool: bool) -> None:
        """Raise ``AssertionError`` if a record's invariant is broken, or one is swapped with no host pool."""
        for record in self.values():
            record.check_invariants(keyed=keyed)
            if record.state is SequenceState.SWAPPED and not has_host_pool:
                raise AssertionError(f"sequence {record.seq_id!r} is swapped without a host pool")

    def check_new(self, seq_id: Hashable) -> None:
        """Refuse ``seq_id`` for a new sequence unless it is hashable and unused.

        Raises:
            DuplicateSequenceError: it is in use.
            InputTypeError: it is not hashable.
        """
        try:
            known = seq_id in self
        except TypeError as error:
            raise InputTypeError(f"sequence ids must be hashable, got {seq_id!r}") from error
        if known:
            state = self[seq_id].state
            hint = "" if state is RUNNING else f" ({state.value}: resume({seq_id!r}) brings it back)"
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists{hint}")


def pending_layers(num_written: list[int], num_tokens: int) -> list[int]:
    """Layers whose written count is not ``num_tokens`` (of a record, or of a saved one)."""
    return [layer for layer, n in enumerate(num_written) if n != num_tokens]


def is_settled(record: SequenceRecord) -> bool:
    """Whether ``record`` is running and every layer wrote every reserved token.

    The one test ``reserve``'s fast and general paths share; ``check_settled``
    says what is wrong when it fails.
    """
    num_written = record.num_written
    num_tokens = record.table.num_tokens
    return record.state is RUNNING and num_written[-1] == num_tokens and (
        len(num_written) == 1 or min(num_written) == num_tokens
    )


def check_settled(record: SequenceRecord, action: str) -> None:
    """Refuse ``action`` unless ``record`` is running and every layer wrote every reserved token.

    Raises:
        SequenceStateError: it is preempted or swapped, or a layer lags behind.
    """
    if record.state is not SequenceState.RUNNING:
        raise SequenceStateError(
            f"cannot {action} sequence {record.seq_id!r}: it is {record.state.value}; "
            f"call resume({record.seq_id!r}) first"
        )
    pending = record.pending_layers()
    if pending:
        raise SequenceStateError(
            f"cannot {action} sequence {record.seq_id!r}: layers {pending} have not written its "
            f"{record.table.num_tokens - min(record.num_written)} newest tokens"
        )


def _preview(items: list[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]" if items else "none"
