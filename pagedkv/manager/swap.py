"""Swap preemption: a sequence's blocks copied between the device pool and a host pool.

The host pool is a second :class:`~pagedkv.KVPool` of the same shape (the
CPU-memory tier of a GPU engine). Swapping out copies every held block to
fresh host blocks and gives the device blocks back; swapping in does the
reverse. Block ids change, contents do not, so every later output is the
same as if the sequence had never moved::

    device  [4, 9, 2]  --swap_out-->  host [0, 1, 2]  --swap_in-->  device [7, 3, 5]
"""

from __future__ import annotations

from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.manager.sequence import SequenceRecord, SequenceState
from pagedkv.memory.pool import KVPool

__all__ = ["check_host_pool", "swap_in", "swap_out"]


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
