"""Score rows laid out for the caches: each row contiguous, rows never a multiple of 4 KiB apart.

A kernel that writes one column at a time down many rows (a token's score in every head's row, or
BLAS's micro-tiles of a chunk's scores) stalls when the rows lie a multiple of 4 KiB apart: each
column's stores fall into one L1 set. Measured: a 128-row x 512-column slice of the scores of an
8k-token prefill, 1.8 -> 1.6 ms (docs/quantization.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["head_planes", "padded_rows", "row_padded"]


def padded_rows(num_columns: int) -> int:
    """A row length of at least ``num_columns`` floats, a multiple of 16, its bytes no multiple of 4 KiB.

    >>> padded_rows(8192), padded_rows(100), padded_rows(1)
    (8208, 112, 16)
    """
    length = -(-num_columns // 16) * 16
    return length + 16 if length % 1024 == 0 else length


def row_padded(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A new uninitialized array of ``shape`` whose last-axis rows are :func:`padded_rows` apart (a view)."""
    *leading, num_columns = shape
    result: npt.NDArray[Any] = np.empty((*leading, padded_rows(num_columns)), dtype)[..., :num_columns]
    return result


def head_planes(buffer: npt.NDArray[Any], num_heads: int, num_rows: int, row_size: int) -> npt.NDArray[Any]:
    """``(num_heads, num_rows, row_size)`` over flat ``buffer``: each plane C-contiguous, planes padded apart.

    A plane's byte size is often a multiple of 4 KiB (512 tokens x 128 x 4
    bytes); writing a token's row into every plane would then fall into one
    L1 set. ``buffer`` must hold ``num_heads * padded_rows(num_rows * row_size)``: the
    planes are padded as rows are.
    """
    stride = padded_rows(num_rows * row_size)
    by_head = buffer[: num_heads * stride].reshape(num_heads, stride)
    planes: npt.NDArray[Any] = by_head[:, : num_rows * row_size]
    return planes.reshape(num_heads, num_rows, row_size)

