"""The shared pool: a block allocator paired with the page store its block ids index.

A :class:`KVPool` owns a :class:`~pagedkv.memory.pages.PageStore` (``pool.pages``: every
layer's key and value arrays, their reads and writes by slot) and adds what makes it shared: a
:class:`~pagedkv.blocks.allocator.BlockAllocator`, the block holders ``check_invariants``
counts, a lock, and the page views that read a fragmented table as one array.
vLLM: ``BlockPool`` plus the worker's ``kv_caches``; SGLang: ``TokenToKVPoolAllocator`` with its
``KVCache``. How a table is read (views, a run, or a gather): docs/paging.md.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import NoReturn, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.allocator import BOOKKEEPING_BYTES_PER_BLOCK, BlockAllocator
from pagedkv.blocks.table import BlockTable, ReadPlan
from pagedkv.counts import check_count, check_layer
from pagedkv.errors import ConfigError, InputTypeError, PoolTooLargeError, refuse_pickling
from pagedkv.inputs import check_dtype
from pagedkv.memory.fork import ForkCopy, track
from pagedkv.memory.pages import PageStore, choose_view_mode
from pagedkv.memory.quantization import (
    StorageFormat,
    Tokens,
    bytes_per_token,
    check_storage_dtype,
    code_itemsize,
    storage_format,
)
from pagedkv.memory.views import PageViews, ViewStats
from pagedkv.memory.vmem import map_budget

__all__ = ["BlockHolder", "KVPool"]


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

    The pages are a :class:`~pagedkv.memory.pages.PageStore` the pool owns,
    ``pool.pages``; the pool's page methods (``key_pages``, ``gather``,
    ``write``...) hand over to it, and its shape (``block_size``,
    ``num_kv_heads``, ``head_dim``, ``num_layers``, ``dtype``...) are plain
    attributes of the pool as well.

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
        head_dim: int | None = None,
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
            head_dim: values per head (required; keyword-only).
            num_layers: layers whose storage the block ids index.
            dtype: float32 or float64.
            growable: let the pool double when it runs out (used by the private
                pool of a standalone ``KVCache``; block ids stay valid).
            key_dtype: how keys are stored: None (in ``dtype``, the default),
                ``"int8"``, ``"float8_e4m3"``, ``"float16"`` or ``"bfloat16"``
                (see :mod:`pagedkv.memory.quantization`); ``dtype`` stays the compute dtype.
            value_dtype: the same for values.
            view_mode: how fragmented tables are read: ``"auto"`` (mapped
                views where they work, else gathering), ``"views"`` (views or
                a ``ConfigError`` saying why not) or ``"gather"``. The
                resolved choice is ``pool.view_mode``; outputs are the same.

        Raises:
            ConfigError, InputTypeError: a size is not a positive int (or
                ``head_dim`` is missing), ``growable`` is not a bool, or the
                dtype is not float32/float64, or a storage dtype is unknown,
                or ``view_mode`` is unknown or impossible.
            PoolTooLargeError: the arrays cannot be allocated (a ``MemoryError``
                naming the bytes wanted).
            ImportError: ``"float8_e4m3"`` or ``"bfloat16"`` without ml_dtypes (the ``fp8`` extra).
        """
        if head_dim is None:  # a typed error, not Python's bare TypeError for a missing argument
            raise InputTypeError(
                f"KVPool needs head_dim (values per head), got None; e.g. KVPool({num_blocks!r}, head_dim=64)"
            )
        if not isinstance(growable, bool):
            raise InputTypeError(f"growable must be True or False, got {growable!r}")
        block_size = check_count("block_size", block_size)
        num_kv_heads = check_count("num_kv_heads", num_kv_heads)
        head_dim = check_count("head_dim", head_dim)
        num_layers = check_count("num_layers", num_layers)
        num_blocks = check_count("num_blocks", num_blocks)
        compute = check_dtype(dtype)
        key_dtype = check_storage_dtype("key_dtype", key_dtype)
        value_dtype = check_storage_dtype("value_dtype", value_dtype)
        for name in (key_dtype, value_dtype):
            if name is not None:
                storage_format(name, head_dim)  # ImportError naming the extra, before any array
        values_per_block = block_size * num_kv_heads * head_dim
        mode = choose_view_mode(view_mode, growable=growable,
                                block_bytes=values_per_block * code_itemsize(key_dtype, compute),
                                value_block_bytes=values_per_block * code_itemsize(value_dtype, compute))
        self.growable = growable
        try:
            self.allocator = BlockAllocator(num_blocks)
            #: The pages the block ids index (keys, values and scales of every layer).
            self.pages = PageStore(num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, num_layers=num_layers, dtype=compute,
                                   key_dtype=key_dtype, value_dtype=value_dtype, in_file=mode == "views",
                                   views_required=view_mode == "views")
        except ConfigError:  # view_mode="views" and no page file: not a size problem
            raise
        except (MemoryError, ValueError, OverflowError):  # numpy: "array is too big" is a ValueError
            per_token = bytes_per_token(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=compute,
                                        key_dtype=key_dtype, value_dtype=value_dtype, num_layers=num_layers)
            wanted = num_blocks * (block_size * per_token + BOOKKEEPING_BYTES_PER_BLOCK)
            raise PoolTooLargeError(
                f"a pool of {num_blocks:,} blocks of {block_size:,} tokens "
                f"({per_token:,} bytes a token) wants {wanted:,} bytes; "
                "give it fewer or smaller blocks",
                wanted,
            ) from None
        pages = self.pages
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.dtype = compute
        #: The shape of one token's keys (or values) for ``write``: ``(1, num_kv_heads, head_dim)``.
        self.token_shape = pages.token_shape
        #: Storage dtype names of keys and values (None: stored in ``dtype``).
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        #: Whether keys or values are stored as codes (attention then runs the chunked kernel).
        self.quantized = pages.quantized
        #: ``pages.write_token``, bound once: the decode write of every layer and token
        #: calls it, and a method handing over would add a Python call to each.
        self.write_token = pages.write_token
        page_file = pages.page_file
        #: How fragmented tables are read: ``"views"`` (mapped) or ``"gather"`` (copied).
        self.view_mode = "views" if page_file is not None else "gather"
        #: Held by every cache and manager command that changes this pool's
        #: allocator or pages (see docs/design.md, "Concurrency"). A plain
        #: lock, not re-entrant: a finalizer that finds it held defers its frees.
        self.lock = threading.Lock()
        self._views: PageViews | None = None
        self._fork_copy: ForkCopy | None = None
        if page_file is not None:
            self._views = PageViews(page_file, map_budget())
            # A block's pages are allocated when it is handed out, not by a
            # fault at each first touch (vmem.populate).
            self.allocator.on_take = page_file.make_resident
            # A forked child copies the page file, so the two processes never share pages.
            self._fork_copy = track(self.lock, self._views)
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

    # ------------------------------------------------ the pages (handed to ``self.pages``)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of keys and values one block holds across all layers (``PageStore.bytes_per_block``)."""
        return self.pages.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token slot takes across all layers, scales included (``PageStore.bytes_per_token``)."""
        return self.pages.bytes_per_token

    @property
    def key_format(self) -> StorageFormat | None:
        """How keys are stored as codes, or None when they are stored in ``dtype``."""
        return self.pages.key_format

    @property
    def value_format(self) -> StorageFormat | None:
        """How values are stored as codes, or None when they are stored in ``dtype``."""
        return self.pages.value_format

    def key_pages(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage ``(num_blocks, block_size, num_kv_heads, head_dim)`` (a view)."""
        return self.pages.key_pages(layer)

    def value_pages(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value storage, shaped like ``key_pages`` (a view)."""
        return self.pages.value_pages(layer)

    def keys(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key storage as ``(num_kv_heads, num_blocks, block_size, head_dim)`` (a view).

        Head-major, over the same memory as ``key_pages`` (``PageStore.keys``).
        """
        return self.pages.keys(layer)

    def values(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value storage, shaped like ``keys`` (a view)."""
        return self.pages.values(layer)

    def key_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s key scales, head-major (``PageStore.key_scales``; ConfigError if unquantized)."""
        return self.pages.key_scales(layer)

    def value_scales(self, layer: int = 0) -> npt.NDArray[np.floating]:
        """Layer ``layer``'s value scales, shaped like ``key_scales``."""
        return self.pages.value_scales(layer)

    def gather(
        self, layer: int, plan: ReadPlan
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The keys and values ``plan`` reads, as ``(num_kv_heads, plan.num_tokens, head_dim)``.

        A view for a run of blocks, this thread's scratch otherwise (``PageStore.gather``).
        """
        return self.pages.gather(layer, plan)

    def gather_tokens(
        self, layer: int, plan: ReadPlan
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The keys and values ``plan`` reads, token-major (``PageStore.gather_tokens``)."""
        return self.pages.gather_tokens(layer, plan)

    def gather_quantized(self, layer: int, plan: ReadPlan) -> tuple[Tokens, Tokens]:
        """The keys and values ``plan`` reads, as stored (``PageStore.gather_quantized``)."""
        return self.pages.gather_quantized(layer, plan)


    @property
    def view_stats(self) -> ViewStats:
        """Counters of the page views (reads by view and by gather, blocks mapped...); zeros if gathering."""
        return self._views.stats if self._views is not None else ViewStats()

    @property
    def num_mapped_blocks(self) -> int:
        """Blocks mapped into views now (an upper bound on the memory areas they take)."""
        return self._views.num_mapped_blocks if self._views is not None else 0

    def read(
        self, layer: int, table: BlockTable, ranges: list[tuple[int, int]]
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """The tokens of ``table`` in ``ranges`` (logical index ranges), ``(num_tokens, H, d)`` each.

        Float pools only. In ``"views"`` mode one range after the sinks is
        read through the table's mapped view (read-only; valid until this
        table's next read); anything else (sinks in front, a view refused by
        the map budget or the kernel) is gathered as
        ``gather_tokens(layer, table.read_plan(ranges))``. The arrays are
        equal either way, and ``view_stats`` counts each read once: as a view
        read or as a gather read.

        Raises:
            InputTypeError, LayerIndexError: ``layer`` is not an index of a layer.
            UnknownBlockError: the table names a block past the pool's end;
                nothing is mapped, read or counted.
        """
        if layer.__class__ is not int or not 0 <= layer < self.num_layers:
            layer = check_layer(layer, self.num_layers)
        views = self._views
        if views is None:
            return self.pages.gather_tokens(layer, table.read_plan(ranges))
        if len(ranges) == 1 and table.num_window_blocks:
            start, end = ranges[0]
            if start < end:
                viewed = views.read(table, layer, start, end)  # counts itself when it serves the read
                if viewed is not None:
                    return viewed
        gathered = self.pages.gather_tokens(layer, table.read_plan(ranges))
        views.count_gather_reads(1)
        return gathered

    def read_quantized(
        self, layer: int, table: BlockTable, ranges: list[tuple[int, int]]
    ) -> tuple[Tokens, Tokens]:
        """The tokens of ``table`` in ``ranges``, each side as stored (``gather_quantized``'s result).

        As :meth:`read` for a quantized pool: in ``"views"`` mode one range
        after the sinks reads its codes through the table's mapped view (and
        its scales by slot); anything else is ``gather_quantized``, which
        copies nothing either. Counted in ``view_stats`` as :meth:`read` counts.

        Raises:
            InputTypeError, LayerIndexError: ``layer`` is not an index of a layer.
            UnknownBlockError: the table names a block past the pool's end;
                nothing is mapped, read or counted.
        """
        layer = check_layer(layer, self.num_layers)
        views = self._views
        if views is not None and len(ranges) == 1 and table.num_window_blocks:
            start, end = ranges[0]
            if start < end:
                viewed = views.read(table, layer, start, end)  # counts itself when it serves the read
                if viewed is not None:
                    return self.pages.viewed_tokens(layer, viewed, table.slot_array(ranges))
        gathered = self.pages.gather_quantized(layer, table.read_plan(ranges))
        if views is not None:
            views.count_gather_reads(1)
        return gathered

    def read_gathered(
        self, layer: int, plan: ReadPlan, num_reads: int
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]:
        """``gather_tokens(layer, plan)``, counted in ``view_stats`` as ``num_reads`` gather reads.

        For a read of several tables at once (a padded decode batch: one read
        per table), so that every read is counted once as in :meth:`read`.
        """
        gathered = self.pages.gather_tokens(layer, plan)
        if self._views is not None:
            self._views.count_gather_reads(num_reads)
        return gathered

    def release_views(self, table: BlockTable) -> None:
        """Unmap every view of ``table`` (it is freed or closed); its next read maps again.

        Safe to skip: a view is checked against its table at every read, and a
        collected table's views are released by its finalizer.
        """
        if self._views is not None:
            self._views.release(table)

    # --------------------------------------------------------------- commands

    def write(
        self,
        layer: int,
        slots: npt.NDArray[np.intp],
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
    ) -> None:
        """Store ``keys``/``values`` ``(n, num_kv_heads, head_dim)`` at ``n`` slots (``PageStore.write``)."""
        self.pages.write(layer, slots, keys, values)

    def write_run(
        self,
        layer: int,
        block_ids: list[int],
        offset: int,
        keys: npt.NDArray[np.floating],
        values: npt.NDArray[np.floating],
    ) -> None:
        """Store a prefill's ``keys``/``values`` by whole blocks (``PageStore.write_run``; float pages)."""
        self.pages.write_run(layer, block_ids, offset, keys, values)

    def write_one(
        self,
        layer: int,
        block_id: int,
        offset: int,
        key: npt.NDArray[np.floating],
        value: npt.NDArray[np.floating],
    ) -> None:
        """Store one token's ``key``/``value`` ``(num_kv_heads, head_dim)`` (``PageStore.write_one``)."""
        self.pages.write_one(layer, block_id, offset, key, value)

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copy every layer's contents of ``sources`` into ``destinations``."""
        self.pages.copy_blocks(sources, destinations)

    def copy_block_scales(
        self, sources: list[int], destinations: list[int], target: KVPool | None = None
    ) -> None:
        """Copy the scales of ``sources`` into ``destinations`` of ``target`` (default: this pool).

        Does nothing when neither side has scales (``PageStore.copy_block_scales``).
        """
        self.pages.copy_block_scales(sources, destinations, None if target is None else target.pages)

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
        total = self.num_blocks + num_new_blocks
        try:  # the pages first: their growth changes nothing when it fails
            self.pages.grow(total)
        except (MemoryError, ValueError, OverflowError):
            wanted = total * (self.bytes_per_block + BOOKKEEPING_BYTES_PER_BLOCK)
            raise PoolTooLargeError(
                f"growing the pool to {total:,} blocks wants {wanted:,} bytes", wanted
            ) from None
        self.allocator.grow(num_new_blocks)

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
        self.pages.move_to_front(block_ids)
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
        self.pages.check_invariants(self.num_blocks)
        if (self.view_mode == "views") != (self._views is not None):
            raise AssertionError(f"view_mode {self.view_mode!r} but views {self._views is not None}")
        if self._views is not None:
            self._views.check_invariants()

    def __reduce__(self) -> NoReturn:
        refuse_pickling(self)

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_layers={self.num_layers}, dtype={self.dtype}, "
            + (f"key_dtype={self.key_dtype}, value_dtype={self.value_dtype}, " if self.quantized else "")
            + f"view_mode={self.view_mode!r}, num_free_blocks={self.num_free_blocks})"
        )
