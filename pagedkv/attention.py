"""Attention: the kernels, and the walk over block tables that feeds them.

The float kernels (:func:`attend_dense`, masked and padded forms), the chunked kernels that
read quantized pages as stored (:func:`attend_chunked`), and the paged walk: which tokens a
query sees (:func:`visible_ranges`) and reading them from a pool (:func:`attend_sequence`,
:func:`attend_batch`). Every path, the no-cache recompute in :mod:`pagedkv.reference` included,
ends in the same kernel on the same numbers and strides, so paged and from-scratch results are
equal bit for bit. vLLM: ``PagedAttention`` (``vllm/attention``); SGLang: ``RadixAttention``
with its ``attention_backend``. Design and measurements: docs/design.md, docs/paging.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.table import BlockTable, ReadPlan
from pagedkv.counts import ChunkedWindow
from pagedkv.errors import ConfigError
from pagedkv.kernels.rows import head_planes, padded_rows, row_padded
from pagedkv.memory.pool import KVPool
from pagedkv.memory.quantization import QuantizedTokens, Tokens, scratch_buffer

__all__ = [
    "CHUNK_TOKENS",
    "EINSUM_MIN_BYTES",
    "GROUPED_CHUNK_MIN_TOKENS",
    "GROUPED_CHUNK_TOKENS",
    "KEYS_FIRST_MIN_TOKENS",
    "attend_batch",
    "attend_chunked",
    "attend_chunked_masked",
    "attend_decode_padded",
    "attend_dense",
    "attend_dense_masked",
    "attend_padded",
    "attend_sequence",
    "kernel",
    "set_kernel",
    "softmax_rows",
    "visible_ranges",
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

#: From this many tokens on, a grouped-query decode multiplies ``GROUPED_CHUNK_TOKENS`` at a time.
#:
#: NOTE: over the pool's token-major pages each head's rows lie ``H * d`` floats apart, and one
#: matmul over the whole window read them at a third of the gemv's bandwidth once the window
#: outgrows L2 (8k tokens, H=8, group 4, d=128: scores 6.1 ms, values 5.1 ms, against 3.3 ms for
#: a whole one-row decode). Chunks of 256 tokens (scores) and 512 (values) keep each chunk's rows
#: in L2 while every head reads its part: 3.8 and 3.7 ms there, 1.3-1.9x faster at 2k-16k tokens
#: and groups 2-8 (arrays alone). Through the pool (``benchmarks/bench_formats.py --group G``, two
#: runs): group 4 at 3k 3.7-4.1 -> 3.1-3.2 ms, 8k 9.6-10.8 -> 8.9, 16k 24-25 -> 17 ms; group 2 at
#: 4k 4.2-4.6 -> 3.2-3.4, 8k 9.3-10.4 -> 7.0-7.8, 16k 23-25 -> 13-14 ms. At 1k-2k the chunks'
#: extra calls cost as much as they save or more (1k, arrays: 0.76 -> 0.92 ms; 2k group 2:
#: 1.7-1.9 -> 2.0 ms): the switch sits at 3k. Shape alone decides, and the values'
#: chunk sums are added in chunk order, so every path rounds alike (docs/paging.md).
GROUPED_CHUNK_MIN_TOKENS = 3072

#: Tokens per matmul of a long grouped-query decode (``GROUPED_CHUNK_MIN_TOKENS``): ``(scores, values)``.
GROUPED_CHUNK_TOKENS = (256, 512)


def softmax_rows(
    scores: npt.NDArray[np.floating],
    scale: float = 1.0,
    visible: npt.NDArray[np.bool_] | None = None,
    hidden: npt.NDArray[np.bool_] | None = None,
) -> npt.NDArray[np.floating]:
    """Softmax along the last axis of ``scale * scores``, in place.

    Every kernel ends its scores here, so they all round the same way: scale,
    mask (hidden scores become -inf, weight exactly 0), subtract the row
    maximum (so exp() stays finite for scores of any size), exp, normalize.

    Args:
        scores: raw scores, overwritten by the weights.
        scale: multiplies every score first.
        visible: booleans broadcastable to ``scores``; False hides a score.
        hidden: booleans, the same as ``not visible``, for a caller that reuses one mask
            (give one of the two, or neither).

    Returns:
        ``scores``, now the weights.

    >>> softmax_rows(np.array([[0.0, 0.0]])).tolist()
    [[0.5, 0.5]]
    """
    if scale != 1.0:
        scores *= scale
    if visible is not None:
        hidden = np.logical_not(visible)
    if hidden is not None:
        np.copyto(scores, -np.inf, where=hidden)
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
    if group > 1 and _streams_compiled(query, keys, values):
        from pagedkv.kernels import jit

        # (num_tokens, H, d) as stored: every path hands the kernel token-major keys and values
        scores = softmax_rows(jit.float_scores(grouped, keys.transpose(1, 0, 2)), scale)
        compiled: npt.NDArray[np.floating] = jit.float_weighted_values(scores, values.transpose(1, 0, 2))
        return compiled.reshape(query.shape)
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
            return _attend_keys_first(grouped, keys, values, scale).reshape(query.shape)
        scores = np.matmul(grouped, keys.transpose(0, 2, 1))
        out = np.matmul(softmax_rows(scores, scale), values)
    result: npt.NDArray[np.floating] = out.reshape(query.shape)
    return result


def _attend_keys_first(
    grouped: npt.NDArray[np.floating],
    keys: npt.NDArray[np.floating],
    values: npt.NDArray[np.floating],
    scale: float,
) -> npt.NDArray[np.floating]:
    """Grouped queries ``(num_kv_heads, group, head_dim)`` over ``KEYS_FIRST_MIN_TOKENS`` tokens or more.

    Scores as ``K @ q^T``, written into ``(num_kv_heads, group, num_tokens)``;
    the whole window in one matmul each for scores and values, or from
    ``GROUPED_CHUNK_MIN_TOKENS`` on ``GROUPED_CHUNK_TOKENS`` at a time, the
    values' products summed in chunk order.
    """
    num_kv_heads, num_tokens, _ = keys.shape
    chunked = num_tokens >= GROUPED_CHUNK_MIN_TOKENS
    score_chunk, value_chunk = GROUPED_CHUNK_TOKENS if chunked else (num_tokens, num_tokens)
    query_t = np.ascontiguousarray(grouped.transpose(0, 2, 1))
    scores = np.empty((num_kv_heads, grouped.shape[1], num_tokens), np.result_type(grouped, keys))
    for start in range(0, num_tokens, score_chunk):
        end = min(num_tokens, start + score_chunk)
        # (num_kv_heads, chunk, group) into the chunk's columns of (num_kv_heads, group, num_tokens)
        scores[:, :, start:end] = np.matmul(keys[:, start:end], query_t).transpose(0, 2, 1)
    weights = softmax_rows(scores, scale)
    out: npt.NDArray[np.floating] = np.matmul(weights[:, :, :value_chunk], values[:, :value_chunk])
    for start in range(value_chunk, num_tokens, value_chunk):
        out += np.matmul(weights[:, :, start : start + value_chunk], values[:, start : start + value_chunk])
    return out


def _streams_compiled(*arrays: npt.NDArray[np.floating]) -> bool:
    """Whether a grouped-query decode over float pages runs the compiled kernel (``set_kernel("numba")``).

    Only float32 (the kernel's one compute dtype) and only with several query
    rows a kv head: one row reads at the gemv's speed through numpy's einsum
    already (bench_formats.py). Types and shapes only, so a paged read and
    its recompute take the same path.
    """
    return _SELECTED["kernel"] == "numba" and all(array.dtype == np.float32 for array in arrays)


#: A prefill's masked kernel scores as many kv heads at a time as fit in this many bytes (at
#: least one): 2 MiB is 4 of 8 heads of a 128-query chunk over 1k tokens, one head from 4k on.
#: (All heads at once cost 10-13% at 8k-16k tokens in the softmax's passes; one head at a time
#: cost 3% at 1k in calls: docs/paging.md.)
SCORE_BLOCK_BYTES = 2 << 20

#: A prefill's scores up to this size live in a buffer of the thread's, kept between calls;
#: larger ones are allocated and freed each call. A thread keeps at most half as much again (a
#: buffer grows by half): float32 pages hold one block of heads' scores, 8 MiB a 128-query chunk
#: over 16k tokens; low-precision pages past ``WHOLE_WINDOW_BYTES`` hold every head's, 67 MB at 16k.
#:
#: NOTE: a new score array each call (4 MiB for a 128-query chunk over 1k tokens at H=8) cost a
#: page fault per 4 KiB on most calls here, about 2.5 us each (glibc maps a block that large
#: afresh when the last one it freed was the same size): a fifth of a 1k-token prefill, and as
#: much again over growing contexts (docs/paging.md).
SCORE_BUFFER_MAX_BYTES = 128 << 20


def _score_rows(
    shape: tuple[int, ...], dtype: np.dtype[Any], padded: bool = True
) -> npt.NDArray[np.floating]:
    """An uninitialized ``shape`` array in this thread's buffer, valid until the thread's next call.

    ``padded``: last-axis rows :func:`padded_rows` apart (scores written a
    chunk of columns at a time), else C-contiguous (whole rows at once: the
    softmax's passes then run as one loop, 8-10% faster at 1k-2k tokens).
    A fresh array past ``SCORE_BUFFER_MAX_BYTES``.
    """
    *leading, num_columns = shape
    stored = (*leading, padded_rows(num_columns) if padded else num_columns)
    if math.prod(stored) * np.dtype(dtype).itemsize > SCORE_BUFFER_MAX_BYTES:
        return row_padded(shape, dtype) if padded else np.empty(shape, dtype)
    scores: npt.NDArray[np.floating] = scratch_buffer("scores", dtype, stored)[..., :num_columns]
    return scores


def _group_by_kv_head(queries: npt.NDArray[np.floating], num_kv_heads: int) -> npt.NDArray[np.floating]:
    """``(num_queries, num_q_heads, d)`` as ``(num_kv_heads, num_queries * group, d)``: by kv head."""
    num_queries, num_q_heads, head_dim = queries.shape
    group = num_q_heads // num_kv_heads
    grouped = queries.reshape(num_queries, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    result: npt.NDArray[np.floating] = grouped.reshape(num_kv_heads, num_queries * group, head_dim)
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
    grouped = _group_by_kv_head(queries, num_kv_heads)  # (num_kv_heads, num_queries * group, head_dim)
    rows = num_queries * group
    score_dtype = np.result_type(grouped, keys)
    out_dtype = np.result_type(score_dtype, values)
    # NOTE: a block of kv heads at a time, their scores in this thread's
    # buffer: the softmax's passes run over at most SCORE_BLOCK_BYTES of
    # scores while they sit in cache, and no call maps fresh pages for them
    # (see SCORE_BUFFER_MAX_BYTES). Same bits as all heads at once.
    head_bytes = rows * num_tokens * score_dtype.itemsize
    block = max(1, min(num_kv_heads, SCORE_BLOCK_BYTES // head_bytes))
    result = np.empty((num_queries, num_kv_heads, group, head_dim), out_dtype)
    hidden = np.logical_not(visible)[None, :, None, :]
    for first in range(0, num_kv_heads, block):
        heads = slice(first, min(num_kv_heads, first + block))
        count = heads.stop - first
        scores = _score_rows((count, rows, num_tokens), score_dtype, padded=False)
        np.matmul(grouped[heads], keys[heads].transpose(0, 2, 1), out=scores)
        weights = softmax_rows(scores.reshape(count, num_queries, group, num_tokens), scale, hidden=hidden)
        out = scratch_buffer("head out", out_dtype, (count, rows, head_dim))
        # NOTE: OpenBLAS's small-N kernels (head_dim 1-8 here) can raise the FPU's
        # invalid flag on lanes they load past a row and drop, so numpy warned
        # "invalid value encountered in matmul" once in CI for finite inputs (a
        # 5-token prefill at head_dim 1). The inputs are checked finite and masked
        # weights are exact zeros, so no real NaN can arise here; an overflow is
        # still reported. (numpy/OpenBLAS discuss silencing FE_INVALID the same way.)
        with np.errstate(invalid="ignore"):
            np.matmul(weights.reshape(count, rows, num_tokens), values[heads], out=out)
        result[:, heads] = out.reshape(count, num_queries, group, head_dim).transpose(1, 0, 2, 3)
    flat: npt.NDArray[np.floating] = result.reshape(num_queries, num_q_heads, head_dim)
    return flat


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


# ---------------------------------------------- quantized pages: dequantized chunk by chunk
# The cache is never dequantized: the window is, CHUNK_TOKENS tokens at a time counted from its
# first token, so chunk boundaries depend only on logical positions and the paged cache and the
# no-cache recompute run the same arithmetic on the same codes (docs/quantization.md). A prefill's
# window is widened whole instead where it is short or its chunks' scores would outweigh it
# (WHOLE_WINDOW_BYTES): chosen by shape alone, so both sides still take the same path. Each chunk
# is decoded from the stored bytes into one per-thread float buffer, token-major (c, H, d) and
# contiguous whatever the codes' strides, so every path hands BLAS the same numbers and strides.


#: Tokens dequantized at a time by the chunked kernels (see benchmarks/bench_formats.py).
CHUNK_TOKENS = 1024

#: Tokens widened at a time where the compiled kernel widens them (a prefill chunk's keys and
#: values): 2 MiB of float32 at H=8, d=128 (128 to 1024 measured, 512 best by 2-4%; docs/quantization.md).
COMPILED_CHUNK_TOKENS = 512

#: A prefill whose widened keys (or values) take at most this many bytes widens both whole, once,
#: and runs :func:`attend_dense_masked` on them: float32's own kernel over the stored values. 8 MiB
#: is 2k tokens at H=8, d=128: there int8 measured 1.05x float32 whole against 1.14x chunk by
#: chunk (1k: 1.06x against 1.21x); from 3k tokens the chunks were faster (1.01x against 1.05x).
#: Longer windows are widened whole as well where the chunks' scores (every head's, kept until
#: the softmax) would take at least twice the widened window (``2 * head_dim`` query rows a kv
#: head or more) and both sides fit ``SCORE_BUFFER_MAX_BYTES``: int8, four query heads a kv head,
#: 1.00-1.01x float32 whole against 1.02-1.19x in chunks at 2k-8k tokens; two heads 1.01x
#: against 1.03-1.05x at 8k-16k (one run each).
WHOLE_WINDOW_BYTES = 8 << 20

#: Up to this many rows per kv head (a decode's grouped query heads) scales are folded into the
#: scores and weights; more rows (a prefill chunk) multiply each chunk's values by them instead.
#:
#: NOTE: folding skips a pass over every decoded value (the multiply by a scale per group of 32),
#: which cost more than the int8 widening itself, for a matmul with ``num_groups`` times the
#: columns: keys 495 -> 272 us, values 450 -> 371 us per 1024-token int8 chunk at H=8, d=128
#: (one thread, warm). A prefill's matmul is compute-bound, and four times its work would cost
#: more than the pass saves. The choice depends only on the shape, so every path rounds alike.
FOLD_MAX_ROWS = 8


def _chunk(
    tokens: Tokens, start: int, end: int, dtype: np.dtype[Any], keys: bool = False, buffer: str = "chunk"
) -> npt.NDArray[np.floating]:
    """Tokens ``start .. end - 1`` as floats ``(num_kv_heads, end - start, head_dim)``: a view.

    Of the float tokens themselves, or of this thread's scratch ``buffer``,
    valid until the thread's next quantized chunk into it. ``keys``: the
    chunk is a prefill's keys (the compiled widening lays them token-major,
    values head-major: see ``_widen_compiled``).
    """
    if isinstance(tokens, QuantizedTokens):
        heads, _, head_dim = tokens.shape
        if _widens_compiled(dtype):
            return _widen_compiled(tokens, start, end, dtype, keys, buffer)
        out = scratch_buffer(buffer, dtype, (end - start, heads, head_dim))
        tokens.decode_into(start, end, out)
        heads_first: npt.NDArray[np.floating] = out.transpose(1, 0, 2)
        return heads_first
    return tokens[:, start:end]


def _widened(
    tokens: QuantizedTokens, start: int, end: int, dtype: np.dtype[Any]
) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    """A scaled chunk's codes ``(H, c, d)`` (a view of this thread's buffer), its scales ``(H, c, G)``."""
    heads, _, head_dim = tokens.shape
    out = scratch_buffer("chunk", dtype, (end - start, heads, head_dim))
    scales = tokens.widen_into(start, end, out)
    assert scales is not None  # a scaled format always has them (_folds checked)
    return out.transpose(1, 0, 2), scales.transpose(1, 0, 2)


def _folds(tokens: Tokens, num_rows: int) -> bool:
    """Whether a chunk of ``tokens`` is read with its scales folded in (see ``FOLD_MAX_ROWS``)."""
    return isinstance(tokens, QuantizedTokens) and tokens.storage.scaled and num_rows <= FOLD_MAX_ROWS


def _chunks(num_tokens: int, dtype: np.dtype[Any]) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk, counted from the window's first token::

    CHUNK_TOKENS 4, 10 tokens:  |0 1 2 3|4 5 6 7|8 9|

    (``COMPILED_CHUNK_TOKENS`` where the compiled kernel widens the chunks.)
    """
    size = COMPILED_CHUNK_TOKENS if _widens_compiled(dtype) else CHUNK_TOKENS
    return [(start, min(num_tokens, start + size)) for start in range(0, num_tokens, size)]


