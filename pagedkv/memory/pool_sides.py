"""One side of a pool's pages (keys or values of one layer): reads and writes by slot or block, as stored.

A side is ``store`` ``(num_blocks, block_size, num_kv_heads, head_dim)`` of
floats or codes, token-major, and, when its format has scales (int8, fp8;
not float16 or bfloat16), ``scales``
``(num_blocks, block_size, num_kv_heads, num_groups)``. What the readers
return is head-major ``(num_kv_heads, num_tokens, ...)``, as the chunked
kernels of :mod:`pagedkv.memory.quantization` read it (transposed views where they
can be)::

    store (blocks 7, 3; block_size 2):   blk 7: t0 t1 | blk 3: t2 t3
    run_tokens / take_tokens:            (H, 4 tokens, d), codes as stored
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.memory.quantization import QuantizedTokens, StorageFormat, Tokens

__all__ = ["run_tokens", "take_tokens", "write_blocks", "write_tokens"]


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


def write_blocks(
    pages: npt.NDArray[Any], block_ids: list[int], offset: int, tokens: npt.NDArray[np.floating]
) -> None:
    """Store ``tokens`` ``(n, H, d)`` in ``pages``, from ``offset`` in the first of ``block_ids`` on.

    The run's first block from ``offset``, then its whole blocks (one slice
    when their ids are one run, else one index over blocks), then the rest
    of its last block::

        block_size 4, offset 2, 9 tokens, block_ids [7, 3, 4]
        b7: . . t0 t1 | b3: t2 t3 t4 t5 | b4: t6 t7 t8 .

    >>> pages = np.zeros((8, 4, 1, 1))
    >>> write_blocks(pages, [7, 3, 4], 2, np.arange(1.0, 10.0).reshape(9, 1, 1))
    >>> pages[[7, 3, 4]].reshape(3, 4).tolist()
    [[0.0, 0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 0.0]]
    >>> write_blocks(pages, [2, 1, 0], 0, np.arange(1.0, 13.0).reshape(12, 1, 1))
    >>> pages[:3].reshape(3, 4).tolist()
    [[9.0, 10.0, 11.0, 12.0], [5.0, 6.0, 7.0, 8.0], [1.0, 2.0, 3.0, 4.0]]
    """
    block_size = pages.shape[1]
    num_tokens = len(tokens)
    first = 0
    if offset:  # the head: the rest of the first block
        first = min(block_size - offset, num_tokens)
        pages[block_ids[0], offset : offset + first] = tokens[:first]
        block_ids = block_ids[1:]
    num_whole = (num_tokens - first) // block_size
    if num_whole:
        whole = tokens[first : first + num_whole * block_size]
        whole = whole.reshape(num_whole, block_size, *tokens.shape[1:])
        ids, start, end = block_ids[:num_whole], block_ids[0], block_ids[num_whole - 1]
        # NOTE: ids ascending or descending by one are one slice: a fresh pool
        # hands out ascending runs, and a freed sequence's blocks (freed tail
        # first) come back descending.
        if end - start == num_whole - 1 and ids == list(range(start, end + 1)):
            pages[start : end + 1] = whole
        elif start - end == num_whole - 1 and ids == list(range(start, end - 1, -1)):
            pages[start : end - 1 if end else None : -1] = whole
        else:
            pages[ids] = whole
    rest = num_tokens - first - num_whole * block_size
    if rest:  # the tail: the start of the last block
        pages[block_ids[num_whole], :rest] = tokens[num_tokens - rest :]
