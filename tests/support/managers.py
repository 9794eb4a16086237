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


#: The ``KVPool`` keyword arguments (all but ``num_blocks``) of a test pool, unless a test says otherwise.
#: The device pool and the host pool of a manager always share them.
POOL_SHAPE: dict[str, Any] = {
    "block_size": 4,
    "num_kv_heads": 1,
    "head_dim": 1,
    "num_layers": 1,
    "dtype": np.float64,
    "key_dtype": None,
    "value_dtype": None,
}


def make_manager(num_blocks: int = 8, *, host_blocks: int = 0, **options: Any) -> KVCacheManager:
    """A manager over a fresh pool of ``num_blocks`` (and a host pool of ``host_blocks``, if any).

    ``options`` named in ``POOL_SHAPE`` shape both pools; the rest go to
    ``KVCacheManager`` as they are (``max_size``, ``num_q_heads``,
    ``enable_prefix_caching``, ...).
    """
    shape = {name: options.pop(name, default) for name, default in POOL_SHAPE.items()}
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


def pool_state(pool: KVPool | None, *, pages: bool = True) -> Any:
    """Everything observable about a pool: both free queues in order, ref counts, and (with
    ``pages``) every stored byte."""
    if pool is None:
        return None
    allocator = pool.allocator
    stored = []
    for layer in range(pool.num_layers if pages else 0):
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


def manager_state(manager: KVCacheManager, *, pages: bool = True) -> Any:
    """Everything observable about a manager, for "a refused call changed nothing" checks.

    Both pools (``pool_state``; ``pages=False`` leaves the stored bytes out),
    every sequence's state, block table, token count and window start, the
    prefix cache's key of every block, and the metrics.
    """
    tables = []
    for seq_id in manager.seq_ids:
        table = manager.block_table(seq_id)
        tables.append((seq_id, manager.state(seq_id), table.block_ids, table.num_tokens, table.window_start))
    prefix = manager.prefix_cache
    keys = None if prefix is None else [prefix.key_of(i) for i in range(manager.pool.num_blocks)]
    pools = pool_state(manager.pool, pages=pages), pool_state(manager.host_pool, pages=pages)
    return (*pools, tables, keys, manager.metrics())
