"""Carrying out a reservation: the commit of a plan that fits, and the decode fast path.

:mod:`pagedkv.manager.reserve` plans; this module changes the tables and the
allocator, only after the plan is known to fit, and issues the
:class:`~pagedkv.manager.batch.Batch`. :func:`reserve_requests` is the manager's
general ``reserve``; :func:`reserve_one` its fast path for one sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagedkv.errors import PoolExhaustedError
from pagedkv.manager.batch import Batch, SlotPiece, SlotRun, issue_batch, issue_token_batch
from pagedkv.manager.reserve import (
    ParsedRequests,
    Requests,
    Step,
    one_token_id,
    parse_requests,
    plan_step,
    plan_steps,
    resolve_requests,
)
from pagedkv.manager.sequence import RUNNING, SequenceRecord, SequenceRegistry
from pagedkv.memory.pool import KVPool

__all__ = ["commit_reservation", "commit_step", "reserve_one", "reserve_requests"]

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
    chosen = resolve_requests(records, parsed, keyed=keyed, num_layers=pool.num_layers)
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
        first_positions.append(commit_step(record, count, token_ids, packed, step, pool, pieces))
        record.reservation_id = stamp
    batch = issue_batch(
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
    slots: list[SlotPiece],
) -> int:
    """One sequence's part of a commit after its eviction: ids, copy-on-write, append; return its start.

    The new tokens' slots go to ``slots``: an int for one token, else a :class:`SlotRun`.
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
        slots.append(table.slot(start))
        return start
    new_ids = allocator.allocate(num_blocks) if num_blocks else []
    offset = start % table.block_size
    covering = [table.last_block_id, *new_ids] if offset else new_ids  # the blocks from ``start`` on
    table.append(count, new_ids)
    slots.append(SlotRun(covering, offset, count, table.block_size))
    return start


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
    sequence, no window, no copy-on-write, and room in the pool. It checks
    what ``parse_requests`` and ``resolve_requests`` would; anything else
    (every error included) is left to the general path, which raises.
    Nothing changes before the plan is known to fit.

    NOTE: the decode token (one token, no window) is planned and committed
    here by hand: its plan is "a new block iff the last one is full; a
    shared or keyed, partly filled last block means copy-on-write, which the general
    path does". An engine makes this call for every sequence every step, and
    two more calls (:func:`plan_step`, :func:`commit_step`) are a large part
    of it. tests/test_manager_speed_paths.py feeds the same calls to this
    path and the general one and compares every state, batch and error, and
    runs the state machines with this path off. Its batch carries the
    token's slot (``issue_token_batch``), so each layer's
    ``write`` copies the row without reading any array.
    """
    if window is not None:
        return None
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
    table = record.table
    num_tokens = table.num_tokens
    num_written = record.num_written
    if record.state is not RUNNING or num_written[-1] != num_tokens or (
        len(num_written) > 1 and min(num_written) != num_tokens
    ):
        return None
    if keyed and token_ids is None and record.token_ids is not None:
        return None
    allocator = pool.allocator
    if count > 1:
        step, _ = plan_step(table, count, allocator, None, {})
        if step[1] or step[2] > allocator.num_free_blocks:
            return None
        # ---- validated: nothing below can fail ----
        slot_mapping: list[SlotPiece] = []
        start = commit_step(record, count, None, None, step, pool, slot_mapping)
        record.reservation_id = stamp = next(_RESERVATION_IDS)
        record.batch = batch = issue_batch((seq_id,), (count,), (start,), slot_mapping, (stamp,))
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
    record.batch = batch = issue_token_batch(seq_id, num_tokens, block_id * bs + offset, stamp)
    return batch
