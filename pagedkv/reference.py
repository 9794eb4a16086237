"""The no-cache recompute: what a cache must equal, bit for bit.

Each step rebuilds dense arrays of the window's tokens from scratch, with no blocks, tables or
pools, and runs the cache's own kernel (:func:`pagedkv.attention.attend_dense`; quantized
storage is quantized token by token as the pool does, then :func:`~pagedkv.attention.attend_chunked`),
so a paged result that differs in one bit is a paging bug, never rounding. The counterpart of
the dense reference attention vLLM's kernel tests compare with (there within a tolerance).

>>> recompute([[1.0], [1.0]], [[1.0], [2.0]], [[42.0], [0.0]], max_size=1)
[[42.0], [0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.attention import attend_chunked, attend_dense
from pagedkv.memory.quantization import QuantizedTokens, Tokens, storage_format

__all__ = ["attend_window", "recompute"]


def attend_window(
    query: Any,
    keys: Sequence[Any],
    values: Sequence[Any],
    *,
    scale: float = 1.0,
    dtype: npt.DTypeLike = np.float64,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
) -> npt.NDArray[Any]:
    """Attend ``query`` over exactly ``keys``/``values`` (the window, oldest first).

    Args:
        query: ``(head_dim,)`` or ``(num_q_heads, head_dim)``.
        keys: one ``(head_dim,)`` or ``(num_kv_heads, head_dim)`` key per token.
        values: one value per token, shaped like the keys.
        scale: multiplies every score.
        dtype: the dtype the cache stores and computes in.
        key_dtype: the cache's key storage (None, ``"int8"``, ``"float8_e4m3"``,
            ``"float16"``, ``"bfloat16"``): the keys are stored as the cache
            stores them.
        value_dtype: the same for values.

    Returns:
        A new array shaped like ``query``.

    >>> attend_window([1.0], [[1.0], [1.0]], [[0.3], [0.5]], key_dtype="int8", value_dtype="int8")
    array([0.4])
    """
    q = np.asarray(query, dtype=dtype)
    dense_keys = np.asarray(keys, dtype=dtype)
    dense_values = np.asarray(values, dtype=dtype)
    num_tokens, head_dim = dense_keys.shape[0], dense_keys.shape[-1]
    # (num_tokens, num_kv_heads, head_dim), contiguous, seen as (num_kv_heads, num_tokens, head_dim):
    # the strides a paged read hands the kernel, so both round the same way.
    dense_keys = np.ascontiguousarray(dense_keys.reshape(num_tokens, -1, head_dim)).transpose(1, 0, 2)
    dense_values = np.ascontiguousarray(dense_values.reshape(num_tokens, -1, head_dim)).transpose(1, 0, 2)
    if key_dtype is not None or value_dtype is not None:
        keys_read = _quantized(dense_keys, key_dtype)
        values_read = _quantized(dense_values, value_dtype)
        out = attend_chunked(q.reshape(-1, head_dim), keys_read, values_read, scale, q.dtype)
        return out.reshape(q.shape)
    out = attend_dense(q.reshape(-1, head_dim), dense_keys, dense_values, scale)
    return out.reshape(q.shape)


def _quantized(dense: npt.NDArray[Any], name: str | None) -> Tokens:
    """``dense`` ``(num_kv_heads, num_tokens, head_dim)`` stored as ``name`` would store it."""
    if name is None:
        return dense
    storage = storage_format(name, dense.shape[-1])
    codes, scales = storage.quantize(dense)
    return QuantizedTokens(codes, scales if storage.scaled else None, storage)


def recompute(
    queries: Sequence[Any],
    keys: Sequence[Any],
    values: Sequence[Any],
    *,
    max_size: int | None = None,
    scale: float = 1.0,
    dtype: npt.DTypeLike = np.float64,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
) -> list[Any]:
    """Full causal attention at every step of a token stream, without a cache.

    Step ``t`` attends ``queries[t]`` over tokens ``max(0, t + 1 - max_size) .. t``.

    Returns:
        One output per step: lists of floats when the queries are lists,
        arrays otherwise.
    """
    outputs = []
    for step, query in enumerate(queries):
        start = 0 if max_size is None else max(0, step + 1 - max_size)
        out = attend_window(
            query,
            keys[start : step + 1],
            values[start : step + 1],
            scale=scale,
            dtype=dtype,
            key_dtype=key_dtype,
            value_dtype=value_dtype,
        )
        outputs.append(out.tolist() if isinstance(query, (list, tuple)) else out)
    return outputs
