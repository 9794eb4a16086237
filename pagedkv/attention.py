"""The attention kernel: one query token against dense keys and values.

Every attend path in pagedkv (the paged cache, the manager, the no-cache
recompute in :mod:`pagedkv.reference`) ends in :func:`attend_dense`, so the
paged result and the from-scratch result are the same arithmetic on the same
numbers: equal bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["attend_dense", "attend_dense_causal"]


def attend_dense(
    query: npt.NDArray[np.floating],
    keys: npt.NDArray[np.floating],
    values: npt.NDArray[np.floating],
    scale: float = 1.0,
) -> npt.NDArray[np.floating]:
    """``softmax(scale * K q) . V`` for every query head, grouped-query aware.

    Query head ``h`` reads key/value head ``h // (num_q_heads // num_kv_heads)``.

    Args:
        query: ``(num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_tokens, head_dim)``; each head's
            ``(num_tokens, head_dim)`` plane must have unit stride along head_dim.
        values: same shape as ``keys``.
        scale: multiplies every score before the softmax.

    Returns:
        A new ``(num_q_heads, head_dim)`` array.

    >>> q = np.array([[1.0]]); k = np.array([[[1.0]]]); v = np.array([[[42.0]]])
    >>> attend_dense(q, k, v)
    array([[42.]])
    """
    num_kv_heads, _, head_dim = keys.shape
    group = query.shape[0] // num_kv_heads
    grouped = query.reshape(num_kv_heads, group, head_dim)
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # (num_kv_heads, group, num_tokens)
    if scale != 1.0:
        scores *= scale
    # Subtracting the row maximum keeps exp() finite for scores of any size.
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, values)  # (num_kv_heads, group, head_dim)
    result: npt.NDArray[np.floating] = out.reshape(query.shape)
    return result


def attend_dense_causal(
    queries: npt.NDArray[np.floating],
    keys: npt.NDArray[np.floating],
    values: npt.NDArray[np.floating],
    first_positions: npt.NDArray[np.intp],
    scale: float = 1.0,
) -> npt.NDArray[np.floating]:
    """Many query tokens at once, each over its own prefix of the keys.

    Query token ``t`` attends to key indices ``first_positions[t] .. num_queries_end``
    where the end is ``num_tokens - num_queries + t + 1`` (the causal rule:
    the last query is the newest key). Masked keys get weight exactly zero.

    Args:
        queries: ``(num_queries, num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_tokens, head_dim)``.
        values: same shape as ``keys``.
        first_positions: ``(num_queries,)`` first key index each query may see
            (a sliding window); zero for plain causal attention.
        scale: multiplies every score before the softmax.

    Returns:
        A new ``(num_queries, num_q_heads, head_dim)`` array.
    """
    num_queries, num_q_heads, head_dim = queries.shape
    num_kv_heads, num_tokens, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # (num_kv_heads, num_queries * group, head_dim)
    grouped = queries.reshape(num_queries, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    grouped = grouped.reshape(num_kv_heads, num_queries * group, head_dim)
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # (num_kv_heads, num_queries*group, num_tokens)
    scores = scores.reshape(num_kv_heads, num_queries, group, num_tokens)
    if scale != 1.0:
        scores *= scale
    key_index = np.arange(num_tokens)
    last = num_tokens - num_queries + np.arange(num_queries)  # (num_queries,)
    visible = (key_index[None, :] <= last[:, None]) & (key_index[None, :] >= first_positions[:, None])
    scores = np.where(visible[None, :, None, :], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    scores = scores.reshape(num_kv_heads, num_queries * group, num_tokens)
    out = np.matmul(scores, values)  # (num_kv_heads, num_queries*group, head_dim)
    out = out.reshape(num_kv_heads, num_queries, group, head_dim).transpose(1, 0, 2, 3)
    result: npt.NDArray[np.floating] = out.reshape(num_queries, num_q_heads, head_dim)
    return result
