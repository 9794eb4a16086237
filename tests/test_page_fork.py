"""A forked child gets its own copy of every page file (pagedkv.page_fork).

Without it a child's writes land in its parent's pages and the other way
round: the first test read 9.0 (a child's token) where its parent had cached
1.0. Each child reports through its exit status.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from pagedkv import KVCache, KVPool
from pagedkv.views import PageViews
from pagedkv.vmem import copy_file, open_page_file

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not sys.platform.startswith("linux"),
                                reason="page files and fork: Linux")

CHILD_TIMEOUT_S = 30.0
D = 64  # one token of one side: 256 bytes; a block of 16: one 4 KiB page
F32 = np.float32


def views_pool(num_blocks: int = 8) -> KVPool:
    return KVPool(num_blocks, block_size=16, num_kv_heads=1, head_dim=D, dtype=F32, view_mode="views")


def close_to(out: np.ndarray, value: float) -> bool:
    return bool(np.allclose(out, value, rtol=1e-5, atol=0))


def token(value: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.ones(D, F32), np.full(D, value, F32), np.full(D, value, F32)


def interleaved(pool: KVPool, num_tokens: int, first: float, second: float) -> tuple[KVCache, KVCache]:
    """Two caches written in turns (so neither table is one run: both read through views)."""
    caches = KVCache(pool=pool), KVCache(pool=pool)
    for _ in range(num_tokens):
        caches[0].attend(*token(first))
        caches[1].attend(*token(second))
    return caches


def overwrite_every_block(pool: KVPool, caches: tuple[KVCache, ...], value: float) -> np.ndarray:
    """Clear ``caches``, then cache ``value`` in every block of ``pool``; the last output."""
    for cache in caches:
        cache.clear()
    theirs = KVCache(pool=pool)
    for _ in range(pool.num_blocks * pool.block_size):
        out = theirs.attend(*token(value))
    return out


def in_child(body: Callable[[], None], *, after_fork: Callable[[], None] = lambda: None) -> None:
    """Run ``body`` in a forked child; fail here if it raised (its traceback goes to stderr)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads alive
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; coverage does not follow it
        code = 0
        try:
            body()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    after_fork()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:  # a child stuck on a lock its parent's thread held at the fork
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child did not finish in {CHILD_TIMEOUT_S} s")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child failed (traceback above)"


def test_a_childs_writes_never_reach_its_parents_pages() -> None:
    pool = views_pool()
    mine, other = interleaved(pool, 40, 1.0, 2.0)
    before = mine.attend(*token(1.0))

    def child() -> None:
        assert close_to(overwrite_every_block(pool, (mine, other), 9.0), 9.0)
        pool.check_invariants()

    in_child(child)
    after = mine.attend(*token(1.0))
    assert close_to(before, 1.0) and close_to(after, 1.0)
    pool.check_invariants()


def test_a_parents_writes_after_the_fork_never_reach_the_child() -> None:
    pool = views_pool()
    mine, other = interleaved(pool, 20, 1.0, 2.0)
    read_end, write_end = os.pipe()

    def child() -> None:
        os.close(write_end)
        assert os.read(read_end, 1) == b"1"  # the parent has rewritten every block by now
        assert close_to(mine.attend(*token(1.0)), 1.0)
        assert close_to(other.attend(*token(2.0)), 2.0)
        pool.check_invariants()

    def parent() -> None:
        os.close(read_end)
        overwrite_every_block(pool, (mine, other), 7.0)
        os.write(write_end, b"1")
        os.close(write_end)

    in_child(child, after_fork=parent)


def test_an_array_read_before_the_fork_reads_zeros_in_the_child_never_the_parents_data() -> None:
    pool = views_pool()
    _spacer, mine = interleaved(pool, 33, 3.0, 1.0)  # the spacer keeps mine fragmented
    keys, _ = pool.read(0, mine._table, [(0, 33)])
    assert pool.view_stats.num_view_reads >= 1 and np.all(keys == 1.0)

    def child() -> None:
        assert np.all(keys == 0.0)  # released, as after close(); its range is still mapped
        fresh, _ = pool.read(0, mine._table, [(0, 33)])
        assert np.all(fresh == 1.0)
        pool.check_invariants()

    in_child(child)
    assert np.all(keys == 1.0)  # the parent's views are untouched


def test_copying_a_page_file_keeps_its_holes() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    size = 64 * page
    source, target = open_page_file(size), open_page_file(size)
    try:
        os.pwrite(source, b"a" * page, 3 * page)
        os.pwrite(source, b"b" * (2 * page), 40 * page)
        copy_file(source, target, size)
        assert os.pread(target, size, 0) == os.pread(source, size, 0)
        assert os.lseek(target, 0, os.SEEK_DATA) == 3 * page  # pages 0-2: still a hole
        assert os.lseek(target, 4 * page, os.SEEK_DATA) == 40 * page
    finally:
        os.close(source)
        os.close(target)


def test_a_pool_of_plain_arrays_needs_no_copy() -> None:
    pool = KVPool(8, block_size=16, num_kv_heads=1, head_dim=D, dtype=F32, view_mode="gather")
    cache = KVCache(pool=pool)
    for _ in range(20):
        cache.attend(*token(1.0))

    def child() -> None:
        assert close_to(overwrite_every_block(pool, (cache,), 5.0), 5.0)

    in_child(child)
    assert close_to(cache.attend(*token(1.0)), 1.0)


def test_copying_without_copy_file_range_goes_through_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> int:
        raise OSError(18, "EXDEV")

    monkeypatch.setattr(os, "copy_file_range", refused)
    page = os.sysconf("SC_PAGE_SIZE")
    size = 8 * page
    source, target = open_page_file(size), open_page_file(size)
    try:
        os.pwrite(source, bytes(range(256)) * (page // 64), 2 * page)
        copy_file(source, target, size)
        assert os.pread(target, size, 0) == os.pread(source, size, 0)
    finally:
        os.close(source)
        os.close(target)


def test_a_fork_waits_for_a_view_read_another_thread_is_in_the_middle_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = views_pool()
    _spacer, mine = interleaved(pool, 20, 3.0, 1.0)  # the spacer keeps mine fragmented
    inside = threading.Event()
    sync = PageViews._sync

    def slow_sync(self: PageViews, *args: object) -> object:
        if threading.current_thread().name == "reader" and not inside.is_set():
            inside.set()  # the registry's lock is held, its account charged, the range not made
            time.sleep(0.3)
        return sync(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PageViews, "_sync", slow_sync)
    pool.release_views(mine._table)  # its next read maps again, through slow_sync
    reader = threading.Thread(target=lambda: mine.attend(*token(1.0)), name="reader")
    reader.start()
    assert inside.wait(5)

    def child() -> None:
        pool.check_invariants()  # the read was finished before the fork, or not begun
        assert close_to(mine.attend(*token(1.0)), 1.0)

    in_child(child)
    reader.join()
    pool.check_invariants()
