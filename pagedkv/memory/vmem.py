"""Virtual memory primitives for page views: a shared page file, address ranges, a map budget.

The float pages can live in one shared memory file (``memfd_create`` or ``/dev/shm``); a
:class:`Reservation` is an address range mapped read-only to zeros, where mapping a block at its
file offset (``MAP_FIXED | MAP_SHARED``) makes any order of blocks read as one array.
:class:`MapBudget` counts the kernel memory areas (``vm.max_map_count``) and descriptors views
may use, for every pool of the process. Linux only (:func:`views_supported`). vAttention's
primitives; vLLM and SGLang have none (they gather). The three safety rules and a diagram:
docs/paging.md ("How a view is mapped").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FDS_PER_PAGE_FILE", "PAGE_SIZE", "MapBudget", "Reservation", "copy_file", "descriptor_budget",
    "map_budget", "move_mapping", "open_page_file", "populate", "private_copy", "remap_shared", "renew_locks",
    "seal", "unmap", "views_supported",
]

#: The granularity of a mapping: a block's bytes must be a multiple of it to be mapped.
PAGE_SIZE = mmap.PAGESIZE

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MREMAP_MAYMOVE, _MREMAP_FIXED = 0x1, 0x2
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
_FAILED = ctypes.c_void_p(-1).value

#: Areas left to everything else in the process when the budget is sized from ``vm.max_map_count``.
_HEADROOM_AREAS = 8192
_DEFAULT_MAX_MAP_COUNT = 65530


class _Libc:
    """ctypes bindings of ``mmap``; loaded once, on first use."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.mmap = libc.mmap
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.madvise = libc.madvise
        libc.mremap.restype = ctypes.c_void_p  # (old, old size, new size, flags, new address)
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p]
        self.mremap = libc.mremap
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munmap = libc.munmap
        #: Whether ``MADV_POPULATE_WRITE`` may work here (False once the kernel says EINVAL).
        self.can_populate = True


_LIBC: _Libc | None = None
_LIBC_LOCK = threading.Lock()


def _libc() -> _Libc:
    global _LIBC
    with _LIBC_LOCK:
        if _LIBC is None:
            _LIBC = _Libc()
        return _LIBC