def _weighted_values(
    weights: npt.NDArray[np.floating], values: Tokens, dtype: np.dtype[Any]
) -> npt.NDArray[np.floating]:
    """``weights (num_kv_heads, rows, num_tokens) @ values``, chunk by chunk, in chunk order.

    Folded scales: a group's output is ``sum_t (w_t s_tg) c_tg``, so each
    row's weights times each group's scales make ``num_groups`` rows of one
    matmul over the codes, of whose ``(rows, head_dim)`` results each group
    keeps its own columns::

        weights (H, R, c) x scales (H, c, G) -> (H, G * R, c) @ codes (H, c, d) -> (H, G, R, G, gs)
        out[h, r, g * gs : (g + 1) * gs] = that[h, g, r, g, :]
    """
    num_kv_heads, num_rows, _ = weights.shape
    out: npt.NDArray[np.floating] | None = None
    for start, end in _chunks(values.shape[1], dtype):
        if isinstance(values, QuantizedTokens) and _folds(values, num_rows):
            codes, scales = _widened(values, start, end, dtype)
            num_groups = scales.shape[-1]
            group_size = codes.shape[-1] // num_groups
            scaled = weights[:, :, start:end, None] * scales[:, None]  # (H, R, c, G)
            stacked = scaled.transpose(0, 3, 1, 2).reshape(num_kv_heads, num_groups * num_rows, end - start)
            every = np.matmul(stacked, codes)  # (H, G * R, d)
            every = every.reshape(num_kv_heads, num_groups, num_rows, num_groups, group_size)
            diagonal = np.arange(num_groups)
            own = every[:, diagonal, :, diagonal]  # (G, H, R, gs): advanced indices first
            part = own.transpose(1, 2, 0, 3).reshape(num_kv_heads, num_rows, -1)
        else:  # a prefill chunk's products go to this thread's buffers (see _score_rows)
            purpose = "values out" if out is None else "values part"
            into = None if num_rows <= FOLD_MAX_ROWS else scratch_buffer(
                purpose, dtype, (num_kv_heads, num_rows, values.shape[2]))
            part = np.matmul(weights[:, :, start:end], _chunk(values, start, end, dtype), out=into)
        if out is None:
            out = part
        else:
            out += part
    assert out is not None
    return out


