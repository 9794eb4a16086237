"""A pool's pages: where they live, their arrays per side, reads by plan (view or gather) and writes by slot.

:class:`PageStore` holds every layer's keys and values, token-major ``(num_blocks, block_size,
num_kv_heads, head_dim)``, with their quantization scales; it reads a plan as a view of a run of
blocks or a gather into per-thread :class:`Scratch`, and writes by slot or by block. The pages are
plain arrays or one shared page file that views map (:func:`choose_view_mode`). It knows ids and
arrays only; :class:`~pagedkv.memory.pool.KVPool` owns a store beside its allocator.
vLLM: the worker's ``kv_caches`` and ``reshape_and_cache``; SGLang: ``MHATokenToKVPool``.
Layout, diagrams and measurements: docs/paging.md ("The storage layout").
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.table import ReadPlan
from pagedkv.counts import check_layer
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.memory.quantization import QuantizedTokens, StorageFormat, Tokens, storage_format
from pagedkv.memory.views import PageFile
from pagedkv.memory.vmem import (
    FDS_PER_PAGE_FILE,
    PAGE_SIZE,
    MapBudget,
    descriptor_budget,
    open_page_file,
    views_supported,
)

__all__ = [
    "VIEW_MODES",
    "PageArrays",
    "PageStore",
    "Scratch",
    "choose_view_mode",
    "gather",
    "new_page_arrays",
    "run_tokens",
    "take_tokens",
    "write_blocks",
    "write_tokens",
]


# ------------------------------------------------------------ where pages live

#: What ``KVPool(view_mode=...)`` accepts.
VIEW_MODES = ("auto", "views", "gather")


def choose_view_mode(
    requested: object, *, growable: bool, block_bytes: int, value_block_bytes: int | None = None
) -> str:
    """``"views"`` or ``"gather"``: how a pool with these properties reads fragmented tables.

    Every storage format maps: the page file holds the stored bytes (floats,
    or codes), and a quantized side's scales are read by slot beside them.

    Args:
        requested: ``"auto"`` (views where they work), ``"views"`` (views or
            an error) or ``"gather"`` (never map).
        growable: a growable pool moves its arrays when it grows; it gathers.
        block_bytes: bytes of one block of one layer's keys as stored
            (``block_size x num_kv_heads x head_dim x`` the stored itemsize).
        value_block_bytes: the same for values (None: as keys). Keys and
            values stored at different widths share no page-file layout: they gather.

    Raises:
        InputTypeError, ConfigError: ``requested`` is not one of ``VIEW_MODES``,
            or is ``"views"`` where views cannot work (the message says why).

    >>> choose_view_mode("auto", growable=False, block_bytes=100)
    'gather'
    """
    if not isinstance(requested, str):
        raise InputTypeError(f"view_mode must be one of {VIEW_MODES}, got {requested!r}")
    if requested not in VIEW_MODES:
        raise ConfigError(f"view_mode must be one of {VIEW_MODES}, got {requested!r}")
    if requested == "gather":
        return "gather"
    value_bytes = block_bytes if value_block_bytes is None else value_block_bytes
    reason = _why_not_views(growable, block_bytes, value_bytes)
    if reason is None:
        return "views"
    if requested == "views":
        raise _views_impossible(reason)
    return "gather"


def _views_impossible(reason: str) -> ConfigError:
    return ConfigError(f"view_mode='views' is impossible here: {reason}; use 'auto' or 'gather'")


def _why_not_views(growable: bool, block_bytes: int, value_block_bytes: int) -> str | None:
    if growable:
        return "the pool is growable (its arrays move when it grows)"
    if value_block_bytes != block_bytes:
        return (f"a block of keys takes {block_bytes:,} bytes and one of values {value_block_bytes:,}: "
                "keys and values stored at different widths share no page-file layout")
    if block_bytes % PAGE_SIZE:
        return (f"a block of one layer's keys takes {block_bytes:,} bytes, not a multiple of the "
                f"{PAGE_SIZE:,}-byte page (block_size x num_kv_heads x head_dim x the stored itemsize)")
    if not views_supported():
        return "this platform has no mmap(MAP_FIXED) (Linux only)"
    descriptors = descriptor_budget()
    if descriptors.num_used + FDS_PER_PAGE_FILE > descriptors.limit:
        return _descriptors_spent(descriptors)
    return None


def _descriptors_spent(descriptors: MapBudget) -> str:
    return (f"page files hold {descriptors.num_used:,} of the {descriptors.limit:,} descriptors they "
            f"may use (a quarter of RLIMIT_NOFILE) and a page file needs {FDS_PER_PAGE_FILE}")


class PageArrays:
    """One pool's key and value page arrays, and the page file behind them when there is one.

    Attributes:
        keys: per layer, ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        values: the same for values.
        page_file: where the blocks sit in the shared file, or None (plain arrays).
    """

    def __init__(
        self, keys: list[npt.NDArray[Any]], values: list[npt.NDArray[Any]], page_file: PageFile | None
    ) -> None:
        self.keys = keys
        self.values = values
        self.page_file = page_file


def new_page_arrays(
    num_layers: int, shape: tuple[int, int, int, int], key_dtype: np.dtype[Any],
    value_dtype: np.dtype[Any], in_file: bool, required: bool = False,
) -> PageArrays:
    """Zeroed page arrays of ``shape`` per layer and side, in a shared page file when ``in_file``.

    Untouched blocks cost no memory either way (``np.zeros`` and a fresh file
    both hand out zero pages lazily). A page file that cannot be made or
    mapped falls back to plain arrays (``page_file`` None), unless
    ``required`` (``view_mode="views"``).

    Raises:
        ConfigError: ``required`` and the page file cannot be made (the
            message says why: the descriptor budget, or the kernel's refusal).
        MemoryError, ValueError: the plain arrays cannot be allocated.
    """
    if in_file:
        try:
            return _in_file(num_layers, shape, key_dtype, value_dtype)
        except (OSError, ValueError, OverflowError) as error:
            if required:
                raise _views_impossible(f"no page file could be made ({error})") from None
            # plain arrays below; the pool then gathers
    return PageArrays([np.zeros(shape, key_dtype) for _ in range(num_layers)],
                      [np.zeros(shape, value_dtype) for _ in range(num_layers)], None)


def _in_file(
    num_layers: int, shape: tuple[int, int, int, int], dtype: np.dtype[Any], value_dtype: np.dtype[Any]
) -> PageArrays:
    """Both sides of every layer in one new page file; values may be another dtype of the same width."""
    if value_dtype.itemsize != dtype.itemsize:
        raise ValueError(f"keys of {dtype} and values of {value_dtype} differ in width: no page-file layout")
    num_blocks = shape[0]
    block_bytes = int(np.prod(shape[1:])) * dtype.itemsize
    side_bytes = num_blocks * block_bytes
    descriptors = descriptor_budget()
    if not descriptors.take(FDS_PER_PAGE_FILE):
        raise OSError(errno.EMFILE, _descriptors_spent(descriptors))
    fd = -1
    try:
        fd = open_page_file(2 * num_layers * side_bytes)
        whole = mmap.mmap(fd, 2 * num_layers * side_bytes, mmap.MAP_SHARED)
        count = int(np.prod(shape))
        sides = [np.frombuffer(whole, value_dtype if index % 2 else dtype, count=count,
                               offset=index * side_bytes).reshape(shape)
                 for index in range(2 * num_layers)]
    except (OSError, ValueError, OverflowError):
        if fd >= 0:
            os.close(fd)
        descriptors.give(FDS_PER_PAGE_FILE)
        raise
    page_file = PageFile(fd, num_blocks, block_bytes, (shape[2], shape[3]), dtype, num_layers,
                         sides[0].ctypes.data, whole, bytearray(num_blocks), value_dtype)
    # The descriptor lives as long as the PageFile: views map it; the arrays keep `whole` mapped.
    weakref.finalize(page_file, _close_page_file, descriptors, fd)
    return PageArrays(sides[0::2], sides[1::2], page_file)


def _close_page_file(descriptors: MapBudget, fd: int) -> None:
    os.close(fd)
    descriptors.give(FDS_PER_PAGE_FILE)


# ---------------------------------------------- reading a plan: a view or a gather
# Scratch is per thread (``threading.local``): a gather's result is valid until the same thread's
# next gather of the same Scratch, and two threads never share one.

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
    Token-major pages make a block one stretch of memory and a run of blocks
    (``7, 8, 9``) a longer one: reshaped, it is the tokens, uncopied. Any
    other plan is copied with ``np.take``, one whole block (or token) a row::

        run (7, 8, 9):   keys[7:10] -> reshape (3 * block_size, H, d) -> [offset : offset + n]
        blocks (7, 3):   np.take(keys, [7, 3], axis=0, out=scratch)    -> [offset : offset + n]
        slots [30, 12]:  np.take(keys.reshape(-1, H, d), [30, 12], axis=0, out=scratch)

    Either way the result has unit stride along its last two axes, so
    attention rounds the same on each (see :mod:`pagedkv.attention`).

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


# ------------------------------------------ one side of one layer, as stored
# A side is ``store`` (num_blocks, block_size, num_kv_heads, head_dim) of floats or codes and, when
# its format has scales (int8, fp8), ``scales`` (num_blocks, block_size, num_kv_heads, num_groups).
# Readers return head-major (num_kv_heads, num_tokens, ...), as the chunked kernels read it:
#
#     store (blocks 7, 3; block_size 2):   blk 7: t0 t1 | blk 3: t2 t3
#     run_tokens / take_tokens:            (H, 4 tokens, d), codes as stored

def run_tokens(side: _Side, first_id: int, num_blocks: int, lo: int, hi: int) -> Tokens:
    """Tokens ``lo .. hi - 1`` of the ``num_blocks`` blocks from ``first_id`` on (views).

    ``side`` is one side's ``(pages, scales, storage format)``.
    """
    store, scales, storage = side
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
    """Tokens at ``slots`` (``block_id * block_size + offset``), in order.

    Float pages: a new array (transposed). Codes: nothing is copied; the
    :class:`QuantizedTokens` names the side's pages and ``slots``, and the
    chunked kernel copies each chunk's codes as it reads them.
    """
    num_blocks, block_size, heads, head_dim = store.shape
    flat = store.reshape(num_blocks * block_size, heads, head_dim)
    if storage is None:
        codes: npt.NDArray[Any] = np.take(flat, slots, axis=0).transpose(1, 0, 2)
        return codes
    flat_scales = None if scales is None else scales.reshape(num_blocks * block_size, heads, -1)
    return QuantizedTokens(flat.transpose(1, 0, 2), _heads_first(flat_scales), storage, slots)


def _viewed_side(stored: npt.NDArray[Any], side: _Side, slots: npt.NDArray[np.intp]) -> Tokens:
    """One side's view ``(n, H, d)`` as head-major tokens: floats, or codes with their scales.

    The scales are not in the page file: the tokens name the side's scales
    and ``slots``, read by slot where attention reads them (no copy here).
    """
    codes: npt.NDArray[Any] = stored.transpose(1, 0, 2)
    _, scales, storage = side
    if storage is None:
        return codes
    if scales is None:
        return QuantizedTokens(codes, None, storage)
    num_blocks, block_size, heads, num_groups = scales.shape
    flat = scales.reshape(num_blocks * block_size, heads, num_groups)
    return QuantizedTokens(codes, flat.transpose(1, 0, 2), storage, scale_slots=slots)


def _heads_first(scales: npt.NDArray[np.floating] | None) -> npt.NDArray[np.floating] | None:
    return None if scales is None else scales.transpose(1, 0, 2)


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


# ---------------------------------------------------------------- the store

#: One side of a layer's storage: floats or codes, scales or None, format or None.
_Side = tuple[npt.NDArray[Any], "npt.NDArray[np.floating] | None", "StorageFormat | None"]


class PageStore:
    """The pages of a pool: keys, values and scales per layer, indexed by block id.

    Token-major: one block of one side of one layer is one stretch of memory
    (64 KiB at 16 x 8 x 128 x float32, sixteen 4 KiB pages)::

        key_pages(layer), value_pages(layer):  (num_blocks, block_size, num_kv_heads, head_dim)
        storage:  | blk 0: t0 (H x d) t1 ... | blk 1: ... | blk 2: ... |

    ``keys(layer)`` / ``values(layer)`` (and ``key_scales`` / ``value_scales``)
    are head-major views of the same memory, ``(num_kv_heads, num_blocks,
    block_size, head_dim)``, for code written against the earlier layout
    (snapshots store that order). A store knows block ids, slots and arrays
    only; which blocks are free is its :class:`~pagedkv.memory.pool.KVPool`'s business.

    Invariants (checked by ``check_invariants``):
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
        arrays = new_page_arrays(num_layers, shape, key_store, value_store, in_file, views_required)
        self._keys, self._values = arrays.keys, arrays.values
        #: The shared file the pages sit in (page views map it), or None for plain arrays.
        self.page_file = arrays.page_file
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
                run_tokens(key_side, first, num, lo, hi),
                run_tokens(value_side, first, num, lo, hi),
            )
        slots = plan.slot_array(self.block_size)
        return take_tokens(*key_side, slots), take_tokens(*value_side, slots)

    def viewed_tokens(
        self, layer: int, viewed: tuple[npt.NDArray[Any], npt.NDArray[Any]], slots: npt.NDArray[np.intp]
    ) -> tuple[Tokens, Tokens]:
        """A quantized pool's view read as attention reads it: codes as mapped, scales taken by slot.

        Args:
            layer: the layer read.
            viewed: the keys' and values' stored ``(num_tokens, H, d)`` arrays
                from a page view (:meth:`~pagedkv.memory.views.PageViews.read`).
            slots: the same tokens' slots, for the scales (not in the page file).
        """
        sides = self._sides(layer)
        return (_viewed_side(viewed[0], sides[0], slots), _viewed_side(viewed[1], sides[1], slots))

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
        """Copy the scales of ``sources`` into ``destinations`` of ``target`` (default: this store).

        Does nothing when neither side has scales. Code that moves a quantized
        pool's codes itself (``keys(layer)[:, ids] = ...``) calls this too.
        """
        into = self if target is None else target
        for mine, theirs in ((self._key_scales, into._key_scales), (self._value_scales, into._value_scales)):
            for layer, scales in enumerate(mine):
                theirs[layer][destinations] = scales[sources]

    def grow(self, num_blocks: int) -> None:
        """Make every array ``num_blocks`` blocks long, keeping its blocks (the new ones zeroed).

        Every bigger array is allocated before any is kept, so a failure changes nothing.

        Raises:
            MemoryError, ValueError, OverflowError: the bigger arrays cannot be allocated.
        """
        groups = self._groups()
        bigger = [[np.zeros((num_blocks, *a.shape[1:]), a.dtype) for a in arrays] for arrays in groups]
        for arrays, new_arrays in zip(groups, bigger):
            for layer, (array, new_array) in enumerate(zip(arrays, new_arrays)):
                new_array[: array.shape[0]] = array
                arrays[layer] = new_array
        self._token_rows = self._flat_rows()

    def move_to_front(self, block_ids: list[int]) -> None:
        """Copy the blocks ``block_ids`` to ids ``0 .. k - 1`` in that order, in every array."""
        for arrays in self._groups():
            for array in arrays:
                array[: len(block_ids)] = array[block_ids]

    def check_invariants(self, num_blocks: int) -> None:
        """Raise ``AssertionError`` if an array's shape breaks the class invariants for ``num_blocks``."""
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

    # ---------------------------------------------------------------- private

    def _flat_rows(self) -> list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] | None:
        """Each layer's keys and values as ``(num_slots, H * d)`` views (None when quantized)."""
        if self.quantized:
            return None
        flat = (-1, self.num_kv_heads * self.head_dim)
        return [(keys.reshape(flat), values.reshape(flat)) for keys, values in zip(self._keys, self._values)]

    def _groups(self) -> tuple[list[npt.NDArray[Any]], ...]:
        return (self._keys, self._values, self._key_scales, self._value_scales)

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
