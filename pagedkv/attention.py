"""The attention kernel: one query token against dense keys and values.

Every attend path in pagedkv (the paged cache, the manager, the no-cache
recompute in :mod:`pagedkv.reference`) ends in :func:`attend_dense`, so the
paged result and the from-scratch result are the same arithmetic on the same
numbers: equal bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "EINSUM_MIN_BYTES",
    "KEYS_FIRST_MIN_TOKENS",
    "attend_dense",
    "attend_dense_masked",
    "attend_padded",
    "softmax_rows",
]

#: Keys of at least this many bytes are attended with ``np.einsum`` instead of BLAS.
#:
#: NOTE: OpenBLAS's gemv streams keys slowly once they leave the cache, and
#: einsum wins on cold keys from about 1 MiB on (256 tokens at H=8, d=128,
#: float32) and on any keys from 8 MiB on; below 8 MiB, warm keys favour
#: BLAS (up to 2x at 1k tokens). The switch sits at 4 MiB (1k tokens of that
#: shape): a serving cache's keys are cold by the time their layer runs
#: again, and there einsum measured 1.2-1.3x faster over 64 sequences x 1024
#: tokens (``benchmarks/bench_views.py``, docs/paging.md). The figures of
#: the earlier 8 MiB switch are in ``benchmarks/bench_layout.py``. The choice
#: depends only on the shape and dtype, so the paged path and the no-cache
#: recompute always run the same arithmetic and stay equal bit for bit.
EINSUM_MIN_BYTES = 1 << 22

#: From this many tokens on, grouped queries (several per kv head) score as ``K @ q^T``.
#:
#: NOTE: ``q @ K^T`` hands OpenBLAS a transposed, strided B; from a few
#: hundred tokens on its packing costs 4-6x the ``K @ q^T`` product, which
#: reads each head's keys as the rows they are (H=4, group 2, d=64, float32:
#: 182 vs 39 us at 1,000 tokens, 8 vs 12 us at 256; issue 14's medium model,
#: ``benchmarks/bench_transformers.py``). Like ``EINSUM_MIN_BYTES`` it depends
#: only on the shape, so every path rounds alike.
KEYS_FIRST_MIN_TOKENS = 512


def softmax_rows(
    scores: npt.NDArray[np.floating],
    scale: float = 1.0,
    visible: npt.NDArray[np.bool_] | None = None,
) -> npt.NDArray[np.floating]:
    """Softmax along the last axis of ``scale * scores``, in place where it can be.

    Every kernel ends its scores here, so they all round the same way: scale,
    mask (hidden scores become -inf, weight exactly 0), subtract the row
    maximum (so exp() stays finite for scores of any size), exp, normalize.

    Args:
        scores: raw scores; overwritten unless ``visible`` is given.
        scale: multiplies every score first.
        visible: booleans broadcastable to ``scores``; False hides a score.

    Returns:
        The weights (``scores`` itself when no mask was given).

    >>> softmax_rows(np.array([[0.0, 0.0]])).tolist()
    [[0.5, 0.5]]
    """
    if scale != 1.0:
        scores *= scale
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


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
            ``(num_tokens, head_dim)`` plane must have unit stride along
            head_dim. The result depends on the strides as well as the
            numbers: pagedkv passes token-major arrays transposed
            (``(num_tokens, H, d)`` contiguous, ``.transpose(1, 0, 2)``) on
            every path, the no-cache recompute included.
        values: same shape as ``keys``.
        scale: multiplies every score before the softmax.

    Returns:
        A new ``(num_q_heads, head_dim)`` array.

    >>> q = np.array([[1.0]]); k = np.array([[[1.0]]]); v = np.array([[[42.0]]])
    >>> attend_dense(q, k, v)
    array([[42.]])
    """
    num_kv_heads, num_tokens, head_dim = keys.shape
    group = query.shape[0] // num_kv_heads
    grouped = query.reshape(num_kv_heads, group, head_dim)
    # NOTE: einsum only for one query head per kv head: over token-major keys
    # (the pool's layout) einsum with several rows per head was 1.4-7x slower
    # than BLAS, which takes the strided heads as they are (docs/paging.md).
    large = group == 1 and num_tokens * num_kv_heads * head_dim * keys.dtype.itemsize >= EINSUM_MIN_BYTES
    if large:
        scores = np.einsum("hgd,hnd->hgn", grouped, keys)  # (num_kv_heads, group, num_tokens)
        if scores.flags.c_contiguous:
            scores = softmax_rows(scores, scale)
        else:
            # NOTE: einsum lays its result out in the keys' memory order: over
            # token-major keys one head's scores sit 4 * H bytes apart, and
            # softmax's max and sum along them cost 0.97 ms where contiguous
            # rows cost 0.17 (16k tokens, H=8: 13% of the kernel). So the
            # softmax runs on contiguous rows, as for head-major keys, and the
            # weights go back into the keys' order, in which the values einsum
            # streams the values (over contiguous weights it ran 7x slower).
            # Every path passes token-major keys, so all of them take this
            # branch and stay equal bit for bit (tests/test_attention.py).
            scores[...] = softmax_rows(np.ascontiguousarray(scores), scale)
        out = np.einsum("hgn,hnd->hgd", scores, values)  # (num_kv_heads, group, head_dim)
    else:
        if group > 1 and num_tokens >= KEYS_FIRST_MIN_TOKENS:
            # (num_kv_heads, num_tokens, group), made (num_kv_heads, group, num_tokens) and contiguous
            by_token = np.matmul(keys, np.ascontiguousarray(grouped.transpose(0, 2, 1)))
            scores = by_token.transpose(0, 2, 1).copy()
        else:
            scores = np.matmul(grouped, keys.transpose(0, 2, 1))
        out = np.matmul(softmax_rows(scores, scale), values)
    result: npt.NDArray[np.floating] = out.reshape(query.shape)
    return result