def _scores(
    grouped: npt.NDArray[np.floating], keys: Tokens, dtype: np.dtype[Any]
) -> npt.NDArray[np.floating]:
    """``grouped (num_kv_heads, rows, head_dim) @ keys^T``, chunk by chunk.

    Folded scales: score ``t`` is ``sum_g s_tg (c_tg . q_g)``: the query,
    laid block-diagonally over the groups, scores each group of the codes
    in one matmul, and the scales weigh the ``num_groups`` partial scores::

        codes (H, c, d) @ blocks (H, d, G * R) -> (H, c, G, R) . scales (H, c, G) -> (H, R, c)
    """
    num_kv_heads, num_tokens, head_dim = keys.shape
    num_rows = grouped.shape[1]
    # NOTE: many rows (a prefill chunk) are written a chunk of columns at a
    # time, which stalls on rows a multiple of 4 KiB apart (pagedkv.kernels.rows).
    shape = (num_kv_heads, num_rows, num_tokens)
    scores = _score_rows(shape, dtype) if num_rows > FOLD_MAX_ROWS else np.empty(shape, dtype)
    if _folds(keys, num_rows):
        assert isinstance(keys, QuantizedTokens)
        num_groups = keys.storage.num_groups
        group_size = head_dim // num_groups
        blocks = np.zeros((num_kv_heads, num_groups, group_size, num_groups, num_rows), dtype)
        by_group = grouped.reshape(num_kv_heads, num_rows, num_groups, group_size)
        for group in range(num_groups):
            blocks[:, group, :, group, :] = by_group[:, :, group, :].transpose(0, 2, 1)
        blocks_2d = blocks.reshape(num_kv_heads, head_dim, num_groups * num_rows)
        for start, end in _chunks(num_tokens, dtype):
            codes, scales = _widened(keys, start, end, dtype)
            partial = np.matmul(codes, blocks_2d).reshape(num_kv_heads, end - start, num_groups, num_rows)
            scores[:, :, start:end] = np.einsum("hcgr,hcg->hrc", partial, scales)
        return scores
    query_t = grouped.transpose(0, 2, 1)
    for start, end in _chunks(num_tokens, dtype):
        if num_rows > FOLD_MAX_ROWS:
            # NOTE: many rows (a prefill chunk): query @ keys^T straight into
            # the scores saves the transposed copy of the form below (about
            # 15% at 128 rows over 8k token-major keys); with few rows it
            # measured 1.7x slower than keys @ query^T, which stays on BLAS's gemv.
            chunk_t = _chunk(keys, start, end, dtype, keys=True).transpose(0, 2, 1)
            np.matmul(grouped, chunk_t, out=scores[:, :, start:end])
        else:
            part = np.matmul(_chunk(keys, start, end, dtype), query_t)  # (num_kv_heads, chunk, rows)
            scores[:, :, start:end] = part.transpose(0, 2, 1)
    return scores


