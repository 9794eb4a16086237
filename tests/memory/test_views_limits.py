"""Page views at their limits: a kernel that refuses mappings, spent budgets, hostile block ids.

Each test pins down one promise of docs/paging.md ("Page views"): a refused
mapping (any ``OSError``, zeros included) gathers that read with the same
output and gives its areas back; nothing stays charged once the caches are
closed; an id past the pool's end is a typed error, never a SIGBUS;
``view_mode="views"`` without a page file is a ``ConfigError``; every read is
counted once, as a view read or a gather read.
"""

from __future__ import annotations

import ctypes
import errno
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import KVCache, KVCacheManager, KVPool
from pagedkv.blocks.table import ReadPlan
from pagedkv.errors import ConfigError, UnknownBlockError
from pagedkv.memory import vmem
from pagedkv.memory.vmem import descriptor_budget, map_budget

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="views are Linux only")

BS, H, D = 16, 1, 64  # one 4 KiB page a block at float32
F32 = np.float32


def make_pool(view_mode: str, num_blocks: int = 32) -> KVPool:
    return KVPool(num_blocks, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, view_mode=view_mode)


def refuse_zero_mappings(monkeypatch: pytest.MonkeyPatch, allowed: int) -> Callable[[], None]:
    """Make the kernel refuse (ENOMEM) every zero mapping after the first ``allowed``; return a restorer.

    Zero mappings are anonymous (fd -1): the mmap that failed with "mapping
    zeros over a view failed" a few areas below vm.max_map_count.
    """
    libc = vmem._libc()
    real = libc.mmap
    calls = [0]

    def mmap(address: int, size: int, prot: int, flags: int, fd: int, offset: int) -> Any:
        if fd == -1:
            calls[0] += 1
            if calls[0] > allowed:
                ctypes.set_errno(errno.ENOMEM)
                return ctypes.c_void_p(-1).value
        return real(address, size, prot, flags, fd, offset)

    monkeypatch.setattr(libc, "mmap", mmap)
    return lambda: monkeypatch.setattr(libc, "mmap", real)


def cache_outputs(pool: KVPool, steps: int, check: Callable[[], None] = lambda: None) -> list[np.ndarray]:
    """Two windowed caches taking turns on ``pool`` (fragmented, evicting); every output, then closed."""
    caches = [KVCache(40, pool=pool) for _ in range(2)]
    rng = np.random.default_rng(7)
    outs = []
    for _ in range(steps):
        for cache in caches:
            q, k, v = rng.standard_normal((3, H, D)).astype(F32) / 4
            outs.append(cache.attend(q, k, v))
            check()
    for cache in caches:
        cache.close()
    return outs


def manager_outputs(pool: KVPool, steps: int) -> list[np.ndarray]:
    """Two sequences of a windowed manager decoding in turn; every output, then freed."""
    manager = KVCacheManager(pool, max_size=40)
    rng = np.random.default_rng(8)
    outs = []
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id)
    for _ in range(steps):
        for seq_id in ("a", "b"):
            batch = manager.reserve({seq_id: 1})
            kv = rng.standard_normal((1, H, D)).astype(F32)
            manager.write(0, batch, kv, kv)
            outs.append(manager.attend(0, batch, rng.standard_normal((1, H, D)).astype(F32)))
    manager.check_invariants()
    for seq_id in ("a", "b"):
        manager.free(seq_id)
    return outs


# ------------------------------------------------------------ refused mappings


@pytest.mark.parametrize("outputs", [cache_outputs, manager_outputs], ids=["KVCache", "KVCacheManager"])
def test_a_zero_mapping_the_kernel_refuses_gathers_that_read_with_equal_outputs(
    monkeypatch: pytest.MonkeyPatch, outputs: Callable[[KVPool, int], list[np.ndarray]]
) -> None:
    expected = outputs(make_pool("gather"), 60)
    pool = make_pool("views")
    used = map_budget().num_used
    refuse_zero_mappings(monkeypatch, allowed=3)  # the first evictions zero, then the kernel refuses
    got = outputs(pool, 60)  # no OSError reaches attend
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    stats = pool.view_stats
    assert stats.num_fallbacks > 0 and stats.num_gather_reads > 0 and stats.num_view_reads > 0
    assert stats.num_view_reads + stats.num_gather_reads == len(got)
    assert map_budget().num_used >= used  # ranges the kernel would not zero still hold their areas


def test_after_refused_zero_mappings_closing_every_cache_gives_every_area_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = make_pool("views")
    used = map_budget().num_used
    restore = refuse_zero_mappings(monkeypatch, allowed=3)
    cache_outputs(pool, 60, check=pool.check_invariants)  # invariants hold after every refusal
    # The caches closed while the kernel still refused: their ranges wait, zeroed by the next call.
    restore()
    assert pool.num_mapped_blocks == 0
    assert map_budget().num_used == used
    pool.check_invariants()


