"""The shared pool: a block allocator paired with the arrays its block ids index.

Storage layout (chosen from measurements, see ``docs/paging.md``)::

    key_pages(layer)    (num_blocks, block_size, num_kv_heads, head_dim)
    value_pages(layer)  (num_blocks, block_size, num_kv_heads, head_dim)

Token-major: one block of one side of one layer is one stretch of memory
(64 KiB at 16 x 8 x 128 x float32, sixteen 4 KiB pages), so it can be mapped
(``view_mode == "views"``, :mod:`pagedkv.views`): every table then reads as
one contiguous ``(num_tokens, num_kv_heads, head_dim)`` array, whatever its
block ids. A table whose ids form one run (``7, 8, 9``) is such an array in
the storage itself; any other table of a ``"gather"`` pool is copied into
scratch first (:mod:`pagedkv.gather`). Every path gives the same array, bit
for bit::

    storage:  | blk 0: t0 (H x d) t1 ... | blk 1: ... | blk 2: ... |

``keys(layer)`` / ``values(layer)`` are head-major views of the same memory,
``(num_kv_heads, num_blocks, block_size, head_dim)``, for code written against
the earlier layout (snapshots store that order).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.allocator import BOOKKEEPING_BYTES_PER_BLOCK, BlockAllocator
from pagedkv.block_table import BlockTable
from pagedkv.counts import check_count, check_layer
from pagedkv.errors import ConfigError, PoolTooLargeError
from pagedkv.gather import Scratch, gather
from pagedkv.inputs import check_dtype
from pagedkv.pages import choose_view_mode, new_page_arrays
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
from pagedkv.read_plan import ReadPlan
from pagedkv.views import PageViews, ViewStats
from pagedkv.vmem import map_budget

__all__ = ["BlockHolder", "KVPool"]

#: One side of a layer's storage: floats or codes, scales or None, format or None.
_Side = tuple[npt.NDArray[Any], "npt.NDArray[np.floating] | None", "StorageFormat | None"]

class BlockHolder(Protocol):
    """Anything that holds blocks of a pool: a block table, or a manager's sequences in one state.

    A pool's ``check_invariants`` asks every attached holder for its block
    ids and compares the counts with the allocator's ref counts.
    """

    def held_block_ids(self) -> Iterable[int]:
        """Every block id held, once per table that holds it."""
        ...


class KVPool:
    """A fixed number of blocks shared by any number of caches or sequences.

    Every layer's storage is indexed by the same block ids (as in vLLM): a
    sequence's one block table serves all layers.

    Threads: caches and sequences on one pool may run in different threads;
    their commands hold ``lock`` and each thread gathers into scratch of its
    own (see "Concurrency" in docs/design.md).

    Invariants:
        * the allocator's invariants hold;
        * each block's ref count equals the number of block tables, across every
          cache attached to this pool, that hold it;
        * key and value pages have shape
          ``(num_blocks, block_size, num_kv_heads, head_dim)`` for every layer;
        * ``view_mode == "views"`` exactly when the pages sit in a page file
          (and then the views' own invariants hold).

    >>> pool = KVPool(8, block_size=4, head_dim=2)
    >>> pool.num_free_blocks, pool.key_pages(0).shape, pool.view_mode
    (8, (8, 4, 1, 2), 'gather')
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
        view_mode: str = "auto",
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
            view_mode: how fragmented tables are read: ``"auto"`` (mapped
                views where they work, else gathering), ``"views"`` (views or
                a ``ConfigError`` saying why not) or ``"gather"``. The
                resolved choice is ``pool.view_mode``; outputs are the same.

        Raises:
            ConfigError, InputTypeError: a size is not a positive int, or the
                dtype is not float32/float64, or a storage dtype is unknown,
                or ``view_mode`` is unknown or impossible.
            PoolTooLargeError: the arrays cannot be allocated (a ``MemoryError``
                naming the bytes wanted).
            ImportError: ``"float8_e4m3"`` without ml_dtypes (the ``fp8`` extra).
        """
        self.block_size = check_count("block_size", block_size)
        self.num_kv_heads = check_count("num_kv_heads", num_kv_heads)
        self.head_dim = check_count("head_dim", head_dim)
        self.num_layers = check_count("num_layers", num_layers)
        num_blocks = check_count("num_blocks", num_blocks)
        self.dtype = check_dtype(dtype)
        self.growable = growable
        #: Storage dtype names of keys and values (None: unquantized, in ``dtype``).
        self.key_dtype = check_storage_dtype("key_dtype", key_dtype)
        self.value_dtype = check_storage_dtype("value_dtype", value_dtype)
        self._key_format = storage_format(self.key_dtype, self.head_dim) if self.key_dtype else None
        self._value_format = storage_format(self.value_dtype, self.head_dim) if self.value_dtype else None
        #: Whether keys or values are quantized (attention then runs the chunked kernel).
        self.quantized = self._key_format is not None or self._value_format is not None
        wanted = num_blocks * (self.bytes_per_block + BOOKKEEPING_BYTES_PER_BLOCK)
        block_bytes = self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        mode = choose_view_mode(view_mode, growable=growable, quantized=self.quantized,
                                block_bytes=block_bytes)
        try:
            self.allocator = BlockAllocator(num_blocks)
            shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            key_store = self._key_format.code_dtype if self._key_format else self.dtype
            value_store = self._value_format.code_dtype if self._value_format else self.dtype
            pages = new_page_arrays(self.num_layers, shape, key_store, value_store, mode == "views")
            self._keys, self._values = pages.keys, pages.values
            # Scales (num_blocks, block_size, num_kv_heads, num_groups) per quantized side and layer.
            self._key_scales = self._new_scales(self._key_format, num_blocks)
            self._value_scales = self._new_scales(self._value_format, num_blocks)
        except (MemoryError, ValueError, OverflowError):  # numpy: "array is too big" is a ValueError
            raise PoolTooLargeError(
                f"a pool of {num_blocks:,} blocks of {self.block_size:,} tokens "
                f"({self.bytes_per_token:,} bytes a token) wants {wanted:,} bytes; "
                "give it fewer or smaller blocks",
                wanted,
            ) from None
        #: How fragmented tables are read: ``"views"`` (mapped) or ``"gather"`` (copied).
        self.view_mode = "views" if pages.page_file is not None else "gather"
        self._views = PageViews(pages.page_file, map_budget()) if pages.page_file is not None else None
        # NOTE: one scratch pair per thread, so caches (or sequences) used from
        # different threads never overwrite each other's gathered keys.
        self._scratch = Scratch(self.dtype)
        #: Held by every cache and manager command that changes this pool's
        #: allocator or pages (see docs/design.md, "Concurrency"). A plain
        #: lock, not re-entrant: a finalizer that finds it held defers its frees.
        self.lock = threading.Lock()
        # What holds blocks of this pool, for ``check_invariants``. Weak, so a
        # cache dropped without close() can be collected and its finalizer
        # can give its blocks back.
        self._holders: weakref.WeakValueDictionary[int, BlockHolder] = weakref.WeakValueDictionary()

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

        Head-major, like ``keys``; the storage is token-major.

        Raises:
            ConfigError: keys are not quantized.
        """
        if not self._key_scales:
            raise ConfigError("keys are not quantized in this pool; there are no scales")
        heads: npt.NDArray[np.floating] = self._key_scales[
            check_layer(layer, self.num_layers)].transpose(2, 0, 1, 3)
        return heads

    def value_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value scales, shaped like ``key_scales``.

        Raises:
            ConfigError: values are not quantized.
        """
        if not self._value_scales:
            raise ConfigError("values are not quantized in this pool; there are no scales")
        heads: npt.NDArray[np.floating] = self._value_scales[
            check_layer(layer, self.num_layers)].transpose(2, 0, 1, 3)
        return heads

    def key_pages(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage ``(num_blocks, block_size, num_kv_heads, head_dim)`` (a view).

        With ``key_dtype`` set these are the codes.

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

    @property
    def view_stats(self) -> ViewStats:
        """Counters of the page views (reads by view and by gather, blocks mapped...); zeros if gathering."""
        return self._views.stats if self._views is not None else ViewStats()

    @property
    def num_mapped_blocks(self) -> int:
        """Blocks mapped into views now (an upper bound on the memory areas they take)."""
        return self._views.num_mapped_blocks if self._views is not None else 0

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

        >>> from pagedkv.block_table import BlockTable
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
        """
        return gather(self._keys[layer], self._values[layer], plan, self._scratch)

    def read(
        self, layer: int, table: BlockTable, ranges: list[tuple[int, int]]
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The tokens of ``table`` in ``ranges`` (logical index ranges), ``(num_tokens, H, d)`` each.

        Float pools only. In ``"views"`` mode one range after the sinks is
        read through the table's mapped view (read-only; valid until this
        table's next read); anything else, or a view refused by the map
        budget, is gathered as ``gather_tokens(layer, table.read_plan(ranges))``.
        The arrays are equal either way.
        """
        views = self._views
        if views is not None and len(ranges) == 1 and table.num_window_blocks:
            start, end = ranges[0]
            if start < end:
                viewed = views.read(table, layer, start, end)
                if viewed is not None:
                    return viewed
            views.stats.num_gather_reads += 1
        return self.gather_tokens(layer, table.read_plan(ranges))

    def release_views(self, table: BlockTable) -> None:
        """Unmap every view of ``table`` (it is freed or closed); its next read maps again.

        Safe to skip: a view is checked against its table at every read, and a
        collected table's views are released by its finalizer.
        """
        if self._views is not None:
            self._views.release(table)

    def gather_quantized(self, layer: int, plan: ReadPlan) -> tuple[Tokens, Tokens]:
        """The keys and values ``plan`` reads, in order, as stored.

        Each side is a float array ``(num_kv_heads, num_tokens, head_dim)``, or
        :class:`~pagedkv.quantization.QuantizedTokens` (codes and scales) when
        that side is quantized. Views of the storage when the plan's blocks
        are one run, new arrays otherwise. Nothing is dequantized.
        """
        key_side, value_side = self._sides(layer)
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
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self._keys[layer].reshape(flat)[slots] = keys
        self._values[layer].reshape(flat)[slots] = values

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
        self._keys[layer][block_id, offset] = key
        self._values[layer][block_id, offset] = value

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copy every layer's contents of ``sources`` into ``destinations``."""
        for layer in range(self.num_layers):
            self._keys[layer][destinations] = self._keys[layer][sources]
            self._values[layer][destinations] = self._values[layer][sources]
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
                theirs[layer][destinations] = scales[sources]

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` blocks (ids after the existing ones stay valid).

        Raises:
            ConfigError: the pool is fixed (``growable=False``).
            InputTypeError, ConfigError: ``num_new_blocks`` is not an int >= 1.
            PoolTooLargeError: the bigger arrays cannot be allocated; nothing changes.
        """
        if not self.growable:
            raise ConfigError(f"this pool has a fixed size of {self.num_blocks} blocks; it never grows")
        num_new_blocks = check_count("num_new_blocks", num_new_blocks)
        old = self.num_blocks
        groups = (self._keys, self._values, self._key_scales, self._value_scales)
        try:  # every new array first, so a failure changes nothing
            bigger = [[np.zeros((old + num_new_blocks, *a.shape[1:]), a.dtype) for a in arrays]
                      for arrays in groups]
        except (MemoryError, ValueError, OverflowError):
            wanted = (old + num_new_blocks) * (self.bytes_per_block + BOOKKEEPING_BYTES_PER_BLOCK)
            raise PoolTooLargeError(
                f"growing the pool to {old + num_new_blocks:,} blocks wants {wanted:,} bytes", wanted
            ) from None
        self.allocator.grow(num_new_blocks)
        for arrays, new_arrays in zip(groups, bigger):
            for layer, (array, new_array) in enumerate(zip(arrays, new_arrays)):
                new_array[:old] = array
                arrays[layer] = new_array

    def attach(self, holder: BlockHolder) -> None:
        """Register a :class:`BlockHolder` so ``check_invariants`` counts its blocks.

        The pool keeps only a weak reference: the holder's owner keeps it alive.
        """
        self._holders[id(holder)] = holder

    def detach(self, holder: BlockHolder) -> None:
        """Forget a holder registered with ``attach`` (it holds no blocks any more)."""
        self._holders.pop(id(holder), None)

    def compact(self, block_ids: list[int]) -> list[int]:
        """Move the blocks ``block_ids`` to ids ``0 .. k - 1`` in that order; free every other block.

        For a growable pool with one holder (a ``KVCache``'s private pool):
        the caller renames its table's ids to the returned ones. The pool
        grows first if the moved blocks and the room to append after them
        need it (``2 * k + 1`` blocks).

        Raises:
            ConfigError: the pool is fixed (other holders' ids would move).
        """
        if not self.growable:
            raise ConfigError("only a growable (private) pool can be compacted; its block ids move")
        num_held = len(block_ids)
        if self.num_blocks < 2 * num_held + 1:
            self.grow(2 * num_held + 1 - self.num_blocks)
        for arrays in (self._keys, self._values, self._key_scales, self._value_scales):
            for array in arrays:
                array[:num_held] = array[block_ids]
        self.allocator = BlockAllocator(self.num_blocks)
        return self.allocator.allocate(num_held)

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant in the class docstring is broken.

        Call it when no other thread is changing the pool (a manager's
        ``check_invariants`` holds the pool's lock around it).
        """
        self.allocator.release_deferred()  # a dropped owner's frees first
        self.allocator.check_invariants()
        held = [0] * self.num_blocks
        for holder in self._holders.values():
            for block_id in holder.held_block_ids():
                held[block_id] += 1
        for block_id, count in enumerate(held):
            ref_count = self.allocator.ref_count(block_id)
            if count != ref_count:
                raise AssertionError(
                    f"block {block_id} has ref count {ref_count} but {count} block tables hold it"
                )
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for array in self._keys + self._values:
            if array.shape != shape:
                raise AssertionError(f"storage shape {array.shape}, expected {shape}")
        sides = ((self._key_format, self._key_scales), (self._value_format, self._value_scales))
        for storage, scales in sides:
            expected = [] if storage is None else [(*shape[:3], storage.num_groups)] * self.num_layers
            if [array.shape for array in scales] != expected:
                raise AssertionError(f"scale shapes {[a.shape for a in scales]}, expected {expected}")
        if (self.view_mode == "views") != (self._views is not None):
            raise AssertionError(f"view_mode {self.view_mode!r} but views {self._views is not None}")
        if self._views is not None:
            self._views.check_invariants()

    # ---------------------------------------------------------------- private

    def _new_scales(self, storage: StorageFormat | None, num_blocks: int) -> list[npt.NDArray[np.floating]]:
        if storage is None:
            return []
        shape = (num_blocks, self.block_size, self.num_kv_heads, storage.num_groups)
        return [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]

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

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_layers={self.num_layers}, dtype={self.dtype}, "
            + (f"key_dtype={self.key_dtype}, value_dtype={self.value_dtype}, " if self.quantized else "")
            + f"view_mode={self.view_mode!r}, num_free_blocks={self.num_free_blocks})"
        )
