"""Planning a reservation: what ``reserve`` would free, copy and take, computed without doing it.

:func:`plan_reservation` is pure: it reads the sequences' tables and the
allocator's ref counts and returns a typed :class:`ReservationPlan`; the
manager validates first, plans, and only then commits the plan. One planning
function (:func:`plan_steps`) serves ``plan()``, ``can_reserve()`` and
``reserve()``, so what the query predicts is exactly what the command does.

Per sequence, in order::

    1. evict: blocks wholly before the new window start go back (with a window);
    2. copy-on-write: a shared or keyed, partly filled last block is copied first;
    3. append: new blocks for the tokens past the last block's free slots.

NOTE: an engine calls ``reserve`` every step for every sequence, so the
parsed requests are parallel lists and each sequence's step a plain tuple:
one ``reserve`` of one decode token builds no object per sequence but its
``Batch`` (see benchmarks/bench_requests.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable
from pagedkv.counts import check_count
from pagedkv.errors import ConfigError, DuplicateSequenceError, InputTypeError
from pagedkv.manager.sequence import SequenceRecord, SequenceRegistry, SequenceState, check_settled
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import pack_token_ids

__all__ = [
    "ParsedRequests",
    "Requests",
    "ReservationPlan",
    "SequenceStep",
    "Step",
    "one_token_id",
    "parse_requests",
    "plan_requests",
    "plan_reservation",
    "plan_step",
    "plan_steps",
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

    Raises:
        InputTypeError: not a mapping or pairs; a value neither a count nor token ids; a bad id.
        ConfigError: no request at all.

    >>> parsed = parse_requests({"a": 2, "b": [5, 7]})
    >>> parsed.seq_ids, parsed.counts, parsed.token_ids
    (['a', 'b'], [2, 2], [None, [5, 7]])
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
    if not seq_ids:
        raise ConfigError("a reservation needs at least one sequence")
    return parsed


def one_token_id(value: Any) -> bool:
    """Whether ``value`` is a list of one valid token id (a decode token), checked without packing it."""
    if value.__class__ is not list or len(value) != 1:
        return False
    token_id = value[0]
    return token_id.__class__ is int and 0 <= token_id < 1 << 63


def resolve_requests(
    records: SequenceRegistry, requests: ParsedRequests, *, keyed: bool, num_layers: int
) -> list[SequenceRecord]:
    """Each request's record, every request checked: known, once, a count >= 1, settled.

    Args:
        records: the manager's records.
        requests: from :func:`parse_requests`.
        keyed: prefix caching is on, so a keyed sequence needs token ids, not a count.
        num_layers: the pool's layers.

    Raises:
        UnknownSequenceError, DuplicateSequenceError, ConfigError, InputTypeError,
        SequenceStateError: as ``KVCacheManager.reserve`` documents.
    """
    seen: set[Hashable] | None = set() if len(requests.seq_ids) > 1 else None
    resolved = []
    running = SequenceState.RUNNING
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
        # Settled: running, and every layer wrote every reserved token (no count exceeds it).
        num_written = record.num_written
        num_tokens = record.table.num_tokens
        if record.state is not running or num_written[-1] != num_tokens or (
            num_layers > 1 and min(num_written) != num_tokens
        ):
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

    ``ref_drops`` counts the references the plan's earlier steps drop from
    each block (evictions and copies); this step adds its own.
    """
    bs = table.block_size
    num_tokens = table.num_tokens
    window_start = table.window_start
    num_released = 0
    if window is not None:
        window_start = num_tokens + 1 - window
        for block_id in table.window_block_ids(table.num_blocks_released_by(window_start)):
            ref_drops[block_id] = ref_drops.get(block_id, 0) + 1
            if ref_drops[block_id] == allocator.ref_count(block_id):
                num_released += 1
    copy_on_write = False
    if num_tokens % bs and table.num_blocks:  # a partly filled last block: copied first if shared or keyed
        last = table.last_block_id
        if allocator.must_copy_before_append(last, ref_drops.get(last, 0)):
            copy_on_write = True
            ref_drops[last] = ref_drops.get(last, 0) + 1
    # ceil((num_tokens + count) / bs) - ceil(num_tokens / bs): BlockTable.num_new_blocks, inlined
    num_blocks = (num_tokens // -bs) - ((num_tokens + count) // -bs)
    return (window_start, copy_on_write, num_blocks), num_released


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

    A block released by a later sequence counts as available to an earlier
    sequence's new blocks: ``reserve`` evicts for every sequence first.
    """
    ref_drops: dict[int, int] = {}
    steps: list[Step] = []
    num_new = num_cow = num_released = 0
    for table, count in zip(tables, counts):
        step, released = plan_step(table, count, allocator, window, ref_drops)
        num_new += step[2] + step[1]
        num_cow += step[1]
        num_released += released
        steps.append(step)
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
    chosen = resolve_requests(records, parsed, keyed=keyed, num_layers=pool.num_layers)
    return plan_reservation([record.table for record in chosen], parsed.counts, pool.allocator, window)
