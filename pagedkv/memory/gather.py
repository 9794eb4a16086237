"""Executing a read plan on float pages: a view for a run of blocks, a gather into scratch otherwise.

A pool's layer is ``(num_blocks, block_size, num_kv_heads, head_dim)``,
token-major, so a block is one stretch of memory and the blocks of a run
(``7, 8, 9``) are one longer stretch: reshaped, they are the tokens, without
copying. Any other plan is copied into scratch with ``np.take``, one whole
block (or one whole token) per row::

    run (7, 8, 9):     keys[7:10] -> reshape (3 * block_size, H, d) -> [offset : offset + n]
    blocks (7, 3):     np.take(keys, [7, 3], axis=0, out=scratch)    -> [offset : offset + n]
    slots [30, 12]:    np.take(keys.reshape(-1, H, d), [30, 12], axis=0, out=scratch)

Results are ``(num_tokens, num_kv_heads, head_dim)`` with unit stride along
the last two axes: the same shape and strides whichever way they were read,
so attention rounds the same way on each (see :mod:`pagedkv.attention`).

Scratch is per thread (``threading.local``): a gather's result is valid until
the same thread's next gather of the same :class:`Scratch`, and two threads
never share one.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.read_plan import ReadPlan

__all__ = ["Scratch", "gather"]

Array = npt.NDArray[np.floating]


class Scratch:
    """Reusable gather buffers of one dtype, one pair per thread, grown geometrically."""

    def __init__(self, dtype: np.dtype[np.floating]) -> None:
        self.dtype = dtype
        self._local = threading.local()

    def take(self, size: int) -> tuple[Array, Array]:
        """This thread's key and value buffers, at least ``size`` values each."""
        local = self._local
        keys: Array | None = getattr(local, "keys", None)
        if keys is None or keys.size < size:
            capacity = max(size, 2 * (0 if keys is None else keys.size))
            # NOTE: zeroed, not np.empty: a BLAS kernel may load a few values
            # past a strided view's last row and drop them, and a NaN bit
            # pattern there sets the FPU's invalid flag, which numpy reports as
            # "invalid value encountered in matmul" for finite inputs (seen
            # once in CI on a 5-token prefill). Past a gather, the buffer then
            # holds only zeros or earlier gathers' checked values.
            local.keys = np.zeros(capacity, self.dtype)
            local.values = np.zeros(capacity, self.dtype)
        return local.keys, local.values


def gather(keys: Array, values: Array, plan: ReadPlan, scratch: Scratch) -> tuple[Array, Array]:
    """The tokens ``plan`` reads from one layer's ``keys``/``values``, as ``(plan.num_tokens, H, d)``.

    Views of the storage for a run, views of this thread's ``scratch`` otherwise.

    Raises:
        UnknownBlockError: the plan names a block (or slot) past the pages' end.

    >>> keys = np.arange(8.0).reshape(4, 2, 1, 1)  # 4 blocks of 2 tokens, H=1, d=1
    >>> gather(keys, keys, ReadPlan(3, (3, 1), offset=1), Scratch(keys.dtype))[0].ravel().tolist()
    [7.0, 2.0, 3.0]
    """
    num_blocks, block_size, num_kv_heads, head_dim = keys.shape
    plan.check(num_blocks, block_size)  # before np.take(mode="clip") would read a wrong block
    if plan.slots is not None:
        return _take(keys.reshape(-1, num_kv_heads, head_dim), values.reshape(-1, num_kv_heads, head_dim),
                     plan.slots, scratch)
    if not plan.num_tokens:
        empty = np.empty((0, num_kv_heads, head_dim), keys.dtype)
        return empty, empty
    lo, hi = plan.offset, plan.offset + plan.num_tokens
    if plan.is_run:
        first, num = plan.block_ids[0], len(plan.block_ids)
        shape = (num * block_size, num_kv_heads, head_dim)
        key_run, value_run = keys[first : first + num], values[first : first + num]
        return key_run.reshape(shape)[lo:hi], value_run.reshape(shape)[lo:hi]
    ids = np.array(plan.block_ids, np.intp)
    key_run, value_run = _take(keys, values, ids, scratch)
    shape = (len(ids) * block_size, num_kv_heads, head_dim)
    return key_run.reshape(shape)[lo:hi], value_run.reshape(shape)[lo:hi]


def _take(keys: Array, values: Array, rows: npt.NDArray[np.intp], scratch: Scratch) -> tuple[Array, Array]:
    """Rows ``rows`` (blocks or tokens) of ``keys``/``values`` into scratch, in order."""
    shape = (len(rows), *keys.shape[1:])
    size = math.prod(shape)
    scratch_keys, scratch_values = scratch.take(size)
    key_out = scratch_keys[:size].reshape(shape)
    value_out = scratch_values[:size].reshape(shape)
    # NOTE: mode="clip" skips the bounds check that makes the default
    # mode="raise" buffer the whole result when out= is given; ``gather``
    # checked the plan, so the rows are in range.
    np.take(keys, rows, axis=0, out=key_out, mode="clip")
    np.take(values, rows, axis=0, out=value_out, mode="clip")
    return key_out, value_out
