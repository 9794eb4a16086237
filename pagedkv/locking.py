"""The concurrency rules in code: commands under the pool's lock, finalizers that never wait for it.

Every command that changes a pool's allocator or pages holds ``pool.lock``
(a plain ``threading.Lock``); attention runs outside it on per-thread
scratch. A finalizer (a cache or manager dropped without ``close``/``free``)
may run in any thread at any moment, even inside a command of its own thread,
so it takes the lock only if it is free and otherwise hands its frees to the
allocator, which runs them at its next ``allocate``. See "Concurrency" in
docs/design.md. No vLLM counterpart: its engine core schedules from one thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from pagedkv.blocks.table import BlockTable
from pagedkv.memory.pool import KVPool

__all__ = ["locked", "release_cache", "run_or_defer"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _OnPool(Protocol):
    pool: KVPool


_Self = TypeVar("_Self", bound=_OnPool)


def locked(method: Callable[Concatenate[_Self, _P], _R]) -> Callable[Concatenate[_Self, _P], _R]:
    """Run a command of an object with a ``pool`` under that pool's lock."""

    def run(self: _Self, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.pool.lock:
            return method(self, *args, **kwargs)

    functools.update_wrapper(run, method)
    return run


def run_or_defer(pool: KVPool, action: Callable[[], None]) -> None:
    """Run ``action`` (a dropped owner giving its blocks back) under ``pool``'s lock, now or later.

    Now when the lock is free; otherwise (another thread, or this one in the
    middle of a command, holds it) it waits in the allocator until its next
    ``allocate``: a finalizer can neither deadlock nor change an allocator in
    the middle of a command.
    """
    if pool.lock.acquire(blocking=False):
        try:
            pool.allocator.release_deferred()
            action()
        finally:
            pool.lock.release()
    else:
        pool.allocator.defer(action)


def release_cache(pool: KVPool, table: BlockTable) -> None:
    """A dropped ``KVCache``'s finalizer: give its table's blocks back to its shared pool."""
    block_ids = table.clear()
    run_or_defer(pool, lambda: pool.allocator.free(block_ids))