def views_supported() -> bool:
    """Whether this platform can map page views (Linux with ``MAP_FIXED``; loadable libc).

    >>> isinstance(views_supported(), bool)
    True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        _libc()
    except (OSError, AttributeError):
        return False
    return True


def open_page_file(size: int) -> int:
    """A file descriptor of a new shared memory file of ``size`` bytes (zeros, allocated lazily).

    ``os.memfd_create`` where it exists, else a file under ``/dev/shm``
    unlinked at once. The caller owns the descriptor. It is close-on-exec
    (``MFD_CLOEXEC``; ``mkstemp`` opens with ``O_CLOEXEC``), as every
    descriptor pagedkv makes: a program the process execs never holds pages.

    Raises:
        OSError: neither could be made, or ``size`` bytes cannot be reserved.
    """
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pagedkv-pages", os.MFD_CLOEXEC)
    else:  # pragma: no cover - Linux has memfd_create since 3.17
        import tempfile
        fd, path = tempfile.mkstemp(prefix="pagedkv-pages-", dir="/dev/shm")
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def populate(address: int, size: int) -> bool:
    """Allocate the pages of ``address .. address + size`` and map them for writing, in one call.

    A hint (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+): the bytes do not
    change, and where the kernel lacks it or refuses, nothing happens and the
    pages fault in one by one on first touch, as without it. Returns whether
    the pages were populated. After the first EINVAL (an older kernel) it
    stops asking.

    NOTE: a shared file's page costs a fault the first time each mapping
    touches it: at 8 kv heads x head_dim 128 x float32 every decoded token
    is a new 4 KiB page per side, so a decode call took two write faults and
    two more reading through its views, whose fault-around found nothing else
    resident to map (benchmarks/bench_core.py; docs/paging.md).
    """
    libc = _libc()
    if not libc.can_populate:
        return False
    if libc.madvise(address, size, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        libc.can_populate = False
    return False


def remap_shared(address: int, size: int, fd: int) -> None:
    """Map file ``fd`` read-write and shared over ``address .. address + size``, in place.

    Whatever was mapped there is replaced atomically (``MAP_FIXED``), so
    arrays into the range stay valid and now show the new file.

    Raises:
        OSError: the kernel refused; the old mapping is still there.
    """
    got = _libc().mmap(address, size, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, fd, 0)
    if got in (None, _FAILED):
        raise OSError(ctypes.get_errno(), "mapping a page file over the pool's mapping failed")


def copy_file(source: int, target: int, size: int) -> None:
    """Copy what file ``source`` holds into file ``target`` (same size), skipping its holes.

    Holes stay holes (no memory is taken for blocks never written), found
    with ``SEEK_DATA`` / ``SEEK_HOLE``; data moves with ``os.copy_file_range``
    where the kernel has it, else through ``pread`` / ``pwrite``.

    Raises:
        OSError: a read or write failed.
    """
    for start, end in _data_extents(source, size):
        _copy_range(source, target, start, end)


def private_copy(address: int, size: int, fd: int) -> int:
    """New private anonymous memory holding what file ``fd``, mapped at ``address``, holds; its address.

    Only the file's data extents are copied: its holes stay unallocated
    zeros. Needs no descriptor. A process that forks after this shares the
    copy with its child copy-on-write; :func:`move_mapping` puts it in
    place, :func:`unmap` drops it.

    Raises:
        OSError: no memory for the copy.
    """
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    copy: int | None = _libc().mmap(None, size, _PROT_READ | _PROT_WRITE, flags, -1, 0)
    if copy is None or copy == _FAILED:
        raise OSError(ctypes.get_errno(), f"no memory for a private copy of {size:,} bytes of pages")
    for start, end in _data_extents(fd, size):
        ctypes.memmove(copy + start, address + start, end - start)
    return copy


def move_mapping(source: int, size: int, target: int) -> None:
    """Move the mapping at ``source`` over ``target .. target + size`` atomically (``mremap``).

    Arrays into the target range stay valid and now show what ``source``
    showed; ``source`` is unmapped.

    Raises:
        OSError: the kernel refused; both ranges are as they were.
    """
    got = _libc().mremap(source, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, target)
    if got in (None, _FAILED):
        raise OSError(ctypes.get_errno(), "moving a private copy over the pool's mapping failed")


def seal(address: int, size: int) -> None:
    """Make ``address .. address + size`` inaccessible (``PROT_NONE``): a touch kills the process.

    The last resort of a forked child that has no copy of its pages of any
    kind: it must never write its parent's.
    """
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    _libc().mmap(address, size, 0, flags, -1, 0)


def unmap(address: int, size: int) -> None:
    """Unmap ``address .. address + size`` (a :func:`private_copy` no one will use)."""
    _libc().munmap(address, size)


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte ranges of file ``fd`` that hold data (``SEEK_DATA`` / ``SEEK_HOLE``)."""
    extents = []
    position = 0
    while position < size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # no data past ``position``
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        extents.append((start, end))
        position = end
    return extents


def _copy_range(source: int, target: int, start: int, end: int) -> None:
    while start < end:
        try:
            done = os.copy_file_range(source, target, end - start, start, start)
        except (OSError, AttributeError):
            done = 0
        if done <= 0:  # no copy_file_range here, or it refused: copy through memory
            chunk = os.pread(source, min(end - start, 1 << 24), start)
            if not chunk:
                raise OSError(errno.EIO, f"page file ended at byte {start:,}, before {end:,}")
            done = os.pwrite(target, chunk, start)
        start += done