def test_a_failed_attention_after_the_append_leaves_the_cache_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # block_size 16, unbounded: step 16 takes a new block, step 17 writes into it.
    pool = make_pool("views", 8)
    cache = KVCache(pool=pool)
    rng = np.random.default_rng(3)
    tokens = rng.standard_normal((20, 3, H, D)).astype(F32) / 4
    for q, k, v in tokens[:16]:
        cache.attend(q, k, v)

    def broken(*args: object) -> object:
        raise MemoryError("no memory for the scores")

    for q, k, v in tokens[16:18]:
        keys, values = cache.keys(), cache.values()
        state = (len(cache), cache.num_tokens, cache.block_ids, pool.num_free_blocks,
                 cache.check_invariants())
        monkeypatch.setattr("pagedkv.cache.attend_sequence", broken)
        with pytest.raises(MemoryError, match="no memory for the scores"):
            cache.attend(q, k, v)
        assert (len(cache), cache.num_tokens, cache.block_ids, pool.num_free_blocks,
                cache.check_invariants()) == state
        assert np.array_equal(cache.keys(), keys) and np.array_equal(cache.values(), values)
        monkeypatch.undo()
        cache.attend(q, k, v)  # the same token again, as if the failed call never happened
    fresh = KVCache(pool=make_pool("gather", 8))
    for q, k, v in tokens[:18]:
        fresh.attend(q, k, v)
    assert np.array_equal(cache.keys(), fresh.keys())
    q, k, v = tokens[18]
    assert np.array_equal(cache.attend(q, k, v), fresh.attend(q, k, v))


# ------------------------------------------------------------------ block ids

CRASH = textwrap.dedent("""
    import numpy as np
    from pagedkv import KVPool
    from pagedkv.blocks.table import BlockTable
    from pagedkv.errors import UnknownBlockError
    from pagedkv.memory.vmem import map_budget
    pool = KVPool(8, block_size=16, head_dim=64, dtype=np.float32, view_mode={mode!r})
    table = BlockTable(16)
    table.append(32, [3, 100])  # id 100 is past the pool's end (ids 0 to 7)
    used = map_budget().num_used
    try:
        keys, values = pool.read(0, table, [(0, 32)])
        print("read:", float(keys.sum() + values.sum()))  # touches every page read
    except UnknownBlockError as error:
        print("refused:", error)
    stats = pool.view_stats
    print("unchanged:", map_budget().num_used == used, pool.num_mapped_blocks,
          stats.num_view_reads + stats.num_gather_reads + stats.num_maps)
    pool.check_invariants()
""")


@pytest.mark.parametrize("mode", ["views", "gather"])
def test_reading_a_block_id_past_the_pool_end_is_a_typed_error_not_a_crash(mode: str) -> None:
    # In a child process: before the fix the views pool mapped past the file's end and died of SIGBUS.
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", CRASH.format(mode=mode)], capture_output=True, text=True,
                          cwd=root, timeout=60, check=False)
    assert done.returncode == 0, f"the read killed the process: rc {done.returncode}\n{done.stderr}"
    assert "refused: block id 100 is not in this pool (ids 0 to 7)" in done.stdout
    assert "unchanged: True 0 0" in done.stdout


def test_a_plan_naming_a_slot_past_the_pool_end_is_refused() -> None:
    pool = make_pool("gather", 4)
    with pytest.raises(UnknownBlockError, match="slot 64 is not in this pool"):
        pool.gather_tokens(0, ReadPlan(2, slots=np.array([3, 64])))


# -------------------------------------------------------------- configuration


def test_views_past_the_descriptor_budget_is_a_config_error_and_auto_gathers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = descriptor_budget()
    used = budget.num_used
    monkeypatch.setattr(budget, "limit", used)  # no page file fits
    spent = rf"page files hold {used:,} of the {used:,} descriptors .*; use 'auto' or 'gather'"
    with pytest.raises(ConfigError, match=spent):
        make_pool("views")
    assert make_pool("auto").view_mode == "gather"
    assert budget.num_used == used


def test_views_whose_page_file_the_kernel_refuses_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    used = descriptor_budget().num_used

    def refuse(size: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("pagedkv.memory.pages.open_page_file", refuse)
    with pytest.raises(ConfigError, match=r"no page file could be made \(.*Too many open files\)"):
        make_pool("views")
    assert make_pool("auto").view_mode == "gather"
    assert descriptor_budget().num_used == used


# ------------------------------------------------------------------ statistics


@pytest.mark.parametrize("num_sink_tokens", [0, 4])
@pytest.mark.parametrize("method", ["loop", "padded"])
def test_every_read_counts_once_as_a_view_or_a_gather_read(num_sink_tokens: int, method: str) -> None:
    pool = make_pool("views", 64)
    manager = KVCacheManager(pool, max_size=40, num_sink_tokens=num_sink_tokens)
    rng = np.random.default_rng(9)
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id)
    num_reads = 0
    for step in range(80):
        batch = manager.reserve({"a": 1, "b": 1} if step % 3 else {"a": 5, "b": 1})  # decodes and prefills
        kv = rng.standard_normal((batch.num_tokens, H, D)).astype(F32)
        manager.write(0, batch, kv, kv)
        manager.attend(0, batch, rng.standard_normal((batch.num_tokens, H, D)).astype(F32), method=method)
        num_reads += 2  # one read per sequence
    stats, metrics = pool.view_stats, manager.metrics()
    assert stats.num_view_reads + stats.num_gather_reads == num_reads
    assert metrics.num_view_reads == stats.num_view_reads
    assert metrics.num_gather_reads == stats.num_gather_reads
    if num_sink_tokens:  # a window behind sinks is two ranges: every read gathers
        assert stats.num_view_reads == 0
    elif method == "loop":
        assert stats.num_view_reads > 0
