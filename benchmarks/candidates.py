"""Candidate kernels measured by the benchmarks; none of them is used by the library.

* :func:`attend_per_head` — a candidate for the fragmented path of
  ``KVPool.gather``: instead of gathering every head of every block into one
  ``(num_kv_heads, num_tokens, head_dim)`` scratch array (64 MiB of keys and
  values at 16k tokens, H=8, d=128, float32) and then reading it all back,
  gather one kv head at a time into a buffer 1/num_kv_heads that size, which
  stays in cache while :func:`pagedkv.attention.attend_dense` reads it.
  Per head it runs exactly the calls ``attend_dense`` runs for that head (the
  batched matmul is a loop over heads with the same BLAS call per head), so
  its output equals ``pagedkv.reference.attend_window`` bit for bit;
  :func:`check_bit_exact` proves that on random configurations.
* :func:`attend_per_head_staged` — the same, but only one buffer: gather the
  keys of head h, score them, then gather the values of head h into the same
  buffer. It repeats ``attend_dense``'s arithmetic step by step, so it stays
  bit-exact only while it mirrors that kernel.
* :func:`attend_einsum` — the same attention written with ``numpy.einsum``
  instead of matmul (BLAS gemv). Not bit-identical to ``attend_dense``
  (another summation order), so it can stand in only as a *contiguous*
  kernel, or replace ``attend_dense`` everywhere at once.

Chunking along tokens is *not* a candidate: the score of a key computed by a
gemv over a chunk of the keys differs in the last bit from the same score in a
gemv over all of them (about 70% of random shapes), so it would break the
bit-exact contract.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from pagedkv import KVCache, KVPool
from pagedkv.attention import attend_dense
from pagedkv.blocks.table import BlockTable
from pagedkv.reference import attend_window

__all__ = ["attend_einsum", "attend_per_head", "attend_per_head_staged", "check_bit_exact"]

FloatArray = npt.NDArray[np.floating]

_buffers: dict[str, FloatArray] = {}


def _buffer(name: str, shape: tuple[int, int, int], dtype: np.dtype[np.floating]) -> FloatArray:
    """A reusable buffer, like the pool's scratch (grown, never shrunk)."""
    size = shape[0] * shape[1] * shape[2]
    key = name + dtype.str
    held = _buffers.get(key)
    if held is None or held.size < size:
        held = np.empty(size, dtype)
        _buffers[key] = held
    return held[:size].reshape(shape)


def _window(pool: KVPool, table: BlockTable) -> tuple[npt.NDArray[np.intp], int, int]:
    """Block ids, offset of the first held token in the first block, and token count."""
    plan = table.read_plan()
    if plan.slots is not None:
        raise NotImplementedError("the candidates cover tables without attention sinks")
    return np.array(plan.block_ids, np.intp), plan.offset, plan.num_tokens


def attend_per_head(
    pool: KVPool,
    table: BlockTable,
    query: FloatArray,
    scale: float = 1.0,
    layer: int = 0,
    kernel: Callable[..., FloatArray] = attend_dense,
) -> FloatArray:
    """``attend_dense(query, *pool.gather(layer, table))``, gathering one kv head at a time.

    Args:
        pool: the pool holding the table's blocks.
        table: any block table without sinks (one run or not).
        query: ``(num_q_heads, head_dim)``.
        scale: the softmax scale.
        layer: which layer's storage to read.
        kernel: the attention run per head (``attend_einsum`` to see what the
            two changes give together; only ``attend_dense`` is bit-exact).

    Returns:
        A new ``(num_q_heads, head_dim)`` array, equal bit for bit to the whole-table path.
    """
    keys, values = pool.keys(layer), pool.values(layer)
    block_ids, offset, num_tokens = _window(pool, table)
    num_kv_heads, head_dim, block_size = pool.num_kv_heads, pool.head_dim, pool.block_size
    group = query.shape[0] // num_kv_heads
    shape = (len(block_ids), block_size, head_dim)
    key_buffer = _buffer("k", shape, pool.dtype)  # (num_held_blocks, block_size, head_dim)
    value_buffer = _buffer("v", shape, pool.dtype)
    flat = (1, len(block_ids) * block_size, head_dim)
    out = np.empty(query.shape, pool.dtype)
    for head in range(num_kv_heads):
        np.take(keys[head], block_ids, axis=0, out=key_buffer, mode="clip")
        np.take(values[head], block_ids, axis=0, out=value_buffer, mode="clip")
        head_keys = key_buffer.reshape(flat)[:, offset : offset + num_tokens]  # (1, n, d)
        head_values = value_buffer.reshape(flat)[:, offset : offset + num_tokens]
        rows = slice(head * group, (head + 1) * group)
        out[rows] = kernel(query[rows], head_keys, head_values, scale)
    return out


