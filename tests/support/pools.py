"""A shared pool two block tables fill in turn, so the first table's blocks are never one run."""

from __future__ import annotations

import weakref

import numpy as np

from pagedkv import KVPool
from pagedkv.blocks.table import BlockTable

# The second table of each pool, alive as long as the pool: a pool holds its holders weakly.
_OTHERS: weakref.WeakKeyDictionary[KVPool, BlockTable] = weakref.WeakKeyDictionary()


def interleaved(
    key_dtype: str | None,
    num_tokens: int,
    block_size: int,
    head_dim: int,
    rng: np.random.Generator,
    view_mode: str = "auto",
    *,
    num_kv_heads: int = 2,
    value_dtype: str | None = None,
    key_scale: float = 3.0,
) -> tuple[KVPool, BlockTable, np.ndarray, np.ndarray]:
    """A float32 pool whose first of two tables takes every other block; that table, its keys and values.

    ``value_dtype`` None: the keys' storage. Keys are standard normal times
    ``key_scale``, values standard normal, written to layer 0.
    """
    value_dtype = key_dtype if value_dtype is None else value_dtype
    pool = KVPool(2 * (num_tokens // block_size + 1), block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=np.float32, key_dtype=key_dtype, value_dtype=value_dtype,
                  view_mode=view_mode)
    tables = [BlockTable(block_size), BlockTable(block_size)]
    while tables[0].num_tokens < num_tokens:
        for t in tables:
            t.append(min(block_size, num_tokens - t.num_tokens), [pool.allocator.allocate_one()])
    dense = []
    for t in tables:
        pool.attach(t)
        keys = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32) * key_scale
        values = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
        pool.write(0, t.slot_array(t.live_ranges()), keys, values)
        dense.append((keys, values))
    _OTHERS[pool] = tables[1]
    return pool, tables[0], *dense[0]