def attend_dense_masked(
    queries: npt.NDArray[np.floating],
    keys: npt.NDArray[np.floating],
    values: npt.NDArray[np.floating],
    visible: npt.NDArray[np.bool_],
    scale: float = 1.0,
) -> npt.NDArray[np.floating]:
    """Many query tokens at once, each over the keys its row of ``visible`` allows.

    Used for chunked prefill: query ``t`` sees key ``j`` iff ``visible[t, j]``
    (causal order, a sliding window and sinks all become this mask). Masked
    keys get weight exactly zero. Every row must see at least one key.

    NOTE: the masked softmax sums over every key, zeros included, so its
    rounding can differ from :func:`attend_dense` over only the visible keys;
    the two agree within the tolerance documented in ``docs/design.md``.

    Args:
        queries: ``(num_queries, num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_tokens, head_dim)``.
        values: same shape as ``keys``.
        visible: ``(num_queries, num_tokens)`` booleans.
        scale: multiplies every score before the softmax.

    Returns:
        A new ``(num_queries, num_q_heads, head_dim)`` array.
    """
    num_queries, num_q_heads, head_dim = queries.shape
    num_kv_heads, num_tokens, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # (num_kv_heads, num_queries * group, head_dim): query heads grouped by the kv head they read
    grouped = queries.reshape(num_queries, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    grouped = grouped.reshape(num_kv_heads, num_queries * group, head_dim)
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # (num_kv_heads, num_queries * group, num_tokens)
    scores = scores.reshape(num_kv_heads, num_queries, group, num_tokens)
    scores = softmax_rows(scores, scale, visible[None, :, None, :])
    weights = scores.reshape(num_kv_heads, num_queries * group, num_tokens)
    # NOTE: OpenBLAS's small-N kernels (head_dim 1-8 here) can raise the FPU's
    # invalid flag on lanes they load past a row and drop, so numpy warned
    # "invalid value encountered in matmul" once in CI for finite inputs (a
    # 5-token prefill at head_dim 1). The inputs are checked finite and masked
    # weights are exact zeros, so no real NaN can arise here; an overflow is
    # still reported. (numpy/OpenBLAS discuss silencing FE_INVALID the same way.)
    with np.errstate(invalid="ignore"):
        out = np.matmul(weights, values)  # (num_kv_heads, num_queries * group, head_dim)
    out = out.reshape(num_kv_heads, num_queries, group, head_dim).transpose(1, 0, 2, 3)
    result: npt.NDArray[np.floating] = out.reshape(num_queries, num_q_heads, head_dim)
    return result


def attend_padded(
    queries: npt.NDArray[np.floating],
    keys: npt.NDArray[np.floating],
    values: npt.NDArray[np.floating],
    lengths: npt.NDArray[np.intp],
    scale: float = 1.0,
) -> npt.NDArray[np.floating]:
    """One decode token for each of many sequences, padded to the longest, in one call.

    Sequence ``b`` attends to its first ``lengths[b]`` keys; padding gets
    weight exactly zero. Equal to :func:`attend_dense` per sequence within
    the documented tolerance (the padded sums round differently).

    Args:
        queries: ``(num_seqs, num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_seqs, max_len, head_dim)``.
        values: same shape as ``keys``.
        lengths: ``(num_seqs,)`` real keys per sequence, each >= 1.
        scale: multiplies every score before the softmax.

    Returns:
        A new ``(num_seqs, num_q_heads, head_dim)`` array.
    """
    num_seqs, num_q_heads, head_dim = queries.shape
    num_kv_heads, _, max_len, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # (num_kv_heads, num_seqs, group, head_dim)
    grouped = queries.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    scores = np.matmul(grouped, keys.transpose(0, 1, 3, 2))  # (num_kv_heads, num_seqs, group, max_len)
    real = np.arange(max_len)[None, :] < lengths[:, None]  # (num_seqs, max_len)
    scores = softmax_rows(scores, scale, real[None, :, None, :])
    out = np.matmul(scores, values)  # (num_kv_heads, num_seqs, group, head_dim)
    result: npt.NDArray[np.floating] = out.transpose(1, 0, 2, 3).reshape(num_seqs, num_q_heads, head_dim)
    return result