def attend_per_head_staged(
    pool: KVPool, table: BlockTable, query: FloatArray, scale: float = 1.0, layer: int = 0
) -> FloatArray:
    """Like :func:`attend_per_head` with one buffer: keys of head h, scores, then its values."""
    keys, values = pool.keys(layer), pool.values(layer)
    block_ids, offset, num_tokens = _window(pool, table)
    num_kv_heads, head_dim, block_size = pool.num_kv_heads, pool.head_dim, pool.block_size
    group = query.shape[0] // num_kv_heads
    buffer = _buffer("kv", (len(block_ids), block_size, head_dim), pool.dtype)
    flat = (1, len(block_ids) * block_size, head_dim)
    out = np.empty(query.shape, pool.dtype)
    for head in range(num_kv_heads):
        rows = slice(head * group, (head + 1) * group)
        np.take(keys[head], block_ids, axis=0, out=buffer, mode="clip")
        head_keys = buffer.reshape(flat)[:, offset : offset + num_tokens]  # (1, n, d)
        # The steps of attend_dense, for one kv head: (1, group, num_tokens)
        scores = np.matmul(query[rows].reshape(1, group, head_dim), head_keys.transpose(0, 2, 1))
        if scale != 1.0:
            scores *= scale
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        np.take(values[head], block_ids, axis=0, out=buffer, mode="clip")
        head_values = buffer.reshape(flat)[:, offset : offset + num_tokens]
        out[rows] = np.matmul(scores, head_values).reshape(group, head_dim)
    return out


def attend_einsum(
    query: FloatArray, keys: FloatArray, values: FloatArray, scale: float = 1.0
) -> FloatArray:
    """``attend_dense``'s attention with numpy.einsum in place of matmul (not bit-identical).

    Args:
        query: ``(num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_tokens, head_dim)``, any strides.
        values: same shape as ``keys``.
        scale: multiplies every score.
    """
    num_kv_heads, _, head_dim = keys.shape
    group = query.shape[0] // num_kv_heads
    grouped = query.reshape(num_kv_heads, group, head_dim)
    scores = np.einsum("hgd,htd->hgt", grouped, keys)  # (num_kv_heads, group, num_tokens)
    if scale != 1.0:
        scores *= scale
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.einsum("hgt,htd->hgd", scores, values)  # (num_kv_heads, group, head_dim)
    return out.reshape(query.shape)


def check_bit_exact(num_trials: int = 200, seed: int = 0) -> tuple[int, int, int]:
    """Run both per-head candidates on random fragmented caches against ``attend_window``.

    Each trial: two caches share a pool and take turns, so neither table is
    one run; sizes, head counts (one head, many, grouped-query), head_dim,
    block_size, window, dtype and scale are drawn at random. The candidates
    read the first cache's table after its ``attend`` and must equal, bit for
    bit, both that attend's output and ``attend_window`` over its window.

    Returns:
        ``(num_trials, num_fragmented, num_mismatches)``: ``num_fragmented``
        counts the trials whose table was not one run (the path in question).
    """
    rng = np.random.default_rng(seed)
    num_bad = num_fragmented = 0
    for trial in range(num_trials):
        num_kv_heads = int(rng.integers(1, 5))
        num_q_heads = num_kv_heads * int(rng.integers(1, 4))
        head_dim = int(rng.choice([1, 3, 8, 64, 128]))
        block_size = int(rng.integers(1, 33))
        num_steps = int(rng.integers(1, 400))
        max_size = None if trial % 3 == 0 else int(rng.integers(1, 300))
        dtype = np.float32 if trial % 2 else np.float64
        scale = float(rng.choice([1.0, 1.0 / np.sqrt(head_dim), 0.37]))
        num_blocks = 2 * (num_steps // block_size + 2)
        pool = KVPool(num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype=dtype)
        cache = KVCache(max_size, pool=pool, scale=scale)
        other = KVCache(max_size, pool=pool, scale=scale)
        tokens = rng.standard_normal((num_steps, 3, num_q_heads, head_dim)).astype(dtype)
        history_k, history_v = [], []
        for step in range(num_steps):
            q = tokens[step, 0]
            k, v = tokens[step, 1, :num_kv_heads], tokens[step, 2, :num_kv_heads]
            other.attend(q, k, v)
            got = cache.attend(q, k, v)
            history_k.append(k)
            history_v.append(v)
        start = 0 if max_size is None else max(0, num_steps - max_size)
        expected = attend_window(q, history_k[start:], history_v[start:], scale=scale, dtype=dtype)
        table = cache.block_table
        num_fragmented += not table.is_one_run
        for candidate in (attend_per_head, attend_per_head_staged):
            result = candidate(pool, table, q, scale)
            if not (np.array_equal(result, expected) and np.array_equal(got, expected)):
                num_bad += 1
        cache.close()
        other.close()
    return num_trials, num_fragmented, num_bad
