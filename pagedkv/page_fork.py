"""What ``os.fork()`` does to page files: the child gets a copy of its own.

A pool's plain numpy arrays are private to each process after a fork (copy on
write). Its page file is shared memory: without this module a child that
writes its pools writes its parent's, and the other way round (a child that
cleared its caches and cached new tokens changed what its parent's cache
read, 1.0 to 9.0, tests/test_page_fork.py). Every pool with a page file is
tracked here, and at each fork (``os.register_at_fork``):

* before, in the parent: each pool's lock and its views' lock are taken (so no
  command or view read of another thread is half done in the copy; a lock
  still held after ``LOCK_TIMEOUT_S``, by the forking thread itself, say, is
  left), and a pipe is made;
* in the child: each page file's data (its holes stay holes) is copied into a
  new file, which is mapped over the pool's own mapping in place, so every
  array keeps its address and now shows the copy; every page view is zeroed
  and dropped (the next read maps the new file; an array read before the fork
  reads zeros, as a released view does); the locks are released and the child
  says it is done on the pipe;
* after, in the parent: it waits for that word (or for the child to exit or
  exec, which closes the pipe), then releases the locks.

So each process sees its pools as they were at the fork, and only its own
writes after it. The price: a fork copies every resident page of every live
page-file pool, and the parent waits for it. As with any fork of a process
with threads, a write another thread makes without a pool's lock (a private
``KVCache``'s own pool) may be seen torn in the child.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from pagedkv.views import PageFile, PageViews
from pagedkv.vmem import copy_file, open_page_file, remap_shared, renew_locks

__all__ = ["ForkCopy", "track"]

#: How long ``before`` waits for a pool's lock before forking without it.
LOCK_TIMEOUT_S = 10.0


class ForkCopy:
    """One pool's part in a fork: its lock and its views (``views.pages``: its page file)."""

    def __init__(self, lock: Any, views: PageViews) -> None:
        self.lock = lock
        self.views = views


_TRACKED: weakref.WeakSet[ForkCopy] = weakref.WeakSet()
_held: list[Any] = []  # locks ``before`` took, released after the fork on both sides
_pipe: tuple[int, int] | None = None


def track(lock: Any, views: PageViews) -> ForkCopy:
    """Give a pool's page file a copy of its own in every forked child, while the pool holds the result."""
    record = ForkCopy(lock, views)
    _TRACKED.add(record)
    return record


def _before() -> None:
    global _pipe
    records = list(_TRACKED)
    if not records:
        return
    for record in records:
        # The pool's lock, then its views' (the order every command takes them in):
        # attention reads views outside the pool's lock, under the registry's.
        for lock in (record.lock, record.views.lock):
            if lock.acquire(timeout=LOCK_TIMEOUT_S):
                _held.append(lock)
    _pipe = os.pipe()  # not inherited by an exec: a child that execs closes its end


def _after_in_parent() -> None:
    global _pipe
    if _pipe is not None:
        read_end, write_end = _pipe
        _pipe = None
        os.close(write_end)
        try:
            os.read(read_end, 1)  # the child's word, or EOF when it exits or execs first
        finally:
            os.close(read_end)
    _release_held()


def _after_in_child() -> None:
    global _pipe
    renew_locks()
    try:
        for record in list(_TRACKED):
            _own_copy(record.views.pages)
            record.views.release_all_after_fork()
    except OSError as error:  # pragma: no cover - memfd_create or the copy failed in the child
        warnings.warn(f"pagedkv: a forked child could not copy its page files ({error}); "
                      "its pools still share memory with its parent", RuntimeWarning, stacklevel=1)
    finally:
        _release_held()
        if _pipe is not None:
            read_end, write_end = _pipe
            _pipe = None
            os.close(read_end)
            os.write(write_end, b"1")
            os.close(write_end)


def _own_copy(page_file: PageFile) -> None:
    """Copy ``page_file`` into a new file, show the copy at the pool's mapping, and give it ``fd``."""
    size = page_file.size
    fd = open_page_file(size)
    try:
        copy_file(page_file.fd, fd, size)
        remap_shared(page_file.address, size, fd)
        os.dup2(fd, page_file.fd)  # the old number now names the copy; the old file is closed here
    finally:
        os.close(fd)
    page_file.resident[:] = bytes(len(page_file.resident))  # the new mapping has no pages yet


def _release_held() -> None:
    while _held:
        _held.pop().release()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork (and no page file)
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
