"""Preemption: taking a running sequence's blocks away, and giving them back.

Two ways, as vLLM offers them::

    recompute: RUNNING --preempt--> PREEMPTED (no blocks, tokens forgotten)
               --resume--> RUNNING, empty, or holding the still-cached blocks of
               its own history when prefix caching is on (the caller re-feeds the rest)
    swap:      RUNNING --preempt--> SWAPPED (blocks copied to the host pool)
               --resume--> RUNNING with every token back, in new device blocks

The manager validates the sequence id and holds the pool's lock; these
functions change one record and the pools.
"""

from __future__ import annotations

from pagedkv.errors import ConfigError, SequenceStateError
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.manager.sequence import SequenceRecord, SequenceState, check_settled
from pagedkv.manager.swap import swap_in, swap_out
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import token_bytes

__all__ = ["PREEMPT_MODES", "host_pool_of", "preempt_record", "release_record", "resume_record"]

#: The ways ``preempt`` can take a sequence's blocks away.
PREEMPT_MODES = ("recompute", "swap")


def host_pool_of(host_pool: KVPool | None) -> KVPool:
    """``host_pool``, or a ConfigError saying swap needs one."""
    if host_pool is None:
        raise ConfigError("swap needs a host pool: KVCacheManager(..., host_pool=KVPool(...))")
    return host_pool


def release_record(record: SequenceRecord, pool: KVPool, host_pool: KVPool | None) -> None:
    """Give every block ``record`` holds back to the pool its state says it is in, tail first."""
    released = record.table.clear()
    if record.state is SequenceState.RUNNING:
        pool.allocator.free(released)
    elif record.state is SequenceState.SWAPPED:
        host = host_pool_of(host_pool)
        with host.lock:
            host.allocator.free(released)


def preempt_record(
    record: SequenceRecord, mode: str, pool: KVPool, host_pool: KVPool | None, counters: dict[str, int]
) -> None:
    """Preempt running ``record`` by ``mode`` (``"recompute"`` or ``"swap"``), all or nothing.

    Raises:
        ConfigError: an unknown mode, or swap without a host pool.
        SequenceStateError: not running, or (swap) with unwritten layers.
        PoolExhaustedError: (swap) the host pool is full.
    """
    if mode not in PREEMPT_MODES:
        raise ConfigError(f"mode must be 'recompute' or 'swap', got {mode!r}")
    if record.state is not SequenceState.RUNNING:
        raise SequenceStateError(f"sequence {record.seq_id!r} is {record.state.value}, not running")
    if mode == "recompute":
        release_record(record, pool, host_pool)
        record.state = SequenceState.PREEMPTED
        record.num_written = [0] * pool.num_layers
    else:
        host = host_pool_of(host_pool)
        check_settled(record, "swap out")
        with host.lock:
            swap_out(record, pool, host)
        counters["swaps_out"] += 1
    record.reservation_id = 0
    record.batch = None
    counters["preemptions"] += 1


def resume_record(
    record: SequenceRecord,
    pool: KVPool,
    host_pool: KVPool | None,
    sharing: PrefixSharing | None,
    counters: dict[str, int],
) -> int:
    """Bring preempted or swapped ``record`` back to running; return the tokens it holds again.

    Raises:
        SequenceStateError: it is running already.
        PoolExhaustedError: (swapped) not enough free device blocks; nothing changes.
    """
    if record.state is SequenceState.RUNNING:
        raise SequenceStateError(f"sequence {record.seq_id!r} is running; only preempted ones resume")
    if record.state is SequenceState.SWAPPED:
        host = host_pool_of(host_pool)
        with host.lock:
            swap_in(record, pool, host)
        counters["swaps_in"] += 1
        if sharing is not None:
            sharing.rekey_restored(record)
        return record.table.num_tokens
    record.state = SequenceState.RUNNING
    if sharing is None or not record.token_ids:
        record.token_ids = None if record.token_ids is None else []
        record.block_keys = []
        return 0
    history = record.token_ids
    record.token_ids = []
    # Its block and prompt keys are keys of the history's blocks: the lookup reuses them.
    num_reused = sharing.share_cached_prefix(record, history, token_bytes(history))
    counters["resumed_reuse"] += num_reused
    return num_reused
