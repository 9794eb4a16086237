"""What ``os.fork()`` does to page files: the child gets pages of its own, never its parent's.

A page file is shared memory, so a child writing its pools would write its parent's. Every pool
with a page file is tracked here; at each fork (``os.register_at_fork``) its live pages are copied
(into a new file, or private memory when no descriptor is left) and the child maps the copy over
its pool's own mapping in place and drops its views. Locks are taken in pagedkv's one lock order:
this module's fork lock, then pools' locks, then their views' locks, in the order the pools were
made. vLLM and SGLang have no counterpart (their workers start with ``spawn``). The hook step by
step, the lock order and the fall-backs: docs/paging.md, "Safety rules", item 6.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

from pagedkv.memory.views import PageFile, PageViews
from pagedkv.memory.vmem import (
    copy_file,
    move_mapping,
    open_page_file,
    private_copy,
    remap_shared,
    renew_locks,
    seal,
    unmap,
)

__all__ = ["LOCK_TIMEOUT_S", "ForkCopy", "track"]

#: How long ``before`` waits for a busy pool lock before forking without it (the
#: forking thread itself may hold it; then the child releases it as the parent would).
LOCK_TIMEOUT_S = 10.0


class ForkCopy:
    """One pool's part in a fork: its lock, its views (``views.pages``: its page file), its order."""

    def __init__(self, lock: Any, views: PageViews, order: int) -> None:
        self.lock = lock
        self.views = views
        #: Creation sequence number: locks are taken in increasing ``order``.
        self.order = order


@dataclass
class _Fork:
    """One fork in flight, made by ``before`` in the forking thread and ended by its ``after`` hooks."""

    held: list[Any] = field(default_factory=list)  # locks taken, in the lock order
    files: dict[ForkCopy, int] = field(default_factory=dict)  # a pool's copy: a new file's descriptor
    memory: dict[ForkCopy, int] = field(default_factory=dict)  # or private memory's address


_TRACKED: weakref.WeakSet[ForkCopy] = weakref.WeakSet()
_TRACKED_LOCK = threading.Lock()  # guards _TRACKED against a pool made while a fork reads it
_ORDER = itertools.count()
# NOTE: forks are serialised: a second thread's ``before`` would otherwise wait for
# the first fork's locks only up to LOCK_TIMEOUT_S and then fork without them.
_FORKING = threading.Lock()
# NOTE: per thread, not module-wide: ``before`` and ``after_in_parent`` run in the
# forking thread (``after_in_child`` in its copy), and each fork releases only its own locks.
_LOCAL = threading.local()


def track(lock: Any, views: PageViews) -> ForkCopy:
    """Give a pool's page file a copy of its own in every forked child, while the pool holds the result."""
    with _TRACKED_LOCK:
        record = ForkCopy(lock, views, next(_ORDER))
        _TRACKED.add(record)
    return record


def _before() -> None:
    with _TRACKED_LOCK:
        records = sorted(_TRACKED, key=lambda record: record.order)
    if not records:
        return
    _FORKING.acquire()
    fork = _LOCAL.fork = _Fork()
    locks = [record.lock for record in records] + [record.views.lock for record in records]
    fork.held = _take_in_order(locks)
    for record in records:
        pages = record.views.pages
        try:
            fork.files[record] = _copy(pages)
        except OSError:  # no descriptor left (EMFILE): private memory needs none
            with contextlib.suppress(OSError):  # no memory either: the child seals the pages
                fork.memory[record] = private_copy(pages.address, pages.size, pages.fd)


def _after_in_parent() -> None:
    fork: _Fork | None = getattr(_LOCAL, "fork", None)
    if fork is None:
        return
    _LOCAL.fork = None
    _end(fork)


def _after_in_child() -> None:
    global _TRACKED_LOCK
    renew_locks()
    _TRACKED_LOCK = threading.Lock()  # a parent thread making a pool may have held it
    fork: _Fork | None = getattr(_LOCAL, "fork", None)
    _LOCAL.fork = None
    try:
        # A pool tracked after ``before`` looked (made by another thread) has no copy: sealed.
        for record in list(_TRACKED):
            if fork is not None and record in fork.files:
                _adopt(record.views.pages, fork.files.pop(record))
                record.views.release_all_after_fork()
            else:
                _make_private(record, None if fork is None else fork.memory.pop(record, None))
    finally:
        if fork is not None:
            _end(fork)


def _take_in_order(locks: list[Any]) -> list[Any]:
    """Take ``locks`` in their order, never waiting while holding one; return those taken."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    skipped: set[int] = set()
    while True:
        held: list[Any] = []
        busy = None
        for lock in locks:
            if id(lock) in skipped:
                continue
            if not lock.acquire(blocking=False):
                busy = lock
                break
            held.append(lock)
        if busy is None:
            return held
        _release(held)
        if busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
            busy.release()  # free now: start again from the first lock
        else:
            skipped.add(id(busy))
            warnings.warn(f"pagedkv: forking without a pool lock still held after {LOCK_TIMEOUT_S} s; "
                          "the child inherits it held", RuntimeWarning, stacklevel=1)


def _copy(page_file: PageFile) -> int:
    """A new file holding what ``page_file`` holds (its holes stay holes); the caller owns it."""
    fd = open_page_file(page_file.size)
    try:
        copy_file(page_file.fd, fd, page_file.size)
    except OSError:
        os.close(fd)
        raise
    return fd


def _adopt(page_file: PageFile, copy: int) -> None:
    """In the child: show file ``copy`` at the pool's mapping and give it ``page_file.fd``'s number."""
    try:
        remap_shared(page_file.address, page_file.size, copy)
        # NOTE: dup2 needs no free descriptor, and makes the target inheritable unless told
        # otherwise: a program the child execs would keep the pages open for its lifetime.
        os.dup2(copy, page_file.fd, inheritable=False)  # the old file is closed here
    finally:
        os.close(copy)
    page_file.resident[:] = bytes(len(page_file.resident))  # the new mapping has no pages yet


def _make_private(record: ForkCopy, copy: int | None) -> None:
    """In the child, without a file of its own: show private memory ``copy`` at the pool's mapping.

    The pool gathers from then on. Without a copy (``None``: no memory for
    one, or a pool made after ``before`` looked) its pages are sealed.
    """
    page_file = record.views.pages
    try:
        if copy is None:
            raise OSError(errno.ENOMEM, "no copy of the pages was made before the fork")
        move_mapping(copy, page_file.size, page_file.address)
    except OSError as error:  # pragma: no cover - no memory for the copy
        seal(page_file.address, page_file.size)
        warnings.warn(f"pagedkv: a forked child has no copy of a pool's pages ({error}); "
                      "touching that pool kills the child", RuntimeWarning, stacklevel=1)
    # Its views would map the parent's file: none is mapped again. Private memory is
    # copied on write at later forks, as plain arrays are, so the pool needs no tracking.
    record.views.release_all_after_fork(mappable=False)
    _TRACKED.discard(record)


def _end(fork: _Fork) -> None:
    """Release what ``before`` took, in reverse, and drop the copies left unused."""
    for record, copy in fork.memory.items():
        unmap(copy, record.views.pages.size)
    for fd in fork.files.values():
        os.close(fd)
    fork.memory.clear()
    fork.files.clear()
    _release(fork.held)
    fork.held = []
    _FORKING.release()


def _release(locks: list[Any]) -> None:
    for lock in reversed(locks):
        lock.release()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork (and no page file)
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
