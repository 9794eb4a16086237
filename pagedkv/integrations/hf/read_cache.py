"""Storage mode's read cache: each layer's visible keys and values, contiguous, appended in place.

One growing buffer per storing layer, fed by each step's new keys, hands out narrow
views, so transformers' attention reads one tensor without a gather from the pages
each step. The pool stays the source of truth; a returned tensor is never written
again (append-only; a rewrite makes a new buffer). docs/integrations.md ("Storage
mode's read cache") states the rule and the memory cost.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.integrations.hf.extra import require
from pagedkv.integrations.hf.tensors import Tensor, raw_array
from pagedkv.manager.hybrid import HybridKVCacheManager, locate
from pagedkv.manager.manager import KVCacheManager

__all__ = ["LayerBuffer", "read_rows"]

#: The smallest buffer allocated, in token positions.
MIN_CAPACITY = 64


def read_rows(
    manager: KVCacheManager | HybridKVCacheManager,
    seq_ids: Sequence[Hashable],
    pool_layer: int,
    start: int,
    end: int,
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Every row's keys and values ``start .. end - 1`` of one pool layer, gathered into new arrays.

    ``pool_layer`` is a layer of the manager: of a hybrid one, a model layer its group holds.

    Returns:
        ``(keys, values)``, each ``(rows, kv_heads, end - start, head_dim)``, new
        arrays (the pool's views and scratch are copied here; ``torch.from_numpy``
        shares them without a copy).

    >>> from pagedkv import KVPool
    >>> manager = KVCacheManager(KVPool(4, block_size=2, head_dim=1))
    >>> manager.add_sequence("s")  # no prefix cached
    0
    >>> batch = manager.reserve({"s": 3})
    >>> manager.write(0, batch, np.arange(3.0).reshape(3, 1, 1), np.zeros((3, 1, 1)))
    >>> read_rows(manager, ["s"], 0, 1, 3)[0].flatten().tolist()
    [1.0, 2.0]
    """
    pool = manager.pool
    group, layer = locate(manager, pool_layer)
    shape = (len(seq_ids), pool.num_kv_heads, end - start, pool.head_dim)  # (rows, heads, seq, head_dim)
    keys, values = np.empty(shape, pool.dtype), np.empty(shape, pool.dtype)
    for row, seq_id in enumerate(seq_ids):
        plan = group.block_table(seq_id).read_plan([(start, end)])
        keys[row], values[row] = pool.gather(layer, plan)  # (heads, seq, head_dim) views or scratch
    return keys, values


