"""``KVCache``: one sequence's paged key/value cache and its ``attend``.

The seed contract: ``attend(q, k, v)`` appends ``k``/``v``; if the cache now
holds more than ``max_size`` entries it evicts the oldest; then it returns the
attention of ``q`` over every cached entry, the new one included. Caching never
changes an output: each one equals, bit for bit, the no-cache recompute of
:mod:`pagedkv.reference`. Counterpart: transformers' ``DynamicCache``, paged, for one
sequence; many sequences are :class:`pagedkv.KVCacheManager`'s (vLLM's ``KVCacheManager``).

>>> KVCache().attend([1.0], [1.0], [42.0])
[42.0]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from pagedkv.attention import attend_sequence
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable, TableState
from pagedkv.counts import check_count, check_max_size, window_blocks
from pagedkv.errors import (
    ClosedCacheError,
    ConfigError,
    InputTypeError,
    PoolExhaustedError,
    refuse_pickling,
)
from pagedkv.inputs import (
    as_bounded_vectors,
    as_vectors,
    check_dtype,
    check_scale,
    check_score_bound_from_max,
    check_vector_shapes,
    like_input,
)
from pagedkv.locking import release_cache
from pagedkv.memory.pages import choose_view_mode
from pagedkv.memory.pool import KVPool
from pagedkv.memory.quantization import check_storage_dtype, code_itemsize, storage_format

__all__ = ["CacheState", "KVCache"]

_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class CacheState:
    """What a cache holds beyond its configuration and pool (what a snapshot saves).

    Attributes:
        private: whether its pool is its own (growable) one.
        max_abs_key: the largest |key| appended since the last ``clear``.
        kv_shape: the shape of one key, fixed by the first ``attend`` (None before).
        table: its block table's state.
    """

    private: bool
    max_abs_key: float
    kv_shape: tuple[int, ...] | None
    table: TableState


class KVCache:
    """A paged key/value cache for one sequence, one layer.

    Its entries live in fixed-size blocks of a :class:`~pagedkv.KVPool`: either a
    shared pool passed as ``pool`` (a fixed size, shared with other caches) or a
    private pool created at the first ``attend``. A private pool grows
    geometrically, and re-lays the window into one run of ids when it slides;
    with ``max_size`` and a shape that page views can map (see
    docs/paging.md), it is instead a fixed ring of exactly
    ``ceil(max_size / block_size) + 1`` blocks read through page views.

    Threads: caches on one shared pool may each be used from a thread of its
    own; one cache used from two threads at once is the caller's to serialise.
    A shared pool must be fixed (``growable=False``): a private pool belongs to
    one cache, which moves its blocks.

    Invariants:
        * ``len(cache) == min(entries appended, max_size)`` (or all appended
          entries when ``max_size`` is None);
        * the block table's invariants hold, and it holds at most
          ``ceil(max_size / block_size) + 1`` blocks;
        * the pool's invariants hold: each held block's ref count counts this
          cache's table among its holders.

    Args:
        max_size: ``None`` for an unbounded cache, or the window size ``W``:
            each output attends to exactly ``min(n, W)`` entries.
        block_size: token slots per block; defaults to the pool's, or 16.
        pool: a shared :class:`~pagedkv.KVPool`; ``None`` for a private one.
        dtype: storage and compute dtype, float32 or float64 (the default, or
            the pool's).
        scale: multiplies every score; ``1.0`` is the seed's plain dot product,
            ``1 / sqrt(head_dim)`` the transformer's.
        key_dtype: how keys are stored: None (in ``dtype``; the default, or
            the pool's), ``"int8"``, ``"float8_e4m3"``, ``"float16"`` or
            ``"bfloat16"`` (these two without scales; fp8 and bfloat16 need
            the ``fp8`` extra); see :mod:`pagedkv.memory.quantization`. ``dtype``
            stays the compute dtype.
        value_dtype: the same for values.

    Raises:
        InputTypeError, ConfigError: an argument has the wrong type or value,
            or disagrees with ``pool``.

    >>> cache = KVCache(max_size=2, block_size=2)
    >>> [cache.attend([0.0], [0.0], [v]) for v in (1.0, 3.0, 5.0)]
    [[1.0], [2.0], [4.0]]
    >>> len(cache), cache.values().tolist()
    (2, [[3.0], [5.0]])
    """

    def __init__(
        self,
        max_size: int | None = None,
        *,
        block_size: int | None = None,
        pool: KVPool | None = None,
        dtype: npt.DTypeLike | None = None,
        scale: float = 1.0,
        key_dtype: str | None = None,
        value_dtype: str | None = None,
    ) -> None:
        self._max_size = check_max_size(max_size)
        if pool is not None and not isinstance(pool, KVPool):
            raise InputTypeError(f"pool must be a KVPool or None, got {type(pool).__name__}")
        if pool is not None and pool.growable:
            raise ConfigError(
                "pool is growable (a KVCache's private pool, or KVPool(..., growable=True)); a cache "
                "compacts its private pool under anyone sharing it: give every cache one fixed pool, "
                "KVPool(num_blocks, ...)"
            )
        if pool is not None and pool.num_layers != 1:
            raise ConfigError(
                f"a KVCache stores one layer but the pool has num_layers={pool.num_layers}; "
                "use KVCacheManager for many layers"
            )
        if block_size is None:
            block_size = pool.block_size if pool is not None else _DEFAULT_BLOCK_SIZE
        block_size = check_count("block_size", block_size)
        if pool is not None and block_size != pool.block_size:
            raise ConfigError(f"block_size={block_size} but the pool's block_size is {pool.block_size}")
        resolved = check_dtype(dtype if dtype is not None else (pool.dtype if pool else np.float64))
        if pool is not None and resolved != pool.dtype:
            raise ConfigError(f"dtype={resolved} but the pool stores {pool.dtype}")
        storage = []
        for name, value in (("key_dtype", key_dtype), ("value_dtype", value_dtype)):
            checked = check_storage_dtype(name, value)
            if pool is not None:
                if checked is not None and checked != getattr(pool, name):
                    raise ConfigError(f"{name}={checked!r} but the pool stores {getattr(pool, name)!r}")
                checked = getattr(pool, name)
            storage.append(checked)
        self._key_dtype, self._value_dtype = storage
        for chosen in storage if pool is None else ():
            if chosen is not None:
                storage_format(chosen, 1)  # fail now (naming the fp8 extra), not at the first attend
        self._scale = check_scale(scale)
        self._block_size = block_size
        self._dtype = resolved
        self._pool = pool
        self._private = pool is None
        self._table = BlockTable(block_size)
        self._kv_shape: tuple[int, ...] | None = None  # shape of one k, fixed by the first attend
        self._max_abs_key = 0.0
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if pool is not None:
            self._attach(pool)

    # ---------------------------------------------------------------- queries

    def __len__(self) -> int:
        """How many entries are cached now (at most ``max_size``)."""
        return self._table.num_live_tokens

    @property
    def max_size(self) -> int | None:
        """The window size, or ``None`` when unbounded."""
        return self._max_size

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._block_size

    @property
    def dtype(self) -> np.dtype[Any]:
        """Storage and compute dtype."""
        return self._dtype

    @property
    def key_dtype(self) -> str | None:
        """How keys are stored: None (floats), ``"int8"`` or ``"float8_e4m3"``."""
        return self._key_dtype

    @property
    def value_dtype(self) -> str | None:
        """How values are stored: None (floats), ``"int8"`` or ``"float8_e4m3"``."""
        return self._value_dtype

    @property
    def scale(self) -> float:
        """The factor every score is multiplied by."""
        return self._scale

    @property
    def pool(self) -> KVPool | None:
        """The pool holding this cache's blocks (``None`` before a private one exists)."""
        return self._pool

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called."""
        return self._closed

    @property
    def num_tokens(self) -> int:
        """Entries appended over the cache's life, evicted ones included (since ``clear``)."""
        return self._table.num_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks this cache holds now."""
        return self._table.num_blocks

    @property
    def block_ids(self) -> list[int]:
        """Held block ids in logical order (a copy)."""
        return self._table.block_ids

    @property
    def block_table(self) -> BlockTable:
        """The block table itself (read it; do not change it)."""
        return self._table

    def keys(self) -> npt.NDArray[Any]:
        """The cached keys in logical order, ``(len, *k.shape)`` (a copy)."""
        return self._entries(0)

    def values(self) -> npt.NDArray[Any]:
        """The cached values in logical order, ``(len, *v.shape)`` (a copy)."""
        return self._entries(1)

    # --------------------------------------------------------------- commands

    def attend(self, q: Any, k: Any, v: Any) -> Any:
        """Append ``k``/``v``, evict past ``max_size``, and attend ``q`` over the cache.

        Args:
            q: the query, ``(head_dim,)`` or ``(num_q_heads, head_dim)``.
            k: the new key, ``(head_dim,)`` or ``(num_kv_heads, head_dim)``;
                ``num_kv_heads`` must divide ``num_q_heads``.
            v: the new value, shaped like ``k``.

        Returns:
            The output, shaped like ``q``: a list of Python floats when ``q`` is a
            list (or tuple), a torch tensor when it is one, otherwise a new
            numpy array of the cache's dtype.

        Raises:
            ClosedCacheError: the cache was closed.
            InputTypeError, ShapeError, NonFiniteError: bad ``q``, ``k`` or ``v``.
            PoolExhaustedError: a shared pool has no free block for the entry.

        On any error the cache and its pool are as before the call, and so is
        every other cache on the pool. A view the kernel refuses is no error
        (the read gathers, with the same output). If the attention itself
        fails after the append, the append is taken back whole: evicted
        blocks return to the table (their slots as they were), a block taken
        goes back to the head of the free queue, and the allocator's queues
        and ref counts are as before; only two things stay done: a private
        pool that had to grow keeps its new (free) blocks, and a block taken
        by evicting a prefix-cached block of a manager sharing the pool
        comes back as a plain free block (its key is gone).
        """
        if self._closed:
            raise ClosedCacheError("this KVCache is closed; create a new one")
        query, q_is_list, query_abs = as_bounded_vectors("q", q, self._dtype)
        key, _, key_abs = as_bounded_vectors("k", k, self._dtype)
        value, _ = as_vectors("v", v, self._dtype)
        pool_shape = None if self._pool is None else (self._pool.num_kv_heads, self._pool.head_dim)
        check_vector_shapes(query, key, value, self._kv_shape, pool_shape)
        bound = max(self._max_abs_key, key_abs)
        check_score_bound_from_max(self._scale, query, query_abs, bound, self._dtype)

        table = self._table
        before = (table.num_tokens, table.window_start, table.first_block_index, self._kv_shape,
                  self._max_abs_key)
        if self._private or self._pool is None:
            undo = self._append(key, value, key_abs)
        else:
            with self._pool.lock:  # other caches may take blocks of this pool from other threads
                undo = self._append(key, value, key_abs)
        pool = self._pool
        assert pool is not None
        queries = query.reshape(1, -1, pool.head_dim)  # (1 new token, num_q_heads, head_dim)
        try:
            out = attend_sequence(pool, 0, table, self._max_size, queries, self._scale)
        except BaseException:
            self._undo_append(pool, undo, *before)
            raise
        out = out.reshape(query.shape)
        return out.tolist() if q_is_list else like_input(q, out)

    def clear(self) -> None:
        """Drop every entry and give every block back to the pool; the cache stays usable."""
        if self._pool is None:
            return
        # Tail first on a shared pool (as vLLM frees); oldest first on a private
        # pool, which keeps its free queue in id order for one-run tables.
        self._pool.release_views(self._table)  # before its blocks can go to anyone else
        released = self._table.clear()
        if self._private:
            released.reverse()
            self._pool.allocator.free(released)
        else:
            with self._pool.lock:
                self._pool.allocator.free(released)
        self._max_abs_key = 0.0

    def close(self) -> None:
        """Give every block back and refuse further use; calling it again does nothing."""
        if self._closed:
            return
        self.clear()
        self._closed = True
        if self._pool is not None:
            self._pool.detach(self._table)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._private:
            self._pool = None

    def __reduce__(self) -> NoReturn:
        refuse_pickling(self)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        table = self._table
        table.check_invariants()
        if self._max_size is not None:
            if len(self) > self._max_size:
                raise AssertionError(f"{len(self)} entries cached, max_size {self._max_size}")
            expected = min(table.num_tokens, self._max_size)
            limit = window_blocks(self._max_size, self._block_size)
            if table.num_blocks > limit:
                raise AssertionError(f"{table.num_blocks} blocks held, at most {limit} allowed")
        else:
            expected = table.num_tokens
        if len(self) != expected:
            raise AssertionError(f"{len(self)} entries cached, expected {expected}")
        if self._closed and table.num_blocks:
            raise AssertionError("a closed cache still holds blocks")
        if self._pool is not None:
            self._pool.check_invariants()

    # ---------------------------------------------------------------- private

    def _append(
        self, key: npt.NDArray[Any], value: npt.NDArray[Any], key_abs: float
    ) -> _AppendUndo | None:
        """Evict past the window, take a block if needed, store ``key``/``value`` (validated).

        Returns:
            None when no block was evicted or taken (the table's counts undo
            it), else what ``_undo_append`` needs to take the blocks back.

        Raises:
            PoolExhaustedError: a shared pool has no free block; nothing changes.
            PoolTooLargeError: a private pool cannot be made or grown; nothing changes.
        """
        table = self._table
        window_start = table.window_start
        if self._max_size is not None:
            window_start = table.num_tokens + 1 - self._max_size
        num_new = table.num_new_blocks(1)
        if self._pool is None:
            self._create_private_pool(key.shape)  # PoolTooLargeError leaves the cache without one
        pool = self._pool
        assert pool is not None
        if num_new and pool.num_free_blocks + table.num_blocks_released_by(window_start) < 1:
            if not pool.growable:  # a shared pool (a private ring always has a block free here)
                raise PoolExhaustedError(1, 0, pool.num_blocks)
            pool.grow(pool.num_blocks)  # PoolTooLargeError changes nothing
        # ---- validated: from here on nothing can fail ----
        if self._kv_shape is None:
            self._kv_shape = key.shape
        self._max_abs_key = max(self._max_abs_key, key_abs)
        released = table.evict_to(window_start)
        undo = None
        if released:
            pool.allocator.free(released)
            undo = _AppendUndo(released, pool.allocator)
        slot = table.num_tokens % self._block_size
        if num_new:
            undo = undo or _AppendUndo([], pool.allocator)
            new_block = undo.new_block = self._take_block(pool, undo)
            if undo.moved_ids is None and new_block in released:  # an evicted block came straight back
                undo.saved_pages = _copy_blocks(pool, [new_block])
            table.append_token(new_block)
        else:
            table.append_token(None)
        slot += table.last_block_id * self._block_size
        pool.write_token(0, slot, key.reshape(-1), value.reshape(-1))
        return undo

    def _undo_append(
        self, pool: KVPool, undo: _AppendUndo | None, num_tokens: int, window_start: int,
        first_block: int, kv_shape: tuple[int, ...] | None, max_abs_key: float,
    ) -> None:
        """Take back the token ``_append`` just added (its attention failed); see ``attend``.

        The table gets its counts and its evicted blocks back and gives up the
        block the append took; the allocator takes back the frees and the
        take (``BlockAllocator._take_back``); blocks whose slots the append
        overwrote get their saved contents back.
        """
        table = self._table
        state = table._export_state()
        window_ids = state.window_ids
        if undo is not None:
            if undo.new_block is not None:
                window_ids.pop()
            if undo.moved_ids is not None:  # re-laid by _compact: block i was moved_ids[i]
                window_ids = [undo.moved_ids[block_id] for block_id in window_ids]
            window_ids = undo.released[::-1] + window_ids  # evict_to returned them newest first
        table._restore_state(type(state)(num_tokens, window_start, first_block, state.sink_ids, window_ids))
        if undo is not None:
            if undo.saved_pages is not None:
                _put_blocks(pool, undo.saved_pages)
            if self._private:
                self._undo_allocator(pool, undo)
            else:
                with pool.lock:
                    self._undo_allocator(pool, undo)
        self._kv_shape, self._max_abs_key = kv_shape, max_abs_key

    def _undo_allocator(self, pool: KVPool, undo: _AppendUndo) -> None:
        if pool.allocator is not undo.allocator:  # _compact replaced it (its take is gone with it)
            if undo.allocator.num_blocks < pool.num_blocks:  # the pool grew: keep the new blocks free
                undo.allocator.grow(pool.num_blocks - undo.allocator.num_blocks)
            pool.allocator = undo.allocator
            undo.allocator._take_back(undo.released, None)
        else:
            undo.allocator._take_back(undo.released, undo.new_block)

    def _attach(self, pool: KVPool) -> None:
        pool.attach(self._table)
        if not self._private:
            self._finalizer = weakref.finalize(self, release_cache, pool, self._table)

    def _create_private_pool(self, kv_shape: tuple[int, ...]) -> None:
        num_kv_heads, head_dim = kv_shape if len(kv_shape) == 2 else (1, kv_shape[0])
        shape: dict[str, Any] = dict(block_size=self._block_size, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, dtype=self._dtype, key_dtype=self._key_dtype,
                                     value_dtype=self._value_dtype)
        pool = None
        num_blocks = 4  # an unbounded cache's first pool
        if self._max_size is not None:
            held = window_blocks(self._max_size, self._block_size)
            if self._views_can_map(num_kv_heads, head_dim):
                # A ring: freed blocks come back to the window's tail, and views
                # read it in logical order whatever the ids, so nothing is re-laid.
                pool = KVPool(held, **shape)
                if pool.view_mode != "views":  # no page file after all: re-lay into runs instead
                    pool = None
            # Twice the window's blocks: room to re-lay the window in one run (_compact).
            num_blocks = min(2 * held, 64)
        if pool is None:
            pool = KVPool(num_blocks, growable=True, **shape)
        self._pool = pool
        self._attach(pool)

    def _views_can_map(self, num_kv_heads: int, head_dim: int) -> bool:
        values_per_block = self._block_size * num_kv_heads * head_dim
        key_bytes = values_per_block * code_itemsize(self._key_dtype, self._dtype)
        value_bytes = values_per_block * code_itemsize(self._value_dtype, self._dtype)
        mode = choose_view_mode("auto", growable=False, block_bytes=key_bytes, value_block_bytes=value_bytes)
        return mode == "views"

    def _take_block(self, pool: KVPool, undo: _AppendUndo) -> int:
        if not pool.growable:  # a shared pool, or a private ring
            return pool.allocator.allocate_one()
        table = self._table
        if table.num_window_blocks and (
            not table.is_one_run
            or pool.allocator.next_free_block_id() != table.last_block_id + 1
        ):
            self._compact(pool, undo)
        return pool.allocator.allocate_one()

    def _compact(self, pool: KVPool, undo: _AppendUndo) -> None:
        """Re-lay a private pool so the held blocks are ids ``0 .. k-1``, in order.

        NOTE: attention reads a table whose ids are one run as an array view,
        and must gather any other table (measured 3-4x slower, see
        benchmarks/). A private pool belongs to this cache alone, so its blocks
        can move: when the next free id would break the run, copy the window to
        the front. It costs one block copy per block appended, amortized,
        because the pool keeps at least twice the window's blocks. ``undo``
        keeps the old ids and the contents of the blocks the move and the
        append overwrite (ids ``0 .. k``), for a failed attention.
        """
        block_ids = self._table.block_ids
        undo.moved_ids = block_ids
        undo.saved_pages = _copy_blocks(pool, [i for i in range(len(block_ids) + 1) if i < pool.num_blocks])
        self._table.replace_all(pool.compact(block_ids))

    def _entries(self, which: int) -> npt.NDArray[Any]:
        if self._pool is None or self._kv_shape is None or len(self) == 0:
            shape = (0, *self._kv_shape) if self._kv_shape is not None else (0, 0)
            return np.empty(shape, self._dtype)
        keys, values = self._pool.gather(0, self._table.read_plan())  # (H, len, d) views
        chosen = keys if which == 0 else values
        # NOTE: always a copy: the gather is a view of the storage (a run) or
        # of the pool's scratch, which the next attend or gather overwrites.
        # np.ascontiguousarray would return that view unchanged when H == 1.
        tokens = np.array(chosen.transpose(1, 0, 2), order="C", copy=True)  # (len, H, d)
        return tokens.reshape(len(self), *self._kv_shape)

    # ------------------------------------------------------- internal hooks

    def _export_state(self) -> CacheState:
        """This cache's state beyond its configuration (copies): the internal snapshot hook."""
        return CacheState(self._private, self._max_abs_key, self._kv_shape, self._table._export_state())

    def _restore_state(self, state: CacheState, pool: KVPool | None) -> None:
        """Take ``state`` into this new, empty cache; ``pool`` holds its blocks already.

        ``pool`` is the private pool to adopt (when ``state.private`` or when
        this cache was created without a pool), or None when the cache was
        created on its shared pool. The table is filled in place: it is the
        object the finalizer frees.
        """
        self._max_abs_key = state.max_abs_key
        self._kv_shape = state.kv_shape
        self._table._restore_state(state.table)
        if pool is not None and self._pool is None:
            self._pool = pool
            self._attach(pool)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"len={len(self)}, num_blocks={self.num_blocks}"
        return f"KVCache(max_size={self._max_size}, block_size={self._block_size}, {state})"


class _AppendUndo:
    """What taking back an append that evicted or took blocks needs (``KVCache._undo_append``)."""

    __slots__ = ("allocator", "moved_ids", "new_block", "released", "saved_pages")

    def __init__(self, released: list[int], allocator: BlockAllocator) -> None:
        #: Blocks ``evict_to`` gave back (newest first), already freed.
        self.released = released
        #: The allocator they were freed to (``_compact`` may replace the pool's).
        self.allocator = allocator
        #: The block the append took, or None.
        self.new_block: int | None = None
        #: The held ids before ``_compact`` moved block ``moved_ids[i]`` to ``i``.
        self.moved_ids: list[int] | None = None
        #: Copies of blocks the append overwrote, as ``_copy_blocks`` returns them.
        self.saved_pages: tuple[list[int], list[npt.NDArray[Any]]] | None = None


def _page_arrays(pool: KVPool) -> list[npt.NDArray[Any]]:
    """Every array of a one-layer pool that block ids index, block-major (views, scales included)."""
    arrays = [pool.key_pages(0), pool.value_pages(0)]
    if pool.key_format is not None:
        arrays.append(pool.key_scales(0).transpose(1, 0, 2, 3))  # (num_blocks, block_size, H, groups)
    if pool.value_format is not None:
        arrays.append(pool.value_scales(0).transpose(1, 0, 2, 3))
    return arrays


def _copy_blocks(pool: KVPool, block_ids: list[int]) -> tuple[list[int], list[npt.NDArray[Any]]]:
    """Copies of ``block_ids``' contents in every array of ``pool``, for ``_put_blocks``."""
    return block_ids, [array[block_ids] for array in _page_arrays(pool)]


def _put_blocks(pool: KVPool, saved: tuple[list[int], list[npt.NDArray[Any]]]) -> None:
    """Write back what ``_copy_blocks`` saved (the pool may have grown since: same ids)."""
    block_ids, copies = saved
    for array, copy in zip(_page_arrays(pool), copies):
        array[block_ids] = copy
