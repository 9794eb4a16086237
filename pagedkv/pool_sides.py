"""One side of a pool's pages (keys or values of one layer): reads and writes by slot, as stored.

A side is ``store`` ``(num_blocks, block_size, num_kv_heads, head_dim)`` of
floats or codes, token-major, and, when its format has scales (int8, fp8;
not float16 or bfloat16), ``scales``
``(num_blocks, block_size, num_kv_heads, num_groups)``. What the readers
return is head-major ``(num_kv_heads, num_tokens, ...)``, as the chunked
kernels of :mod:`pagedkv.quantization` read it (transposed views where they
can be)::

    store (blocks 7, 3; block_size 2):   blk 7: t0 t1 | blk 3: t2 t3
    run_tokens / take_tokens:            (H, 4 tokens, d), codes as stored
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.quantization import QuantizedTokens, StorageFormat, Tokens

__all__ = ["run_tokens", "take_tokens", "write_tokens"]


def run_tokens(
    store: npt.NDArray[Any],
    scales: npt.NDArray[np.floating] | None,
    storage: StorageFormat | None,
    first_id: int,
    num_blocks: int,
    lo: int,
    hi: int,
) -> Tokens:
    """Tokens ``lo .. hi - 1`` of the ``num_blocks`` blocks from ``first_id`` on (views)."""
    _, block_size, heads, head_dim = store.shape
    run = store[first_id : first_id + num_blocks]
    codes: npt.NDArray[Any] = run.reshape(num_blocks * block_size, heads, head_dim)[lo:hi].transpose(1, 0, 2)
    if storage is None:
        return codes
    if scales is None:  # a scale-free format (float16, bfloat16)
        return QuantizedTokens(codes, None, storage)
    run_scales = scales[first_id : first_id + num_blocks].reshape(num_blocks * block_size, heads, -1)
    return QuantizedTokens(codes, run_scales[lo:hi].transpose(1, 0, 2), storage)


def take_tokens(
    store: npt.NDArray[Any],
    scales: npt.NDArray[np.floating] | None,
    storage: StorageFormat | None,
    slots: npt.NDArray[np.intp],
) -> Tokens:
    """Tokens at ``slots`` (``block_id * block_size + offset``), in order (new arrays, transposed)."""
    num_blocks, block_size, heads, head_dim = store.shape
    flat = store.reshape(num_blocks * block_size, heads, head_dim)
    codes: npt.NDArray[Any] = np.take(flat, slots, axis=0).transpose(1, 0, 2)
    if storage is None:
        return codes
    if scales is None:  # a scale-free format (float16, bfloat16)
        return QuantizedTokens(codes, None, storage)
    flat_scales = scales.reshape(num_blocks * block_size, heads, -1)
    return QuantizedTokens(codes, np.take(flat_scales, slots, axis=0).transpose(1, 0, 2), storage)


def write_tokens(
    store: npt.NDArray[Any],
    scales: npt.NDArray[np.floating] | None,
    storage: StorageFormat | None,
    slots: npt.NDArray[np.intp],
    tokens: npt.NDArray[np.floating],
) -> None:
    """Store ``tokens`` ``(n, num_kv_heads, head_dim)`` at ``n`` slots, quantizing them."""
    num_blocks, block_size, heads, head_dim = store.shape
    flat = store.reshape(num_blocks * block_size, heads, head_dim)
    if storage is None:
        flat[slots] = tokens
        return
    codes, token_scales = storage.quantize(tokens)  # (n, heads, head_dim), (n, heads, num_groups)
    flat[slots] = codes
    if scales is not None:
        scales.reshape(num_blocks * block_size, heads, -1)[slots] = token_scales
