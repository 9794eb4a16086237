"""Pools and managers built one way for every test module, and what "nothing changed" compares.

Defaults are the smallest useful shape (one layer, one kv head, ``head_dim`` 1,
blocks of 4); a module that needs another shape passes it, or fixes its own
defaults with ``functools.partial(make_manager, ...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv import Batch, KVCacheManager, KVPool


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints: the blocks ``a`` tokens fill at ``b`` a block.

    >>> ceil_div(5, 4), ceil_div(8, 4), ceil_div(0, 4)
    (2, 2, 0)
    """
    return -(-a // b)


def pool_shape(
    *,
    block_size: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 1,
    num_layers: int = 1,
    dtype: Any = np.float64,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``KVPool`` keyword arguments (everything but ``num_blocks``) of a test pool.

    The device pool and the host pool of a manager must have the same shape, so
    both are built from one of these.
    """
    return {
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_layers": num_layers,
        "dtype": dtype,
        "key_dtype": key_dtype,
        "value_dtype": value_dtype,
    }


def make_manager(
    num_blocks: int = 8,
    *,
    host_blocks: int = 0,
    block_size: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 1,
    num_layers: int = 1,
    dtype: Any = np.float64,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
    **options: Any,
) -> KVCacheManager:
    """A manager over a fresh pool of ``num_blocks`` (and a host pool of ``host_blocks``, if any).

    ``options`` go to ``KVCacheManager`` as they are (``max_size``,
    ``num_q_heads``, ``enable_prefix_caching``, ...).
    """
    shape = pool_shape(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
        dtype=dtype,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
    )
    host_pool = KVPool(host_blocks, **shape) if host_blocks else None
    return KVCacheManager(KVPool(num_blocks, **shape), host_pool=host_pool, **options)


def settle(manager: KVCacheManager, request: Mapping[Any, int], value: float = 1.0) -> Batch:
    """Reserve ``request`` and write k = v = ``value`` for it in every layer (no attend)."""
    batch = manager.reserve(request)
    pool = manager.pool
    kv = np.full((batch.num_tokens, pool.num_kv_heads, pool.head_dim), value)
    for layer in range(pool.num_layers):
        manager.write(layer, batch, kv, kv)
    return batch


def pool_state(pool: KVPool | None) -> Any:
    """Everything observable about a pool: both free queues in order, ref counts, every byte."""
    if pool is None:
        return None
    allocator = pool.allocator
    stored = []
    for layer in range(pool.num_layers):
        stored.append(pool.keys(layer).tobytes() + pool.values(layer).tobytes())
        if pool.key_dtype is not None:
            stored.append(pool.key_scales(layer).tobytes())
        if pool.value_dtype is not None:
            stored.append(pool.value_scales(layer).tobytes())
    return (
        allocator.free_block_ids(),
        allocator.cached_free_block_ids(),
        [allocator.ref_count(block_id) for block_id in range(allocator.num_blocks)],
        stored,
    )


def manager_state(manager: KVCacheManager) -> Any:
    """Everything observable about a manager, for "a refused call changed nothing" checks.

    Both pools (``pool_state``), every sequence's state, block table, token
    count and window start, the prefix cache's key of every block, and the
    metrics.
    """
    tables = []
    for seq_id in manager.seq_ids:
        table = manager.block_table(seq_id)
        tables.append((seq_id, manager.state(seq_id), table.block_ids, table.num_tokens, table.window_start))
    prefix = manager.prefix_cache
    keys = None if prefix is None else [prefix.key_of(i) for i in range(manager.pool.num_blocks)]
    return pool_state(manager.pool), pool_state(manager.host_pool), tables, keys, manager.metrics()