class LayerBuffer:
    """One layer's keys and values for every row, columns ``start .. end - 1``, in one growing tensor.

    Invariants:
        * empty (no tensors) or ``0 <= start <= end``, with ``end - start`` at
          most the tensors' capacity (their dimension 2);
        * the two tensors have one shape ``(rows, kv_heads, capacity, head_dim)``;
        * positions ``end - start ..`` of the tensors were never handed out;
        * the numpy arrays appends write through are the tensors' own memory
          (a bfloat16 tensor's as its int16 bits: numpy has no bfloat16).

    Filled from the pool (``fill``, arrays or tensors), then fed each step's
    new columns (``append``, tensors); see ``tests/integrations/test_integration_transformers.py``.

    >>> buffer = LayerBuffer()
    >>> buffer.is_empty, buffer.start, buffer.end  # nothing held until filled
    (True, 0, 0)
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (rows, kv_heads, capacity, head_dim)
        self.values: Tensor | None = None
        # The same memory as numpy arrays: appends are numpy copies (see ``append``).
        self._key_array: npt.NDArray[Any] | None = None
        self._value_array: npt.NDArray[Any] | None = None
        #: The column held at buffer position 0.
        self.start = 0
        #: One past the last column held.
        self.end = 0

    @property
    def is_empty(self) -> bool:
        """Whether the buffer holds nothing (it must be filled from the pool before appending)."""
        return self.keys is None

    def clear(self) -> None:
        """Forget everything; views handed out stay valid (their tensor is never written again)."""
        self.keys = self.values = None
        self._key_array = self._value_array = None
        self.start = self.end = 0

    def fill(self, keys: Tensor, values: Tensor, start: int) -> None:
        """Hold ``keys``/``values`` ``(rows, heads, seq, head_dim)`` from column ``start`` (a new buffer)."""
        torch = require("torch")
        self._reallocate(torch.as_tensor(keys), torch.as_tensor(values), start, extra=0)

    def append(self, keys: Tensor, values: Tensor, keep_from: int) -> tuple[Tensor, Tensor]:
        """Add the next columns ``(rows, heads, new, head_dim)``; return views of ``keep_from .. end``.

        Columns before ``keep_from`` are no longer needed (a window slid past
        them); they may be dropped when the buffer next grows.

        NOTE: the columns are copied by numpy (``Tensor.numpy`` of both sides;
        the buffer's made once per buffer): cheaper per call than torch's
        slicing and ``copy_``, and the same bytes.

        Returns:
            Views of the buffer, valid and unchanged for as long as they are held.
        """
        assert self.keys is not None and self.values is not None and self.start <= keep_from <= self.end
        num_new = keys.shape[2]
        used = self.end - self.start
        if used + num_new > self.keys.shape[2]:
            self._reallocate(self.keys[:, :, keep_from - self.start : used],
                             self.values[:, :, keep_from - self.start : used], keep_from, extra=num_new)
            used = self.end - self.start
        assert self._key_array is not None and self._value_array is not None
        self._key_array[:, :, used : used + num_new] = raw_array(keys)
        self._value_array[:, :, used : used + num_new] = raw_array(values)
        self.end += num_new
        lo, hi = keep_from - self.start, self.end - self.start
        return self.keys[:, :, lo:hi], self.values[:, :, lo:hi]

    def select(self, sources: Sequence[int]) -> None:
        """Row ``i`` becomes old row ``sources[i]``, in a new buffer (beam search, batch surgery)."""
        if self.keys is None or self.values is None:
            return
        index = require("torch").tensor(list(sources), dtype=require("torch").long)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self._key_array, self._value_array = raw_array(self.keys), raw_array(self.values)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if self.keys is None or self.values is None:
            if self.keys is not None or self.values is not None or (self.start, self.end) != (0, 0):
                raise AssertionError(f"half-empty buffer, columns {self.start} .. {self.end}")
            return
        if self.keys.shape != self.values.shape:
            raise AssertionError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)}")
        if not 0 <= self.start <= self.end <= self.start + self.keys.shape[2]:
            raise AssertionError(f"columns {self.start} .. {self.end} in capacity {self.keys.shape[2]}")
        for tensor, array in ((self.keys, self._key_array), (self.values, self._value_array)):
            if array is None or array.ctypes.data != tensor.data_ptr() or array.shape != tuple(tensor.shape):
                raise AssertionError("the buffer's numpy array is not its tensor's memory")

    def _reallocate(self, keys: Tensor, values: Tensor, start: int, extra: int) -> None:
        """A new buffer holding ``keys``/``values`` from column ``start``, room for twice ``seq + extra``."""
        rows, heads, num_held, head_dim = keys.shape
        capacity = max(MIN_CAPACITY, 2 * (num_held + extra))
        torch = require("torch")
        new_keys = torch.empty((rows, heads, capacity, head_dim), dtype=keys.dtype)
        new_values = torch.empty((rows, heads, capacity, head_dim), dtype=values.dtype)
        new_keys[:, :, :num_held].copy_(keys)
        new_values[:, :, :num_held].copy_(values)
        self.keys, self.values = new_keys, new_values
        self._key_array, self._value_array = raw_array(new_keys), raw_array(new_values)
        self.start, self.end = start, start + num_held