class Reservation:
    """An address range of ``size`` bytes: read-only zeros until blocks are mapped into it.

    Invariants:
        * the whole range is mapped from creation until the last array into it
          is gone (the ``mmap`` object owns the range);
        * every page of it shows either zeros or one block of the page file.
    """

    def __init__(self, size: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._mmap = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ)
        #: The range as bytes; every view is a slice of it, so it keeps ``_mmap`` alive.
        self.bytes: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, np.uint8)
        self.address: int = self.bytes.ctypes.data
        self.size = size

    def map(self, offset: int, size: int, fd: int, file_offset: int) -> bool:
        """Show ``size`` bytes of file ``fd`` from ``file_offset`` at ``offset`` of the range.

        Returns False (the range unchanged) when the kernel refuses, e.g. at
        ``vm.max_map_count``.

        NOTE: no ``MAP_POPULATE``: it maps a block's pages one by one (16.0
        against 8.5 µs a newly mapped block, K and V, benchmarks/bench_views.py
        (e)), where the first read's fault maps the resident pages around it
        in one go (the kernel's fault-around): about two faults a block.
        """
        got = _libc().mmap(self.address + offset, size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, file_offset)
        return got not in (None, _FAILED)

    def zero(self, offset: int, size: int) -> None:
        """Show zeros at ``offset .. offset + size`` again (the block there is no longer visible).

        Raises:
            OSError: the kernel refused (never seen: zero pages merge with the
                reservation's own area, so they need no new one).
        """
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        got = _libc().mmap(self.address + offset, size, _PROT_READ, flags, -1, 0)
        if got in (None, _FAILED):  # pragma: no cover - see the docstring
            raise OSError(ctypes.get_errno(), "mapping zeros over a view failed")

    def array(self, offset: int, size: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """``size`` bytes from ``offset`` as a read-only array of ``dtype`` (a view into the range)."""
        return self.bytes[offset : offset + size].view(dtype)


class MapBudget:
    """How many memory areas page views may hold, across every pool of the process.

    ``limit`` starts at ``vm.max_map_count`` less a headroom for everything
    else the process maps; tests and benchmarks may set it lower.

    Invariants:
        * ``0 <= num_used <= limit`` after every ``take`` (``limit`` may be set below it).

    >>> budget = MapBudget(limit=10)
    >>> budget.take(4), budget.take(7), budget.num_used
    (True, False, 4)
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = _default_limit() if limit is None else limit
        self.num_used = 0
        self._lock = threading.Lock()

    def take(self, num_areas: int) -> bool:
        """Claim ``num_areas`` areas if they fit under ``limit``; say whether they were claimed."""
        with self._lock:
            if self.num_used + num_areas > self.limit:
                return False
            self.num_used += num_areas
            return True

    def give(self, num_areas: int) -> None:
        """Return ``num_areas`` areas claimed by ``take``."""
        with self._lock:
            self.num_used -= num_areas

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the count went negative."""
        if self.num_used < 0:
            raise AssertionError(f"map budget counts {self.num_used} areas in use")


def _default_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as handle:
            max_map_count = int(handle.read())
    except (OSError, ValueError):
        max_map_count = _DEFAULT_MAX_MAP_COUNT
    return max(0, max_map_count - _HEADROOM_AREAS)


_BUDGET = MapBudget()

#: Descriptors a page file keeps open: its own and the pool mapping's (``mmap.mmap`` dups it).
FDS_PER_PAGE_FILE = 2


def _default_descriptor_limit() -> int:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX: no page files either
        return 256
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 20
    return soft // 4


#: The same counter sized from ``RLIMIT_NOFILE``: page files may hold a quarter of the
#: process's descriptors, so many pools never starve the rest of the program of files.
_DESCRIPTORS = MapBudget(limit=_default_descriptor_limit())


def renew_locks() -> None:
    """In a forked child: new locks for the libc loader and the budget (a parent thread may have held one)."""
    global _LIBC_LOCK
    _LIBC_LOCK = threading.Lock()
    _BUDGET._lock = threading.Lock()
    _DESCRIPTORS._lock = threading.Lock()


def descriptor_budget() -> MapBudget:
    """The process's budget of file descriptors for page files (``FDS_PER_PAGE_FILE`` each).

    A pool that finds it spent keeps plain arrays and gathers: same outputs.

    >>> descriptor_budget().limit > 0
    True
    """
    return _DESCRIPTORS


def map_budget() -> MapBudget:
    """The process's one :class:`MapBudget` (set its ``limit`` to test the fall-back).

    >>> map_budget().limit >= 0
    True
    """
    return _BUDGET