#: The kernels a decode can run: numpy's matmuls, or the compiled one (``jit`` extra), which reads
#: quantized pages, widens a prefill's chunks, and streams a grouped-query decode over float32 pages.
KERNELS = ("numpy", "numba")

_SELECTED = {"kernel": "numpy"}


def kernel() -> str:
    """The kernel quantized pages and grouped-query float32 decodes run (``set_kernel``).

    >>> kernel()
    'numpy'
    """
    return _SELECTED["kernel"]


def set_kernel(name: str) -> str:
    """Choose the decode kernel for this process, paged reads and the recompute alike; the old one.

    ``"numba"`` runs the compiled loops for quantized pages (decode, and a
    prefill's widening) and for a float32 decode with several query rows a
    kv head (grouped-query attention); everything else keeps numpy's path.

    NOTE: a process-wide setting, not a pool option: the no-cache recompute
    (:mod:`pagedkv.reference`) has no pool, and it must run the same kernel
    as the cache to equal it bit for bit. The two kernels round differently
    from each other; each equals its own recompute.

    Args:
        name: ``"numpy"`` (the default) or ``"numba"`` (needs the ``jit`` extra).

    Raises:
        ConfigError: an unknown name (nothing changes).
        ImportError: ``"numba"`` without numba installed (nothing changes).
    """
    if name not in KERNELS:
        raise ConfigError(f"kernel must be one of {KERNELS}, got {name!r}")
    if name == "numba":
        from pagedkv.kernels import jit

        jit.compile_kernels()
    previous = _SELECTED["kernel"]
    _SELECTED["kernel"] = name
    return previous


