"""Executing a read plan on float pages: a view for a run of blocks, a gather into scratch otherwise.

A pool's layer is ``(num_kv_heads, num_blocks, block_size, head_dim)``,
head-major, so the blocks of a run (``7, 8, 9``) are, for each head, one
stretch of memory: reshaped, they are the tokens, without copying. Any other
plan is copied into scratch with ``np.take``::

    run (7, 8, 9):     keys[:, 7:10] -> reshape (H, 3 * block_size, d) -> [offset : offset + n]
    blocks (7, 3):     np.take(keys, [7, 3], axis=1, out=scratch)       -> [offset : offset + n]
    slots [30, 12]:    np.take(keys.reshape(H, -1, d), [30, 12], axis=1, out=scratch)

Scratch is per thread (``threading.local``): a gather's result is valid until
the same thread's next gather of the same :class:`Scratch`, and two threads
never share one.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from pagedkv.read_plan import ReadPlan

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
            local.keys = np.empty(capacity, self.dtype)
            local.values = np.empty(capacity, self.dtype)
        return local.keys, local.values


def gather(keys: Array, values: Array, plan: ReadPlan, scratch: Scratch) -> tuple[Array, Array]:
    """The tokens ``plan`` reads from one layer's ``keys``/``values``, as ``(H, plan.num_tokens, d)``.

    Views of the storage for a run, views of this thread's ``scratch`` otherwise.
    """
    num_kv_heads, _, block_size, head_dim = keys.shape
    if plan.slots is not None:
        return _take_slots(keys, values, plan.slots, scratch)
    if not plan.num_tokens:
        empty = np.empty((num_kv_heads, 0, head_dim), keys.dtype)
        return empty, empty
    lo, hi = plan.offset, plan.offset + plan.num_tokens
    if plan.is_run:
        first, num = plan.block_ids[0], len(plan.block_ids)
        shape = (num_kv_heads, num * block_size, head_dim)
        key_run = keys[:, first : first + num].reshape(shape)
        value_run = values[:, first : first + num].reshape(shape)
        return key_run[:, lo:hi], value_run[:, lo:hi]
    key_run, value_run = _take_blocks(keys, values, plan.block_ids, scratch)
    return key_run[:, lo:hi], value_run[:, lo:hi]


def _take_slots(
    keys: Array, values: Array, slots: npt.NDArray[np.intp], scratch: Scratch
) -> tuple[Array, Array]:
    num_kv_heads, num_blocks, block_size, head_dim = keys.shape
    num = len(slots)
    size = num_kv_heads * num * head_dim
    scratch_keys, scratch_values = scratch.take(size)
    shape = (num_kv_heads, num, head_dim)
    key_out = scratch_keys[:size].reshape(shape)
    value_out = scratch_values[:size].reshape(shape)
    flat = (num_kv_heads, num_blocks * block_size, head_dim)
    # NOTE: mode="clip" skips the bounds check that makes the default
    # mode="raise" buffer the whole result when out= is given; slots come
    # from block tables the pool validated, so they are in range.
    np.take(keys.reshape(flat), slots, axis=1, out=key_out, mode="clip")
    np.take(values.reshape(flat), slots, axis=1, out=value_out, mode="clip")
    return key_out, value_out


def _take_blocks(
    keys: Array, values: Array, block_ids: tuple[int, ...], scratch: Scratch
) -> tuple[Array, Array]:
    """Whole blocks into scratch, as ``(H, len(block_ids) * block_size, d)``."""
    num_kv_heads, _, block_size, head_dim = keys.shape
    num = len(block_ids)
    size = num_kv_heads * num * block_size * head_dim
    scratch_keys, scratch_values = scratch.take(size)
    shape = (num_kv_heads, num, block_size, head_dim)
    key_out = scratch_keys[:size].reshape(shape)
    value_out = scratch_values[:size].reshape(shape)
    ids = np.array(block_ids, np.intp)
    np.take(keys, ids, axis=1, out=key_out, mode="clip")
    np.take(values, ids, axis=1, out=value_out, mode="clip")
    flat = (num_kv_heads, num * block_size, head_dim)
    return key_out.reshape(flat), value_out.reshape(flat)
