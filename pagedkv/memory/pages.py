"""Where a pool's pages live: plain arrays, or one shared page file that views can map.

Every layer's keys and values are ``(num_blocks, block_size, num_kv_heads,
head_dim)``, token-major: one block of one side of one layer is one stretch of
``block_size * num_kv_heads * head_dim`` values (64 KiB at 16 x 8 x 128 x
float32), a whole number of 4 KiB pages whenever it is mappable at all.

:func:`choose_view_mode` decides how attention reads a fragmented table:
``"views"`` (the pages sit in a page file and each table's blocks are mapped
side by side, :mod:`pagedkv.memory.views`) or ``"gather"`` (copied into scratch,
:mod:`pagedkv.memory.gather`). Both give the same arrays, bit for bit.
"""

from __future__ import annotations

import errno
import mmap
import os
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.memory.views import PageFile
from pagedkv.memory.vmem import (
    FDS_PER_PAGE_FILE,
    PAGE_SIZE,
    MapBudget,
    descriptor_budget,
    open_page_file,
    views_supported,
)

__all__ = ["VIEW_MODES", "PageArrays", "choose_view_mode", "new_page_arrays"]

#: What ``KVPool(view_mode=...)`` accepts.
VIEW_MODES = ("auto", "views", "gather")


def choose_view_mode(requested: object, *, growable: bool, quantized: bool, block_bytes: int) -> str:
    """``"views"`` or ``"gather"``: how a pool with these properties reads fragmented tables.

    Args:
        requested: ``"auto"`` (views where they work), ``"views"`` (views or
            an error) or ``"gather"`` (never map).
        growable: a growable pool moves its arrays when it grows; it gathers.
        quantized: quantized pages (codes and scales) are gathered.
        block_bytes: bytes of one block of one side of one layer.

    Raises:
        InputTypeError, ConfigError: ``requested`` is not one of ``VIEW_MODES``,
            or is ``"views"`` where views cannot work (the message says why).

    >>> choose_view_mode("auto", growable=False, quantized=False, block_bytes=100)
    'gather'
    """
    if not isinstance(requested, str):
        raise InputTypeError(f"view_mode must be one of {VIEW_MODES}, got {requested!r}")
    if requested not in VIEW_MODES:
        raise ConfigError(f"view_mode must be one of {VIEW_MODES}, got {requested!r}")
    if requested == "gather":
        return "gather"
    reason = _why_not_views(growable, quantized, block_bytes)
    if reason is None:
        return "views"
    if requested == "views":
        raise _views_impossible(reason)
    return "gather"


def _views_impossible(reason: str) -> ConfigError:
    return ConfigError(f"view_mode='views' is impossible here: {reason}; use 'auto' or 'gather'")


def _why_not_views(growable: bool, quantized: bool, block_bytes: int) -> str | None:
    if growable:
        return "the pool is growable (its arrays move when it grows)"
    if quantized:
        return "quantized pages are gathered"
    if block_bytes % PAGE_SIZE:
        return (f"a block of one layer's keys takes {block_bytes:,} bytes, not a multiple of the "
                f"{PAGE_SIZE:,}-byte page (block_size x num_kv_heads x head_dim x itemsize)")
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
            return _in_file(num_layers, shape, key_dtype)
        except (OSError, ValueError, OverflowError) as error:
            if required:
                raise _views_impossible(f"no page file could be made ({error})") from None
            # plain arrays below; the pool then gathers
    return PageArrays([np.zeros(shape, key_dtype) for _ in range(num_layers)],
                      [np.zeros(shape, value_dtype) for _ in range(num_layers)], None)


def _in_file(num_layers: int, shape: tuple[int, int, int, int], dtype: np.dtype[Any]) -> PageArrays:
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
        sides = [np.frombuffer(whole, dtype, count=count, offset=index * side_bytes).reshape(shape)
                 for index in range(2 * num_layers)]
    except (OSError, ValueError, OverflowError):
        if fd >= 0:
            os.close(fd)
        descriptors.give(FDS_PER_PAGE_FILE)
        raise
    page_file = PageFile(fd, num_blocks, block_bytes, (shape[2], shape[3]), dtype, num_layers,
                         sides[0].ctypes.data, whole, bytearray(num_blocks))
    # The descriptor lives as long as the PageFile: views map it; the arrays keep `whole` mapped.
    weakref.finalize(page_file, _close_page_file, descriptors, fd)
    return PageArrays(sides[0::2], sides[1::2], page_file)


def _close_page_file(descriptors: MapBudget, fd: int) -> None:
    os.close(fd)
    descriptors.give(FDS_PER_PAGE_FILE)