def _widens_compiled(dtype: np.dtype[Any]) -> bool:
    """Whether quantized chunks are widened by the compiled kernel (``set_kernel("numba")``, float32)."""
    return _SELECTED["kernel"] == "numba" and dtype == np.float32


def _widen_compiled(
    tokens: QuantizedTokens, start: int, end: int, dtype: np.dtype[Any], keys: bool, buffer: str = "chunk"
) -> npt.NDArray[np.floating]:
    """Tokens ``start .. end - 1`` widened by the compiled loop, ``(H, end - start, d)``, in ``buffer``.

    The same values as ``tokens.decode_into`` (each ``code * scale``, one
    rounding), read by slot from the stored rows. Keys are laid token-major
    (as the pages), values head-major, each head's plane contiguous and the
    planes ``padded_rows`` apart: BLAS's fastest layout for each product
    (a 512-token chunk at H=8, d=128: values 1.39 vs 1.54 ms token-major,
    keys 1.6-1.8 vs 1.8-2.0 ms head-major; docs/quantization.md).

    NOTE: a prefill chunk's matmuls are compute-bound and reuse each widened
    row once per query row, so the chunk is widened once (not folded); the
    numpy decode's copy of the codes by slot and its second pass for the
    scales cost more than the widening (benchmarks/bench_formats.py).
    """
    from pagedkv.kernels import jit

    heads, _, head_dim = tokens.shape
    num_tokens = end - start
    widened: npt.NDArray[np.floating]
    if keys:
        flat = scratch_buffer(buffer, dtype, (num_tokens * heads * head_dim,))
        strides = (heads * head_dim, head_dim)
        widened = flat.reshape(num_tokens, heads, head_dim).transpose(1, 0, 2)
    else:
        stride = padded_rows(num_tokens * head_dim)
        flat = scratch_buffer(buffer, dtype, (heads * stride,))
        strides = (head_dim, stride)
        widened = head_planes(flat, heads, num_tokens, head_dim)
    slots, scale_slots = _compiled_slots(tokens)
    codes = tokens.codes.transpose(1, 0, 2)
    scales = None if tokens.scales is None else tokens.scales.transpose(1, 0, 2)
    if slots is None:  # the chunk's rows, in order
        codes = codes[start:end]
    else:
        slots = slots[start:end]
    if scale_slots is None:
        scales = None if scales is None else scales[start:end]
    else:
        scale_slots = scale_slots[start:end]
    jit.decode_into((tokens.storage.name, codes, scales), slots, scale_slots, flat, num_tokens, strides)
    return widened


