"""Preemption: taking a running sequence's blocks away (recompute or swap), and giving them back.

    recompute: RUNNING --preempt--> PREEMPTED (no blocks, tokens forgotten) --resume--> RUNNING,
               empty or holding the still-cached blocks of its own history (prefix caching)
    swap:      RUNNING --preempt--> SWAPPED (blocks copied to the host pool, a second KVPool
               of the same shape) --resume--> RUNNING, every token back in new device blocks

vLLM: the scheduler's ``_preempt_request`` and the v0 swapper. The manager validates
the id and holds the pool's lock; these functions change one record and the pools.
"""

from __future__ import annotations

from pagedkv.errors import ConfigError, InputTypeError, SequenceStateError
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.manager.sequence import SequenceRecord, SequenceState, check_settled
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import token_bytes

__all__ = [
    "PREEMPT_MODES",
    "check_host_pool",
    "host_pool_of",
    "preempt_record",
    "release_record",
    "resume_record",
    "swap_in",
    "swap_out",
]

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
        record.num_written = [0] * len(record.num_written)
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
    max_blocks: int | None = None,
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
    num_reused = sharing.share_cached_prefix(record, history, token_bytes(history), max_blocks)
    counters["resumed_reuse"] += num_reused
    return num_reused

# ------------------------------------------------------------------ swapping
#
# Swapping out copies every held block to fresh host blocks and gives the device
# blocks back; swapping in does the reverse. Block ids change, contents do not, so
# every later output is the same as if the sequence had never moved::
#
#     device  [4, 9, 2]  --swap_out-->  host [0, 1, 2]  --swap_in-->  device [7, 3, 5]


def check_host_pool(pool: KVPool, host_pool: object) -> KVPool:
    """Validate that ``host_pool`` is a pool shaped like ``pool``; return it.

    Raises:
        InputTypeError: not a KVPool.
        ConfigError: a size, the layer count or a dtype differs.
    """
    if not isinstance(host_pool, KVPool):
        raise InputTypeError(f"host_pool must be a KVPool, got {type(host_pool).__name__}")
    fields = ("block_size", "num_kv_heads", "head_dim", "num_layers", "dtype", "key_dtype", "value_dtype")
    for name in fields:
        if getattr(pool, name) != getattr(host_pool, name):
            raise ConfigError(
                f"host_pool.{name}={getattr(host_pool, name)} but the pool's is {getattr(pool, name)}"
            )
    return host_pool


def swap_out(record: SequenceRecord, device: KVPool, host: KVPool) -> None:
    """Move a running record's blocks to ``host``; it becomes SWAPPED.

    Raises:
        PoolExhaustedError: the host pool has too few free blocks; nothing changes.
    """
    _move(record, device, host, SequenceState.SWAPPED)


def swap_in(record: SequenceRecord, device: KVPool, host: KVPool) -> None:
    """Move a swapped record's blocks back to ``device``; it becomes RUNNING.

    Raises:
        PoolExhaustedError: the device pool has too few free blocks; nothing changes.
    """
    _move(record, host, device, SequenceState.RUNNING)


def _move(record: SequenceRecord, source: KVPool, target: KVPool, state: SequenceState) -> None:
    source_ids = record.table.block_ids
    target_ids = target.allocator.allocate(len(source_ids))  # all or nothing: may raise, nothing changed
    _copy_between(source, source_ids, target, target_ids)
    source.allocator.free(record.table.replace_all(target_ids))
    record.state = state


def _copy_between(source: KVPool, source_ids: list[int], target: KVPool, target_ids: list[int]) -> None:
    for layer in range(source.num_layers):
        target.keys(layer)[:, target_ids] = source.keys(layer)[:, source_ids]
        target.values(layer)[:, target_ids] = source.values(layer)[:, source_ids]
    source.copy_block_scales(source_ids, target_ids, target)
