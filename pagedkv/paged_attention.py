"""Attention over block tables: which tokens a query sees, and gathering them.

The manager's ``attend`` calls these per layer. A token at logical index ``p``
of a sequence with ``S`` sink tokens, in a layer with window ``W``, sees::

    sinks 0 .. S-1   and   max(S, p - W + 1) .. p        (W None: S .. p)

    S = 2, W = 3, p = 9:   [0 1] 2 3 4 5 6 [7 8 9]

A single new token (decode) runs :func:`~pagedkv.attention.attend_dense` on
exactly the tokens it sees, read by :meth:`~pagedkv.memory.pool.KVPool.read` as a
token-major ``(num_tokens, num_kv_heads, head_dim)`` array (a mapped view, a
run of the storage, or a gather: the same numbers and strides each way), bit
for bit what the no-cache recompute computes;
several new tokens (a prefill chunk) run the masked kernel over what the
table holds. A quantized pool runs the chunked kernels of
:mod:`pagedkv.memory.quantization` the same way, on the codes as stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.attention import attend_dense, attend_dense_masked, attend_padded
from pagedkv.blocks.read_plan import ReadPlan
from pagedkv.blocks.table import BlockTable
from pagedkv.memory.pool import KVPool
from pagedkv.memory.quantization import attend_chunked, attend_chunked_masked

__all__ = ["attend_batch", "attend_decode_padded", "attend_sequence", "visible_ranges"]


def visible_ranges(num_sink_tokens: int, window: int | None, position: int) -> list[tuple[int, int]]:
    """Logical index ranges ``[start, end)`` the token at ``position`` attends to.

    >>> visible_ranges(2, 3, 9)
    [(0, 2), (7, 10)]
    >>> visible_ranges(0, None, 4)
    [(0, 5)]
    """
    if window is None and not num_sink_tokens and position >= 0:  # the common case, at once
        return [(0, position + 1)]
    sinks = min(num_sink_tokens, position + 1)
    start = sinks if window is None else max(sinks, position + 1 - window)
    ranges = [(0, sinks)] if sinks else []
    if position + 1 > start:
        ranges.append((start, position + 1))
    return ranges


def attend_sequence(
    pool: KVPool,
    layer: int,
    table: BlockTable,
    window: int | None,
    queries: npt.NDArray[Any],
    scale: float,
) -> npt.NDArray[Any]:
    """Attention of a sequence's newest ``len(queries)`` tokens over its own tokens.

    Args:
        pool: the pool holding the table's blocks.
        layer: the layer whose storage to read.
        table: the sequence's block table; the queries are its newest tokens.
        window: the layer's window, or None.
        queries: ``(num_new_tokens, num_q_heads, head_dim)``.
        scale: multiplies every score.

    Returns:
        A new ``(num_new_tokens, num_q_heads, head_dim)`` array.
    """
    last = table.num_tokens - 1
    # A quantized pool gathers codes and scales and runs the chunked kernels;
    # everything else (which tokens, which mask) is the same.
    quantized = pool.quantized
    if len(queries) == 1:
        ranges = visible_ranges(table.num_sink_tokens, window, last)
        if quantized:
            key_codes, value_codes = pool.gather_quantized(layer, table.read_plan(ranges))
            return attend_chunked(queries[0], key_codes, value_codes, scale, pool.dtype)[None]
        keys, values = pool.read(layer, table, ranges)  # (num_visible, num_kv_heads, head_dim)
        return attend_dense(queries[0], keys.transpose(1, 0, 2), values.transpose(1, 0, 2), scale)[None]
    held = table.live_ranges()
    mask = _prefill_mask(table, held, window, len(queries))
    if quantized:
        key_codes, value_codes = pool.gather_quantized(layer, table.read_plan(held))
        return attend_chunked_masked(queries, key_codes, value_codes, mask, scale, pool.dtype)
    keys, values = pool.read(layer, table, held)  # (num_held, num_kv_heads, head_dim)
    return attend_dense_masked(queries, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), mask, scale)


def _prefill_mask(
    table: BlockTable, held: list[tuple[int, int]], window: int | None, num_queries: int
) -> npt.NDArray[np.bool_]:
    """``(num_queries, num_held)``: which held token each of the newest queries sees."""
    last = table.num_tokens - 1
    positions = np.concatenate([np.arange(start, end) for start, end in held])
    query_positions = np.arange(last + 1 - num_queries, last + 1)
    mask = positions[None, :] <= query_positions[:, None]
    if window is not None:
        in_window = positions[None, :] > query_positions[:, None] - window
        mask &= in_window | (positions[None, :] < table.num_sink_tokens)
    result: npt.NDArray[np.bool_] = mask
    return result


def attend_decode_padded(
    pool: KVPool,
    layer: int,
    tables: list[BlockTable],
    window: int | None,
    queries: npt.NDArray[Any],
    scale: float,
) -> npt.NDArray[Any]:
    """One new token per table, all sequences in one padded kernel call.

    Args:
        pool: the pool holding the tables' blocks.
        layer: the layer whose storage to read.
        tables: one block table per query, each ending in its query's token.
        window: the layer's window, or None.
        queries: ``(len(tables), num_q_heads, head_dim)``.
        scale: multiplies every score.

    Returns:
        A new ``(len(tables), num_q_heads, head_dim)`` array.
    """
    if pool.quantized:
        # NOTE: no padded kernel for quantized pages: one chunked call per
        # sequence, equal bit for bit to method="loop".
        outputs = [
            attend_sequence(pool, layer, table, window, queries[row : row + 1], scale)
            for row, table in enumerate(tables)
        ]
        return np.concatenate(outputs)
    slot_lists = [
        table.slot_array(visible_ranges(table.num_sink_tokens, window, table.num_tokens - 1))
        for table in tables
    ]
    lengths = np.array([len(slots) for slots in slot_lists])
    width = int(lengths.max())
    padded = np.zeros((len(tables), width), np.intp)
    for row, slots in enumerate(slot_lists):
        padded[row, : len(slots)] = slots
    keys, values = pool.read_gathered(layer, ReadPlan(padded.size, slots=padded.ravel()), len(tables))
    shape = (len(tables), width, pool.num_kv_heads, pool.head_dim)
    # (num_kv_heads, num_seqs, width, head_dim) views of the token-major gather
    key_heads = keys.reshape(shape).transpose(2, 0, 1, 3)
    value_heads = values.reshape(shape).transpose(2, 0, 1, 3)
    return attend_padded(queries, key_heads, value_heads, lengths, scale)


def attend_batch(
    pool: KVPool,
    layer: int,
    tables: list[BlockTable],
    query_start: npt.NDArray[np.int64],
    window: int | None,
    queries: npt.NDArray[Any],
    scale: float,
    method: str = "loop",
) -> npt.NDArray[Any]:
    """Attention of a batch's new tokens, each sequence over its own table.

    Args:
        pool: the pool holding the tables' blocks.
        layer: the layer whose storage to read.
        tables: one table per sequence, in batch order.
        query_start: ``(len(tables) + 1,)`` offsets of each sequence's queries.
        window: the layer's window, or None.
        queries: ``(num_tokens, num_q_heads, head_dim)``.
        scale: multiplies every score.
        method: ``"loop"`` (one ``attend_sequence`` per table) or ``"padded"``
            (one ``attend_decode_padded`` call when every sequence has one new token).

    Returns:
        A new ``(num_tokens, num_q_heads, head_dim)`` array.
    """
    if method == "padded" and len(queries) == len(tables):
        return attend_decode_padded(pool, layer, tables, window, queries, scale)
    out = np.empty_like(queries)
    for table, lo, hi in zip(tables, query_start[:-1], query_start[1:]):
        out[lo:hi] = attend_sequence(pool, layer, table, window, queries[lo:hi], scale)
    return out
