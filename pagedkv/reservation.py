"""Planning a reservation: what ``reserve`` would free, copy and take, computed without doing it.

:func:`plan_reservation` is pure: it reads the sequences' tables and the
allocator's ref counts and returns a typed :class:`ReservationPlan`; the
manager validates first, plans, and only then commits the plan. One plan
serves ``plan()``, ``can_reserve()`` and ``reserve()``, so what the query
predicts is exactly what the command does.

Per sequence, in order::

    1. evict: blocks wholly before the new window start go back (with a window);
    2. copy-on-write: a shared, partly filled last block is copied first;
    3. append: new blocks for the tokens past the last block's free slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.batch import Batch
from pagedkv.block_table import BlockTable
from pagedkv.counts import check_count
from pagedkv.errors import ConfigError, DuplicateSequenceError, InputTypeError
from pagedkv.pool import KVPool
from pagedkv.prefix_cache import as_token_ids
from pagedkv.sequence import SequenceRecord, SequenceRegistry, SequenceState, check_settled

__all__ = [
    "Request",
    "Requests",
    "ReservationPlan",
    "SequenceStep",
    "commit_reservation",
    "parse_requests",
    "plan_reservation",
    "resolve_requests",
]

# NOTE: one counter for every manager, so a Batch from another manager never
# matches a stamp here (per-manager counters both start at 1).
_RESERVATION_IDS = itertools.count(1)

# NOTE: Mapping is invariant in its key type, so Mapping[Hashable, ...] would refuse a
# dict[str, int]; Any keys (validated as hashable at run time) accept every dict.
Requests = Mapping[Any, "int | Sequence[int]"] | Iterable[tuple[Hashable, "int | Sequence[int]"]]


@dataclass(frozen=True, slots=True)
class Request:
    """One sequence's part of a reservation, validated.

    Attributes:
        seq_id: the sequence.
        num_new_tokens: tokens to reserve (>= 1 once checked by the manager).
        token_ids: their ids, or None when the caller gave a count.
    """

    seq_id: Hashable
    num_new_tokens: int
    token_ids: list[int] | None


@dataclass(frozen=True, slots=True)
class SequenceStep:
    """What a reservation does to one sequence.

    Attributes:
        window_start: the window start for its first new token (its current
            one when nothing is evicted).
        copy_on_write: its shared, partly filled last block is copied first.
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


def parse_requests(requests: Requests) -> list[Request]:
    """Every request of ``requests`` as a :class:`Request`, its types and token ids validated.

    Raises:
        InputTypeError: not a mapping or pairs; a value neither a count nor token ids; a bad id.
        ConfigError: no request at all.

    >>> [request.token_ids for request in parse_requests({"a": 2, "b": [5, 7]})]
    [None, [5, 7]]
    """
    try:
        items = list(requests.items() if isinstance(requests, Mapping) else requests)
        pairs = [(seq_id, value) for seq_id, value in items]
    except (TypeError, ValueError) as error:
        raise InputTypeError(
            f"requests must be a mapping or (seq_id, num_new_tokens) pairs, got {requests!r}"
        ) from error
    if not pairs:
        raise ConfigError("a reservation needs at least one sequence")
    result = []
    for seq_id, value in pairs:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            result.append(Request(seq_id, int(value), None))
            continue
        token_ids = as_token_ids(value, f"sequence {seq_id!r}: give a token count or a list of token ids")
        result.append(Request(seq_id, len(token_ids), token_ids))
    return result