def _compiled_slots(
    tokens: QuantizedTokens,
) -> tuple[npt.NDArray[np.intp] | None, npt.NDArray[np.intp] | None]:
    """Where the compiled kernels read each token's codes and its scales (None: row ``t`` is token ``t``)::

        stored tokens:   codes in order   scales in order
        by slot:         codes slots      scales slots
        page view:       codes in order   scales slots     (codes mapped, scales read by slot)
    """
    if tokens.slots is not None:
        return tokens.slots, tokens.slots
    return None, tokens.scale_slots


def _attend_compiled(
    query: npt.NDArray[np.floating], keys: Tokens, values: Tokens, scale: float, dtype: np.dtype[Any]
) -> npt.NDArray[np.floating] | None:
    """The compiled kernel's decode, or None where it does not apply (numpy's path then runs).

    It applies to float32 compute over quantized keys and values (each side
    read where ``_compiled_slots`` says): conditions on types only, so a
    paged read and its recompute always take the same path.
    """
    if _SELECTED["kernel"] != "numba" or dtype != np.float32:
        return None
    if not (isinstance(keys, QuantizedTokens) and isinstance(values, QuantizedTokens)):
        return None
    from pagedkv.kernels import jit

    num_kv_heads, _, head_dim = keys.shape
    key_slots, value_slots = _compiled_slots(keys), _compiled_slots(values)
    grouped = query.reshape(num_kv_heads, -1, head_dim)
    key_side, value_side = (
        (side.storage.name, side.codes.transpose(1, 0, 2),
         None if side.scales is None else side.scales.transpose(1, 0, 2))
        for side in (keys, values)
    )
    scores = jit.scores(grouped, key_side, *key_slots)  # (num_kv_heads, group, num_tokens)
    weights = softmax_rows(scores, scale)
    out = jit.weighted_values(weights, value_side, *value_slots, head_dim)
    result: npt.NDArray[np.floating] = out.reshape(query.shape)
    return result


