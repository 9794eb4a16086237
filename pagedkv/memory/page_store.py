"""A pool's pages: the key and value arrays of every layer, their scales, and reads and writes by slot.

Storage layout (chosen from measurements, see ``docs/paging.md``)::

    key_pages(layer)    (num_blocks, block_size, num_kv_heads, head_dim)
    value_pages(layer)  (num_blocks, block_size, num_kv_heads, head_dim)

Token-major: one block of one side of one layer is one stretch of memory
(64 KiB at 16 x 8 x 128 x float32, sixteen 4 KiB pages)::

    storage:  | blk 0: t0 (H x d) t1 ... | blk 1: ... | blk 2: ... |

``keys(layer)`` / ``values(layer)`` (and ``key_scales`` / ``value_scales``)
are head-major views of the same memory, ``(num_kv_heads, num_blocks,
block_size, head_dim)``, for code written against the earlier layout
(snapshots store that order).

:class:`PageStore` knows block ids, slots and arrays only; which blocks are
free, and which tables hold them, is :class:`~pagedkv.memory.pool.KVPool`'s business
(a ``KVPool`` is a ``PageStore`` plus an allocator and page views).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.read_plan import ReadPlan
from pagedkv.counts import check_layer
from pagedkv.errors import ConfigError
from pagedkv.memory.gather import Scratch, gather
from pagedkv.memory.pages import PageArrays, new_page_arrays
from pagedkv.memory.pool_sides import run_tokens, take_tokens, write_blocks, write_tokens
from pagedkv.memory.quantization import QuantizedTokens, StorageFormat, Tokens, storage_format

__all__ = ["PageStore"]

#: One side of a layer's storage: floats or codes, scales or None, format or None.
_Side = tuple[npt.NDArray[Any], "npt.NDArray[np.floating] | None", "StorageFormat | None"]


class PageStore:
    """The pages of a pool: keys, values and scales per layer, indexed by block id.

    Invariants (checked by ``_check_pages``):
        * key and value pages have shape
          ``(num_blocks, block_size, num_kv_heads, head_dim)`` for every layer;
        * a side stored with scales has ``(num_blocks, block_size,
          num_kv_heads, num_groups)`` scales per layer, any other side none;
        * unquantized, ``_token_rows[layer]`` are ``(num_slots, H * d)`` views
          of that layer's current key and value pages (``write_token`` copies
          into them), rebuilt whenever the pages are replaced.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: np.dtype[Any],
        key_dtype: str | None,
        value_dtype: str | None,
        in_file: bool,
        views_required: bool = False,
    ) -> None:
        """Zeroed pages for ``num_blocks`` blocks (arguments already validated by ``KVPool``).

        ``in_file`` puts float pages in a page file, falling back to plain
        arrays, or raising ``ConfigError`` when ``views_required``.

        Raises:
            ConfigError: ``views_required`` and no page file could be made.
            MemoryError, ValueError, OverflowError: the arrays cannot be allocated.
        """
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        #: The shape of one token's keys (or values) for ``write``: ``(1, num_kv_heads, head_dim)``.
        self.token_shape = (1, num_kv_heads, head_dim)
        self.dtype = dtype
        #: Storage dtype names of keys and values (None: stored in ``dtype``).
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self._key_format = storage_format(key_dtype, head_dim) if key_dtype else None
        self._value_format = storage_format(value_dtype, head_dim) if value_dtype else None
        #: Whether keys or values are stored as codes (attention then runs the chunked kernel).
        self.quantized = self._key_format is not None or self._value_format is not None
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_store = self._key_format.code_dtype if self._key_format else dtype
        value_store = self._value_format.code_dtype if self._value_format else dtype
        self._pages: PageArrays = new_page_arrays(num_layers, shape, key_store, value_store, in_file,
                                                  views_required)
        self._keys, self._values = self._pages.keys, self._pages.values
        self._token_rows = self._flat_rows()
        # Scales (num_blocks, block_size, num_kv_heads, num_groups) per scaled side and layer.
        self._key_scales = self._new_scales(self._key_format, num_blocks)
        self._value_scales = self._new_scales(self._value_format, num_blocks)
        # NOTE: one scratch pair per thread, so caches (or sequences) used from
        # different threads never overwrite each other's gathered keys.
        self._scratch = Scratch(dtype)

    # ---------------------------------------------------------------- queries

    @property
    def bytes_per_block(self) -> int:
        """Bytes of keys and values one block holds across all layers (scales included)."""
        return self.block_size * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes: keys and values of every layer, quantization scales included.

        >>> from pagedkv.memory.pool import KVPool
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
        """How keys are stored as codes, or None when they are stored in ``dtype``."""
        return self._key_format

    @property
    def value_format(self) -> StorageFormat | None:
        """How values are stored as codes, or None when they are stored in ``dtype``."""
        return self._value_format

    def key_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key scales ``(num_kv_heads, num_blocks, block_size, num_groups)`` (a view).

        Head-major, like ``keys``; the storage is token-major. Zero-width
        (``num_groups == 0``) for float16 and bfloat16 keys.

        Raises:
            ConfigError: keys are stored unquantized.
        """
        return self._scale_heads(self._key_scales, "keys", self.key_dtype, layer)

    def value_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value scales, shaped like ``key_scales``.

        Raises:
            ConfigError: values are stored unquantized.
        """
        return self._scale_heads(self._value_scales, "values", self.value_dtype, layer)

    def _scale_heads(
        self, scales: list[npt.NDArray[np.floating]], side: str, stored: str | None, layer: int
    ) -> npt.NDArray[np.floating]:
        """One side's scales of ``layer`` as a head-major view, or a ConfigError when it has none."""
        if not scales:
            raise ConfigError(
                f"{side} are not quantized in this pool (stored as {stored or self.dtype}); "
                "there are no scales"
            )
        heads: npt.NDArray[np.floating] = scales[check_layer(layer, self.num_layers)].transpose(2, 0, 1, 3)
        return heads

    def key_pages(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage ``(num_blocks, block_size, num_kv_heads, head_dim)`` (a view).

        With ``key_dtype`` set these are the codes.

        >>> from pagedkv.memory.pool import KVPool
        >>> KVPool(3, block_size=2, num_kv_heads=4, head_dim=5).key_pages(0).shape
        (3, 2, 4, 5)
        """
        return self._keys[check_layer(layer, self.num_layers)]

    def value_pages(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value storage, shaped like ``key_pages`` (a view)."""
        return self._values[check_layer(layer, self.num_layers)]

    def keys(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage as ``(num_kv_heads, num_blocks, block_size, head_dim)`` (a view).

        The head-major order of the earlier layout, over the same memory as
        ``key_pages`` (writes through it land in the pool). With ``key_dtype``
        set these are the codes; ``key_scales`` holds the scales.
        """
        heads: npt.NDArray[np.floating] = self.key_pages(layer).transpose(2, 0, 1, 3)
        return heads

    def values(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value storage, shaped like ``keys`` (a view)."""
        heads: npt.NDArray[np.floating] = self.value_pages(layer).transpose(2, 0, 1, 3)
        return heads

    def gather(
        self, layer: int, plan: ReadPlan
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The keys and values ``plan`` reads, as ``(num_kv_heads, plan.num_tokens, head_dim)``.

        Head-major views (``gather_tokens(...)`` transposed) of the storage
        when the plan's blocks are one run, of this thread's scratch buffer
        of this pool otherwise, which the thread's next gather overwrites:
        read the result before gathering again (other threads have scratch
        of their own).

        A quantized pool returns new arrays of the dequantized values
        (attention reads ``gather_quantized`` instead).

        >>> from pagedkv.blocks.table import BlockTable
        >>> from pagedkv.memory.pool import KVPool
        >>> pool = KVPool(4, block_size=2, head_dim=1)
        >>> table = BlockTable(block_size=2)
        >>> table.append(3, pool.allocator.allocate(2))
        >>> pool.gather(0, table.read_plan())[0].shape
        (1, 3, 1)
        """
        if self.quantized:
            return self._dequantized(self.gather_quantized(layer, plan))
        keys, values = self.gather_tokens(layer, plan)
        return keys.transpose(1, 0, 2), values.transpose(1, 0, 2)

    def gather_tokens(
        self, layer: int, plan: ReadPlan
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The keys and values ``plan`` reads, token-major ``(plan.num_tokens, num_kv_heads, head_dim)``.

        Float pools only. Views of the storage for a run, of this thread's
        scratch otherwise (as ``gather``).

        Raises:
            InputTypeError, LayerIndexError: ``layer`` is not an index of a layer.
            UnknownBlockError: the plan names a block past the pool's end; nothing is read.
        """
        if layer.__class__ is not int or not 0 <= layer < self.num_layers:
            layer = check_layer(layer, self.num_layers)
        return gather(self._keys[layer], self._values[layer], plan, self._scratch)

    def gather_quantized(self, layer: int, plan: ReadPlan) -> tuple[Tokens, Tokens]:
        """The keys and values ``plan`` reads, in order, as stored.

        Each side is a float array ``(num_kv_heads, num_tokens, head_dim)``, or
        :class:`~pagedkv.memory.quantization.QuantizedTokens` (codes and scales) when
        that side is quantized. Views of the storage when the plan's blocks
        are one run, new arrays otherwise. Nothing is dequantized.

        Raises:
            InputTypeError, LayerIndexError: ``layer`` is not an index of a layer.
            UnknownBlockError: the plan names a block past the pool's end; nothing is read.
        """
        layer = check_layer(layer, self.num_layers)
        key_side, value_side = self._sides(layer)
        plan.check(len(key_side[0]), self.block_size)
        if plan.slots is None and plan.is_run and plan.num_tokens:
            first, num = plan.block_ids[0], len(plan.block_ids)
            lo, hi = plan.offset, plan.offset + plan.num_tokens
            return (
                run_tokens(*key_side, first, num, lo, hi),
                run_tokens(*value_side, first, num, lo, hi),
            )
        slots = plan.slot_array(self.block_size)
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
        if self.quantized:
            key_side, value_side = self._sides(layer)
            write_tokens(*key_side, slots, keys)
            write_tokens(*value_side, slots, values)
            return
        flat = (self._keys[layer].shape[0] * self.block_size, self.num_kv_heads, self.head_dim)
        self._keys[layer].reshape(flat)[slots] = keys
        self._values[layer].reshape(flat)[slots] = values

    def write_run(
        self,
        layer: int,
        block_ids: list[int],
        offset: int,
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
    ) -> None:
        """Store ``keys``/``values`` ``(n, H, d)`` from ``offset`` in the first of ``block_ids`` on.

        ``block_ids`` are consecutive logical blocks of one table and hold
        exactly the ``n`` tokens (a :class:`~pagedkv.manager.reserve.SlotRun`): a
        prefill's write. Whole blocks are copied as blocks (one slice when
        their ids are one run, else one fancy index over blocks), which is
        several times cheaper than building and scattering ``n`` slots.
        Float pages only: a quantized pool's codes and scales are written by
        slot (``write``).
        """
        if self.quantized:
            raise ConfigError("write_run takes float pages; a quantized pool is written by slot (write)")
        for pages, tokens in ((self._keys[layer], keys), (self._values[layer], values)):
            write_blocks(pages, block_ids, offset, tokens)

    def write_one(
        self,
        layer: int,
        block_id: int,
        offset: int,
        key: npt.NDArray[np.floating],
        value: npt.NDArray[np.floating],
    ) -> None:
        """Store one token's ``key``/``value`` ``(num_kv_heads, head_dim)`` (quantizing them)."""
        self.write_token(layer, block_id * self.block_size + offset, key.reshape(-1), value.reshape(-1))

    def write_token(
        self, layer: int, slot: int, key: npt.NDArray[np.floating], value: npt.NDArray[np.floating]
    ) -> None:
        """Store one token's ``key`` and ``value`` at ``slot``, each a flat ``(num_kv_heads * head_dim,)``.

        NOTE: the decode ``write`` of every layer ends here. A flat row into
        the ``(num_slots, H * d)`` view of each side is the cheapest copy numpy
        has for one token: an ``(H, d)`` row costs about twice the
        instructions (numpy lines up the shapes first), a ``[block_id,
        offset]`` index more again. ``write`` scans the values through flat
        views anyway (``check_token_pair``), so it hands those over.
        """
        rows = self._token_rows
        if rows is None:  # quantized: codes and scales
            slots = np.array([slot], np.intp)
            shape = (1, self.num_kv_heads, self.head_dim)
            self.write(layer, slots, key.reshape(shape), value.reshape(shape))
            return
        key_rows, value_rows = rows[layer]
        key_rows[slot] = key
        value_rows[slot] = value

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copy every layer's contents of ``sources`` into ``destinations``."""
        for layer in range(self.num_layers):
            self._keys[layer][destinations] = self._keys[layer][sources]
            self._values[layer][destinations] = self._values[layer][sources]
        self.copy_block_scales(sources, destinations)

    def copy_block_scales(
        self, sources: list[int], destinations: list[int], target: PageStore | None = None
    ) -> None:
        """Copy the scales of ``sources`` into ``destinations`` of ``target`` (default: this pool).

        Does nothing when neither side has scales. Code that moves a quantized
        pool's codes itself (``keys(layer)[:, ids] = ...``) calls this too.
        """
        into = self if target is None else target
        for mine, theirs in ((self._key_scales, into._key_scales), (self._value_scales, into._value_scales)):
            for layer, scales in enumerate(mine):
                theirs[layer][destinations] = scales[sources]

    # ---------------------------------------------------------------- private

    def _grown_pages(self, num_blocks: int) -> list[list[npt.NDArray[Any]]]:
        """New zeroed arrays of every group for ``num_blocks`` blocks (nothing changes yet).

        Raises:
            MemoryError, ValueError, OverflowError: they cannot be allocated.
        """
        return [[np.zeros((num_blocks, *a.shape[1:]), a.dtype) for a in arrays] for arrays in self._groups()]

    def _adopt_pages(self, bigger: list[list[npt.NDArray[Any]]]) -> None:
        """Copy every array into its bigger one from ``_grown_pages`` and keep the bigger ones."""
        for arrays, new_arrays in zip(self._groups(), bigger):
            for layer, (array, new_array) in enumerate(zip(arrays, new_arrays)):
                new_array[: array.shape[0]] = array
                arrays[layer] = new_array
        self._token_rows = self._flat_rows()

    def _move_pages(self, block_ids: list[int]) -> None:
        """Copy the blocks ``block_ids`` to ids ``0 .. k - 1`` in that order, in every array."""
        for arrays in self._groups():
            for array in arrays:
                array[: len(block_ids)] = array[block_ids]

    def _flat_rows(self) -> list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] | None:
        """Each layer's keys and values as ``(num_slots, H * d)`` views (None when quantized)."""
        if self.quantized:
            return None
        flat = (-1, self.num_kv_heads * self.head_dim)
        return [(keys.reshape(flat), values.reshape(flat)) for keys, values in zip(self._keys, self._values)]

    def _groups(self) -> tuple[list[npt.NDArray[Any]], ...]:
        return (self._keys, self._values, self._key_scales, self._value_scales)

    def _check_pages(self, num_blocks: int) -> None:
        """Raise ``AssertionError`` if an array's shape breaks the class invariants."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for array in self._keys + self._values:
            if array.shape != shape:
                raise AssertionError(f"storage shape {array.shape}, expected {shape}")
        for layer, (key_rows, value_rows) in enumerate(self._token_rows or []):
            for rows, pages in ((key_rows, self._keys[layer]), (value_rows, self._values[layer])):
                if rows.size != pages.size or rows.ctypes.data != pages.ctypes.data:
                    raise AssertionError(f"layer {layer}'s token rows are not a view of its pages")
        sides = ((self._key_format, self._key_scales), (self._value_format, self._value_scales))
        for storage, scales in sides:
            expected = [] if storage is None else [(*shape[:3], storage.num_groups)] * self.num_layers
            if [array.shape for array in scales] != expected:
                raise AssertionError(f"scale shapes {[a.shape for a in scales]}, expected {expected}")

    def _new_scales(self, storage: StorageFormat | None, num_blocks: int) -> list[npt.NDArray[np.floating]]:
        # NOTE: a scale-free side (float16, bfloat16) keeps zero-width scales,
        # num_groups == 0: every scale-handling path (copies, growth, snapshots)
        # works on them unchanged and moves nothing.
        if storage is None:
            return []
        shape = (num_blocks, self.block_size, self.num_kv_heads, storage.num_groups)
        return [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]

    def _sides(self, layer: int) -> tuple[_Side, _Side]:
        """``(storage, scales or None, format or None)`` of layer ``layer``'s keys and of its values."""
        key_scales = self._key_scales[layer] if self._key_format and self._key_format.scaled else None
        value_scales = self._value_scales[layer] if self._value_format and self._value_format.scaled else None
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