def resolve_requests(
    records: SequenceRegistry, requests: Sequence[Request], *, keyed: bool, num_layers: int
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
    seen: set[Hashable] = set()
    resolved = []
    for request in requests:
        record = records.record(request.seq_id)
        if request.seq_id in seen:
            raise DuplicateSequenceError(f"sequence {request.seq_id!r} appears twice in one reservation")
        seen.add(request.seq_id)
        if request.num_new_tokens < 1:
            check_count(f"tokens for sequence {request.seq_id!r}", request.num_new_tokens)
        # Fast path: the last layer written and one layer means settled.
        table = record.table
        settled = record.state is SequenceState.RUNNING and record.num_written[-1] == table.num_tokens
        if not settled or (num_layers > 1 and record.pending_layers()):
            check_settled(record, "reserve for")
        if keyed and request.token_ids is None and record.token_ids is not None:
            raise ConfigError(
                f"sequence {request.seq_id!r} caches its blocks by prefix, so its reservations need "
                f"token ids ({{{request.seq_id!r}: [17, 4, ...]}}), not a count; or add it with "
                "add_sequence(..., cache_blocks=False)"
            )
        resolved.append(record)
    return resolved


def plan_reservation(
    tables: Sequence[BlockTable],
    requests: Sequence[Request],
    allocator: BlockAllocator,
    window: int | None,
) -> ReservationPlan:
    """Plan ``requests`` (already validated) against their sequences' ``tables``; change nothing.

    Args:
        tables: the block table of each request's sequence, in order.
        requests: the requests, each sequence once.
        allocator: the pool's allocator (only its ref counts and free count are read).
        window: the window that frees blocks, or None.

    A block released by a later sequence counts as available to an earlier
    sequence's new blocks: ``reserve`` evicts for every sequence first.
    """
    block_size = 0
    ref_drops: dict[int, int] = {}
    steps = []
    num_new = num_cow = num_released = 0
    for table, request in zip(tables, requests):
        block_size = table.block_size
        window_start = table.window_start
        if window is not None:
            window_start = table.num_tokens + 1 - window
            for block_id in table.window_block_ids(table.num_blocks_released_by(window_start)):
                ref_drops[block_id] = ref_drops.get(block_id, 0) + 1
                if ref_drops[block_id] == allocator.ref_count(block_id):
                    num_released += 1
        copy_on_write = False
        if table.num_tokens % block_size and table.num_blocks:
            last = table.last_block_id
            if allocator.ref_count(last) - ref_drops.get(last, 0) > 1:
                copy_on_write = True
                ref_drops[last] = ref_drops.get(last, 0) + 1
        num_blocks = table.num_new_blocks(request.num_new_tokens)
        num_new += num_blocks + copy_on_write
        num_cow += copy_on_write
        steps.append(SequenceStep(window_start, copy_on_write, num_blocks))
    num_free = allocator.num_free_blocks
    return ReservationPlan(
        fits=num_new <= num_free + num_released,
        num_new_blocks=num_new,
        num_copy_on_write=num_cow,
        num_released_blocks=num_released,
        num_free_blocks=num_free,
        steps=tuple(steps),
    )


def commit_reservation(
    records: Sequence[SequenceRecord],
    requests: Sequence[Request],
    plan: ReservationPlan,
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
        for record, step in zip(records, plan.steps):
            if step.window_start > record.table.window_start:
                released = record.table.evict_to(step.window_start)
                if released:
                    allocator.free(released)
    slots: list[int] = []
    first_positions, stamps = [], []
    for record, request, step in zip(records, requests, plan.steps):
        if request.token_ids is None:
            record.token_ids = None  # a count: this sequence's token ids are unknown from here on
        elif record.token_ids is not None:
            record.token_ids.extend(request.token_ids)
        table = record.table
        if step.copy_on_write:
            copy = allocator.allocate_one()
            pool.copy_blocks([table.last_block_id], [copy])
            allocator.free_one(table.replace_last(copy))
        start = table.num_tokens
        num_new = request.num_new_tokens
        table.append(num_new, allocator.allocate(step.num_new_blocks) if step.num_new_blocks else [])
        first_positions.append(start)
        if num_new == 1:
            slots.append(table.slot(start))
        else:
            slots.extend(table.slots(start, start + num_new))
        record.reservation_id = stamp = next(_RESERVATION_IDS)
        stamps.append(stamp)
    counts = [request.num_new_tokens for request in requests]
    batch = Batch(
        seq_ids=tuple(request.seq_id for request in requests),
        num_new_tokens=tuple(counts),
        first_positions=tuple(first_positions),
        query_start=np.array([0, *accumulate(counts)], np.int64),
        slot_mapping=np.array(slots, np.int64),
        reservation_ids=tuple(stamps),
    )
    for record in records:
        record.batch = batch
    return batch
