"""The shared pool: a block allocator paired with the arrays its block ids index.

Storage layout (chosen from measurements, see ``docs/design.md``)::

    keys[layer]    (num_kv_heads, num_blocks, block_size, head_dim)
    values[layer]  (num_kv_heads, num_blocks, block_size, head_dim)

Head-major across the whole pool: for one head, consecutive block ids are
consecutive memory. A block table whose ids form one run (``7, 8, 9``) is
therefore readable as a ``(num_kv_heads, num_tokens, head_dim)`` view with each
head's tokens contiguous, and attention runs on it without copying a byte.
Any other table is gathered into a reusable scratch buffer first.

    head 0 plane:  | blk 0 | blk 1 | blk 2 | ... each blk = block_size x head_dim
    head 1 plane:  | blk 0 | blk 1 | blk 2 | ...
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.allocator import BlockAllocator
from pagedkv.block_table import BlockTable
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.quantization import (
    QuantizedTokens,
    StorageFormat,
    Tokens,
    check_storage_dtype,
    run_tokens,
    storage_format,
    take_tokens,
    write_tokens,
)

__all__ = ["SUPPORTED_DTYPES", "KVPool"]

#: One side of a layer's storage: floats or codes, scales or None, format or None.
_Side = tuple[npt.NDArray[Any], "npt.NDArray[np.floating] | None", "StorageFormat | None"]

#: Storage dtypes a float pool accepts (quantized storage is a separate option).
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def storage_dtype(dtype: object) -> np.dtype[np.floating]:
    """Validate a float storage dtype (float32 or float64) and return it."""
    try:
        resolved = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as error:
        raise InputTypeError(f"dtype must be float32 or float64, got {dtype!r}") from error
    if resolved not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype must be float32 or float64, got {resolved}")
    return resolved  # type: ignore[no-any-return]


class KVPool:
    """A fixed number of blocks shared by any number of caches or sequences.

    Every layer's storage is indexed by the same block ids (as in vLLM): a
    sequence's one block table serves all layers.

    Invariants:
        * the allocator's invariants hold;
        * each block's ref count equals the number of block tables, across every
          cache attached to this pool, that hold it;
        * key and value arrays have shape
          ``(num_kv_heads, num_blocks, block_size, head_dim)`` for every layer.

    >>> pool = KVPool(8, block_size=4, head_dim=2)
    >>> pool.num_free_blocks, pool.keys(0).shape
    (8, (1, 8, 4, 2))
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int = 16,
        num_kv_heads: int = 1,
        head_dim: int,
        num_layers: int = 1,
        dtype: npt.DTypeLike = np.float64,
        growable: bool = False,
        key_dtype: str | None = None,
        value_dtype: str | None = None,
    ) -> None:
        """Create a pool of ``num_blocks`` free blocks.

        Args:
            num_blocks: blocks in the pool; a fixed pool never grows.
            block_size: token slots per block.
            num_kv_heads: key/value heads stored per token.
            head_dim: values per head.
            num_layers: layers whose storage the block ids index.
            dtype: float32 or float64.
            growable: let the pool double when it runs out (used by the private
                pool of a standalone ``KVCache``; block ids stay valid).
            key_dtype: how keys are stored: None (in ``dtype``, the default),
                ``"int8"`` or ``"float8_e4m3"`` (see :mod:`pagedkv.quantization`);
                ``dtype`` stays the compute dtype.
            value_dtype: the same for values.

        Raises:
            ConfigError, InputTypeError: a size is not a positive int, or the
                dtype is not float32/float64, or a storage dtype is unknown.
            ImportError: ``"float8_e4m3"`` without ml_dtypes (the ``fp8`` extra).
        """
        self.block_size = _positive_int("block_size", block_size)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.num_layers = _positive_int("num_layers", num_layers)
        num_blocks = _positive_int("num_blocks", num_blocks)
        self.dtype = storage_dtype(dtype)
        self.growable = growable
        #: Storage dtype names of keys and values (None: unquantized, in ``dtype``).
        self.key_dtype = check_storage_dtype("key_dtype", key_dtype)
        self.value_dtype = check_storage_dtype("value_dtype", value_dtype)
        self._key_format = storage_format(self.key_dtype, self.head_dim) if self.key_dtype else None
        self._value_format = storage_format(self.value_dtype, self.head_dim) if self.value_dtype else None
        #: Whether keys or values are quantized (attention then runs the chunked kernel).
        self.quantized = self._key_format is not None or self._value_format is not None
        self.allocator = BlockAllocator(num_blocks)
        shape = (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)
        # np.zeros maps fresh zero pages lazily: untouched blocks cost no memory.
        key_store = self._key_format.code_dtype if self._key_format else self.dtype
        value_store = self._value_format.code_dtype if self._value_format else self.dtype
        self._keys = [np.zeros(shape, key_store) for _ in range(self.num_layers)]
        self._values = [np.zeros(shape, value_store) for _ in range(self.num_layers)]
        # Scales (num_kv_heads, num_blocks, block_size, num_groups) per quantized side and layer.
        self._key_scales = self._new_scales(self._key_format, num_blocks)
        self._value_scales = self._new_scales(self._value_format, num_blocks)
        self._scratch_keys = np.empty(0, self.dtype)
        self._scratch_values = np.empty(0, self.dtype)
        # Objects holding block tables on this pool, for ``check_invariants``.
        # Weak, so a cache dropped without close() can be collected and its
        # finalizer can give its blocks back.
        self._owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    # ---------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, free and used."""
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free right now."""
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a ref count of at least one."""
        return self.allocator.num_used_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks could be taken now (a growable pool always can)."""
        return self.growable or self.allocator.can_allocate(num_blocks)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of keys and values one block holds across all layers (scales included)."""
        return self.block_size * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes: keys and values of every layer, quantization scales included.

        >>> KVPool(1, head_dim=128, num_kv_heads=8, dtype=np.float32).bytes_per_token
        8192
        >>> KVPool(1, head_dim=128, num_kv_heads=8, dtype=np.float32, key_dtype="int8",
        ...        value_dtype="int8").bytes_per_token
        2304
        """
        total = 0
        for storage in (self._key_format, self._value_format):
            per_head = storage.bytes_per_head(self.dtype) if storage else self.head_dim * self.dtype.itemsize
            total += self.num_kv_heads * per_head
        return self.num_layers * total

    @property
    def key_format(self) -> StorageFormat | None:
        """How keys are quantized, or None when they are stored as floats."""
        return self._key_format

    @property
    def value_format(self) -> StorageFormat | None:
        """How values are quantized, or None when they are stored as floats."""
        return self._value_format

    def key_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key scales ``(num_kv_heads, num_blocks, block_size, num_groups)`` (a view).

        Raises:
            ConfigError: keys are not quantized.
        """
        if not self._key_scales:
            raise ConfigError("keys are not quantized in this pool; there are no scales")
        return self._key_scales[layer]

    def value_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value scales, shaped like ``key_scales``.

        Raises:
            ConfigError: values are not quantized.
        """
        if not self._value_scales:
            raise ConfigError("values are not quantized in this pool; there are no scales")
        return self._value_scales[layer]

    def keys(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage ``(num_kv_heads, num_blocks, block_size, head_dim)`` (a view).

        With ``key_dtype`` set these are the codes; ``key_scales`` holds the scales.
        """
        return self._keys[layer]

    def values(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value storage, shaped like ``keys`` (a view)."""
        return self._values[layer]

    def gather(
        self, layer: int, table: BlockTable
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The keys and values ``table`` holds, as ``(num_kv_heads, num_tokens, head_dim)``.

        Returns a view of the storage when the table's blocks are one run of
        consecutive ids; otherwise a view of this pool's scratch buffer, which
        the next ``gather`` overwrites. Read it before gathering again.

        A quantized pool returns new arrays of the dequantized values of the
        table's tokens (attention reads ``gather_quantized`` instead).
        """
        if self.quantized:
            return self._dequantized(self.gather_quantized(layer, table))
        keys, values = self._keys[layer], self._values[layer]
        bs = self.block_size
        ranges = table.live_ranges()
        if not ranges:
            empty = np.empty((self.num_kv_heads, 0, self.head_dim), self.dtype)
            return empty, empty
        num_sink_held = table.num_blocks - table.num_window_blocks
        if len(ranges) == 1 and ranges[0][0] >= table.num_sink_tokens:
            start, end = ranges[0]
            offset = num_sink_held * bs + start - table.first_block_index * bs
            if table.is_one_run:
                first_id, num_held = table.first_window_id, table.num_blocks
                shape = (self.num_kv_heads, num_held * bs, self.head_dim)
                key_run = keys[:, first_id : first_id + num_held].reshape(shape)
                value_run = values[:, first_id : first_id + num_held].reshape(shape)
            else:
                key_run, value_run = self._take_blocks(keys, values, table.block_ids)
            return key_run[:, offset : offset + end - start], value_run[:, offset : offset + end - start]
        # Sinks in front of a window: gather token by token.
        block_ids = np.array(table.block_ids, np.intp)
        flat_slots = (block_ids[:, None] * bs + np.arange(bs)).ravel()
        positions = []
        for start, end in ranges:
            if start < table.num_sink_tokens:
                positions.append(np.arange(start, end))
            else:
                base = num_sink_held * bs - table.first_block_index * bs
                positions.append(np.arange(start + base, end + base))
        return self._take(keys, values, flat_slots[np.concatenate(positions)])

    def gather_slots(
        self, layer: int, slots: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """Keys and values at ``slots`` as ``(num_kv_heads, len(slots), head_dim)`` (scratch view).

        A quantized pool returns new arrays of the dequantized values.
        """
        if self.quantized:
            return self._dequantized(self.gather_slots_quantized(layer, slots))
        return self._take(self._keys[layer], self._values[layer], slots)

    def gather_quantized(self, layer: int, table: BlockTable) -> tuple[Tokens, Tokens]:
        """The keys and values ``table`` holds, in logical order, as stored.

        Each side is a float array ``(num_kv_heads, num_tokens, head_dim)``, or
        :class:`~pagedkv.quantization.QuantizedTokens` (codes and scales) when
        that side is quantized. Views of the storage when the table's blocks are
        one run of consecutive ids, new arrays otherwise. Nothing is dequantized.
        """
        ranges = table.live_ranges()
        if len(ranges) == 1 and ranges[0][0] >= table.num_sink_tokens and table.is_one_run:
            bs = self.block_size
            start, end = ranges[0]
            lo = start - table.first_block_index * bs
            first_id, num_held = table.first_window_id, table.num_blocks
            hi = lo + end - start
            key_side, value_side = self._sides(layer)
            return (
                run_tokens(*key_side, first_id, num_held, lo, hi),
                run_tokens(*value_side, first_id, num_held, lo, hi),
            )
        return self.gather_slots_quantized(layer, self._table_slots(table, ranges))

    def gather_slots_quantized(self, layer: int, slots: npt.NDArray[np.intp]) -> tuple[Tokens, Tokens]:
        """Keys and values at ``slots``, as stored (see ``gather_quantized``); new arrays."""
        key_side, value_side = self._sides(layer)
        return take_tokens(*key_side, slots), take_tokens(*value_side, slots)

    # --------------------------------------------------------------- commands

    def write(
        self,
        layer: int,
        slots: npt.NDArray[np.intp],
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
    ) -> None:
        """Store ``keys``/``values`` ``(n, num_kv_heads, head_dim)`` at ``n`` slots (quantizing them)."""
        flat = (self.num_kv_heads, self.num_blocks * self.block_size, self.head_dim)
        if self.quantized:
            key_side, value_side = self._sides(layer)
            write_tokens(*key_side, slots, keys)
            write_tokens(*value_side, slots, values)
            return
        self._keys[layer].reshape(flat)[:, slots] = keys.transpose(1, 0, 2)
        self._values[layer].reshape(flat)[:, slots] = values.transpose(1, 0, 2)

    def write_one(
        self,
        layer: int,
        block_id: int,
        offset: int,
        key: npt.NDArray[np.floating],
        value: npt.NDArray[np.floating],
    ) -> None:
        """Store one token's ``key``/``value`` ``(num_kv_heads, head_dim)`` (quantizing them)."""
        if self.quantized:
            slot = np.array([block_id * self.block_size + offset], np.intp)
            self.write(layer, slot, key[None], value[None])
            return
        self._keys[layer][:, block_id, offset] = key
        self._values[layer][:, block_id, offset] = value

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copy every layer's contents of ``sources`` into ``destinations``."""
        for layer in range(self.num_layers):
            self._keys[layer][:, destinations] = self._keys[layer][:, sources]
            self._values[layer][:, destinations] = self._values[layer][:, sources]
        self.copy_block_scales(sources, destinations)

    def copy_block_scales(
        self, sources: list[int], destinations: list[int], target: KVPool | None = None
    ) -> None:
        """Copy the scales of ``sources`` into ``destinations`` of ``target`` (default: this pool).

        Does nothing when neither side is quantized. Code that moves a quantized
        pool's codes itself (``keys(layer)[:, ids] = ...``) calls this too.
        """
        into = self if target is None else target
        for mine, theirs in ((self._key_scales, into._key_scales), (self._value_scales, into._value_scales)):
            for layer, scales in enumerate(mine):
                theirs[layer][:, destinations] = scales[:, sources]

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` blocks (ids after the existing ones stay valid).

        Raises:
            ConfigError: the pool is fixed (``growable=False``).
        """
        if not self.growable:
            raise ConfigError(f"this pool has a fixed size of {self.num_blocks} blocks; it never grows")
        old = self.num_blocks
        self.allocator.grow(num_new_blocks)
        shape = (self.num_kv_heads, old + num_new_blocks, self.block_size, self.head_dim)
        for arrays in (self._keys, self._values, self._key_scales, self._value_scales):
            for layer, array in enumerate(arrays):
                bigger = np.zeros((*shape[:3], array.shape[3]), array.dtype)  # scales: last dim num_groups
                bigger[:, :old] = array
                arrays[layer] = bigger

    def attach(self, owner: object) -> None:
        """Register an object with ``_held_block_ids()`` so invariants can count its tables.

        The pool keeps only a weak reference: the owner must keep itself alive.
        """
        self._owners[id(owner)] = owner

    def detach(self, owner: object) -> None:
        """Forget an owner registered with ``attach`` (it holds no blocks any more)."""
        self._owners.pop(id(owner), None)

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant in the class docstring is broken."""
        self.allocator.check_invariants()
        held = [0] * self.num_blocks
        for owner in self._owners.values():
            for block_id in owner._held_block_ids():
                held[block_id] += 1
        for block_id, count in enumerate(held):
            ref_count = self.allocator.ref_count(block_id)
            if count != ref_count:
                raise AssertionError(
                    f"block {block_id} has ref count {ref_count} but {count} block tables hold it"
                )
        shape = (self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)
        for array in self._keys + self._values:
            if array.shape != shape:
                raise AssertionError(f"storage shape {array.shape}, expected {shape}")
        sides = ((self._key_format, self._key_scales), (self._value_format, self._value_scales))
        for storage, scales in sides:
            expected = [] if storage is None else [(*shape[:3], storage.num_groups)] * self.num_layers
            if [array.shape for array in scales] != expected:
                raise AssertionError(f"scale shapes {[a.shape for a in scales]}, expected {expected}")

    # ---------------------------------------------------------------- private

    def _take(
        self,
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
        slots: npt.NDArray[np.intp],
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        num = len(slots)
        size = self.num_kv_heads * num * self.head_dim
        self._reserve_scratch(size)
        shape = (self.num_kv_heads, num, self.head_dim)
        key_out = self._scratch_keys[:size].reshape(shape)
        value_out = self._scratch_values[:size].reshape(shape)
        flat = (self.num_kv_heads, self.num_blocks * self.block_size, self.head_dim)
        # NOTE: mode="clip" skips the bounds check that makes the default
        # mode="raise" buffer the whole result when out= is given; slots come
        # from block tables this pool validated, so they are in range.
        np.take(keys.reshape(flat), slots, axis=1, out=key_out, mode="clip")
        np.take(values.reshape(flat), slots, axis=1, out=value_out, mode="clip")
        return key_out, value_out

    def _take_blocks(
        self,
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
        block_ids: list[int],
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """Gather whole blocks into scratch, as ``(num_kv_heads, len(block_ids) * block_size, head_dim)``."""
        num = len(block_ids)
        bs = self.block_size
        size = self.num_kv_heads * num * bs * self.head_dim
        self._reserve_scratch(size)
        shape = (self.num_kv_heads, num, bs, self.head_dim)
        key_out = self._scratch_keys[:size].reshape(shape)
        value_out = self._scratch_values[:size].reshape(shape)
        ids = np.array(block_ids, np.intp)
        np.take(keys, ids, axis=1, out=key_out, mode="clip")
        np.take(values, ids, axis=1, out=value_out, mode="clip")
        flat = (self.num_kv_heads, num * bs, self.head_dim)
        return key_out.reshape(flat), value_out.reshape(flat)

    def _new_scales(self, storage: StorageFormat | None, num_blocks: int) -> list[npt.NDArray[np.floating]]:
        if storage is None:
            return []
        shape = (self.num_kv_heads, num_blocks, self.block_size, storage.num_groups)
        return [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]

    def _table_slots(self, table: BlockTable, ranges: list[tuple[int, int]]) -> npt.NDArray[np.intp]:
        """Slots of the held logical indices in ``ranges``, in order (as ``gather``'s sink path)."""
        bs = self.block_size
        if not ranges:
            return np.empty(0, np.intp)
        block_ids = np.array(table.block_ids, np.intp)
        flat_slots = (block_ids[:, None] * bs + np.arange(bs)).ravel()
        num_sink_held = table.num_blocks - table.num_window_blocks
        base = num_sink_held * bs - table.first_block_index * bs
        positions = [
            np.arange(start, end) if start < table.num_sink_tokens else np.arange(start + base, end + base)
            for start, end in ranges
        ]
        slots: npt.NDArray[np.intp] = flat_slots[np.concatenate(positions)]
        return slots

    def _sides(self, layer: int) -> tuple[_Side, _Side]:
        """``(storage, scales or None, format or None)`` of layer ``layer``'s keys and of its values."""
        key_scales = self._key_scales[layer] if self._key_scales else None
        value_scales = self._value_scales[layer] if self._value_scales else None
        return (
            (self._keys[layer], key_scales, self._key_format),
            (self._values[layer], value_scales, self._value_format),
        )

    def _dequantized(
        self, sides: tuple[Tokens, Tokens]
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        def floats(side: Tokens) -> npt.NDArray[np.floating]:
            if isinstance(side, QuantizedTokens):
                return side.dequantize(0, side.shape[1], self.dtype)
            return np.array(side)
        return floats(sides[0]), floats(sides[1])

    def _reserve_scratch(self, size: int) -> None:
        if self._scratch_keys.size < size:
            capacity = max(size, 2 * self._scratch_keys.size)
            self._scratch_keys = np.empty(capacity, self.dtype)
            self._scratch_values = np.empty(capacity, self.dtype)

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_layers={self.num_layers}, dtype={self.dtype}, "
            + (f"key_dtype={self.key_dtype}, value_dtype={self.value_dtype}, " if self.quantized else "")
            + f"num_free_blocks={self.num_free_blocks})"
        )