def attend_chunked(
    query: npt.NDArray[np.floating],
    keys: Tokens,
    values: Tokens,
    scale: float,
    dtype: np.dtype[Any],
) -> npt.NDArray[np.floating]:
    """``softmax(scale * K q) . V`` over float or quantized keys/values, chunk by chunk.

    The quantized counterpart of :func:`attend_dense`, same
    grouped-query rule. Each chunk of ``CHUNK_TOKENS`` tokens is dequantized
    just before its matmul; nothing holds the whole window as floats.

    Args:
        query: ``(num_q_heads, head_dim)`` of ``dtype``.
        keys: ``(num_kv_heads, num_tokens, head_dim)`` floats or :class:`QuantizedTokens`.
        values: the same for values.
        scale: multiplies every score.
        dtype: the compute dtype.

    Returns:
        A new ``(num_q_heads, head_dim)`` array.
    """
    compiled = _attend_compiled(query, keys, values, scale, dtype)
    if compiled is not None:  # set_kernel("numba")
        return compiled
    num_kv_heads, _, head_dim = keys.shape
    grouped = query.reshape(num_kv_heads, -1, head_dim)
    scores = _scores(grouped, keys, dtype)  # (num_kv_heads, group, num_tokens)
    scores = softmax_rows(scores, scale)
    out = _weighted_values(scores, values, dtype)  # (num_kv_heads, group, head_dim)
    result: npt.NDArray[np.floating] = out.reshape(query.shape)
    return result


def attend_chunked_masked(
    queries: npt.NDArray[np.floating],
    keys: Tokens,
    values: Tokens,
    visible: npt.NDArray[np.bool_],
    scale: float,
    dtype: np.dtype[Any],
) -> npt.NDArray[np.floating]:
    """Many query tokens, each over the keys its row of ``visible`` allows (chunked prefill).

    The quantized counterpart of :func:`attend_dense_masked`: the window
    widened whole and that kernel run on it where ``WHOLE_WINDOW_BYTES``
    says, else chunk by chunk (each head's softmax in turn).

    Args:
        queries: ``(num_queries, num_q_heads, head_dim)``.
        keys: ``(num_kv_heads, num_tokens, head_dim)`` floats or :class:`QuantizedTokens`.
        values: the same for values.
        visible: ``(num_queries, num_tokens)``; every row sees at least one key.
        scale: multiplies every score.
        dtype: the compute dtype.

    Returns:
        A new ``(num_queries, num_q_heads, head_dim)`` array.
    """
    num_queries, num_q_heads, head_dim = queries.shape
    num_kv_heads, num_tokens, _ = keys.shape
    group = num_q_heads // num_kv_heads
    widened = num_tokens * num_kv_heads * head_dim * np.dtype(dtype).itemsize  # a side, widened
    # The chunks' scores (every head's) take rows / head_dim times a side's widened bytes.
    scores_outweigh = num_queries * group >= 2 * head_dim and 2 * widened <= SCORE_BUFFER_MAX_BYTES
    if widened <= WHOLE_WINDOW_BYTES or scores_outweigh:
        whole_keys = _chunk(keys, 0, num_tokens, dtype, keys=True, buffer="keys")
        whole_values = _chunk(values, 0, num_tokens, dtype, buffer="values")
        return attend_dense_masked(queries, whole_keys, whole_values, visible, scale)
    grouped = _group_by_kv_head(queries, num_kv_heads)
    scores = _scores(grouped, keys, dtype).reshape(num_kv_heads, num_queries, group, num_tokens)
    hidden = np.logical_not(visible)[:, None, :]
    for head in range(num_kv_heads):  # one head's scores at a time stay in cache (as attend_dense_masked)
        softmax_rows(scores[head], scale, hidden=hidden)
    weights = scores.reshape(num_kv_heads, num_queries * group, num_tokens)
    out = _weighted_values(weights, values, dtype)  # this thread's buffer: copied out
    result = np.empty((num_queries, num_kv_heads, group, head_dim), out.dtype)
    result[...] = out.reshape(num_kv_heads, num_queries, group, head_dim).transpose(1, 0, 2, 3)
    flat: npt.NDArray[np.floating] = result.reshape(num_queries, num_q_heads, head_dim)
    return flat


# ------------------------------------------------------------ the walk over block tables
# A token at logical index ``p`` of a sequence with ``S`` sink tokens, in a layer with window ``W``,
# sees (``visible_ranges``):
#
#     sinks 0 .. S-1   and   max(S, p - W + 1) .. p        (W None: S .. p)
#     S = 2, W = 3, p = 9:   [0 1] 2 3 4 5 6 [7 8 9]
#
# One new token (decode) runs attend_dense on exactly those tokens, read by KVPool.read as a
# token-major (num_tokens, num_kv_heads, head_dim) array (a mapped view, a run of the storage or a
# gather: the same numbers and strides each way); several (a prefill chunk) run the masked kernel
# over what the table holds. A quantized pool runs the chunked kernels the same way, on its codes.


def visible_ranges(num_sink_tokens: int, window: int | None, position: int) -> list[tuple[int, int]]:
    """Logical index ranges ``[start, end)`` the token at ``position`` attends to.

    A :class:`~pagedkv.counts.ChunkedWindow` window sees its chunk only.

    >>> visible_ranges(2, 3, 9)
    [(0, 2), (7, 10)]
    >>> visible_ranges(0, None, 4), visible_ranges(0, ChunkedWindow(4), 9)
    ([(0, 5)], [(8, 10)])
    """
    if window is None and not num_sink_tokens and position >= 0:  # the common case, at once
        return [(0, position + 1)]
    sinks = min(num_sink_tokens, position + 1)
    if window is None:
        start = sinks
    elif window.__class__ is ChunkedWindow:
        start = max(sinks, position - position % window)
    else:
        start = max(sinks, position + 1 - window)
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
    # A quantized pool reads codes and scales as stored (a view, or the pages
    # and their slots) and runs the chunked kernels; which tokens and which
    # mask is the same.
    quantized = pool.quantized
    if len(queries) == 1:
        ranges = visible_ranges(table.num_sink_tokens, window, last)
        if quantized:
            key_codes, value_codes = pool.read_quantized(layer, table, ranges)
            return attend_chunked(queries[0], key_codes, value_codes, scale, pool.dtype)[None]
        keys, values = pool.read(layer, table, ranges)  # (num_visible, num_kv_heads, head_dim)
        return attend_dense(queries[0], keys.transpose(1, 0, 2), values.transpose(1, 0, 2), scale)[None]
    held = table.live_ranges()
    mask = _prefill_mask(table, held, window, len(queries))
    if quantized:
        key_codes, value_codes = pool.read_quantized(layer, table, held)
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
        if window.__class__ is ChunkedWindow:  # each query sees its own chunk
            in_window = positions[None, :] >= (query_positions - query_positions % window)[:, None]
        else:
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

    One :func:`attend_sequence` per table (``KVCacheManager.attend(method="padded")``
    calls :func:`attend_decode_padded` instead when every sequence has one new token).

    Returns:
        A new ``(num_tokens, num_q_heads, head_dim)`` array.
    """
    out = np.empty_like(queries)
    for table, lo, hi in zip(tables, query_start[:-1], query_start[1:]):
        out[lo:hi] = attend_sequence(pool, layer, table, window, queries[lo:hi], scale)
    return out
