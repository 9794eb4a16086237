"""Page views (pagedkv.memory.views, pagedkv.memory.vmem): same outputs as gathering, and never a stale read.

Pools here use block_size 16, one kv head, head_dim 64, float32: one block of
one side is 4096 bytes, one page, so views apply. Every output is compared
with the no-cache recompute (pagedkv.reference), which shares no paging code.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import sys
import threading

import numpy as np
import pytest

from pagedkv import KVCache, KVCacheManager, KVPool
from pagedkv.blocks.table import BlockTable
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.memory.vmem import Reservation, map_budget
from pagedkv.reference import attend_window, recompute

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="views are Linux only")

BS, H, D = 16, 1, 64
F32 = np.float32


def views_pool(num_blocks: int = 32, **kwargs: object) -> KVPool:
    return KVPool(num_blocks, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, view_mode="views",
                  **kwargs)  # type: ignore[arg-type]


def stream(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((3, n, H, D)).astype(F32) / 4)  # type: ignore[return-value]


def run_interleaved(pool: KVPool, n: int, max_size: int | None = None) -> list[list[np.ndarray]]:
    """Two caches taking turns on ``pool`` (so neither table is one run); every output."""
    caches = [KVCache(max_size, pool=pool) for _ in range(2)]
    data = [stream(seed, n) for seed in range(2)]
    outs: list[list[np.ndarray]] = [[], []]
    for t in range(n):
        for which, cache in enumerate(caches):
            q, k, v = (part[t] for part in data[which])
            outs[which].append(cache.attend(q, k, v))
    for cache in caches:
        cache.check_invariants()
    return outs


def test_auto_picks_views_for_page_sized_blocks_and_gather_otherwise() -> None:
    assert KVPool(4, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32).view_mode == "views"
    assert KVPool(4, block_size=BS, num_kv_heads=H, head_dim=D - 1, dtype=F32).view_mode == "gather"
    assert KVPool(4, block_size=BS, head_dim=D, dtype=F32, view_mode="gather").view_mode == "gather"
    assert KVPool(4, block_size=BS, head_dim=D, dtype=F32, growable=True).view_mode == "gather"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"head_dim": 3}, "not a multiple of the 4,096-byte page"),
        ({"head_dim": D, "growable": True}, "growable"),
        ({"head_dim": D, "key_dtype": "int8"}, "stored at different widths"),
    ],
)
def test_forcing_views_where_they_cannot_work_says_why(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        KVPool(4, block_size=BS, dtype=F32, view_mode="views", **kwargs)  # type: ignore[arg-type]


def test_unknown_view_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="'mapped'"):
        KVPool(4, head_dim=D, view_mode="mapped")
    with pytest.raises(InputTypeError, match="view_mode"):
        KVPool(4, head_dim=D, view_mode=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_size", [None, 40])
def test_interleaved_caches_read_through_views_equal_the_recompute(max_size: int | None) -> None:
    pool = views_pool()
    n = 70
    outs = run_interleaved(pool, n, max_size)
    assert pool.view_stats.num_view_reads > 0 and pool.view_stats.num_maps > 0
    for which in range(2):
        expected = recompute(*stream(which, n), max_size=max_size, dtype=F32)
        for got, want in zip(outs[which], expected):
            assert np.array_equal(got, want)


def test_views_and_gather_give_identical_outputs() -> None:
    gathered = run_interleaved(KVPool(32, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32,
                                      view_mode="gather"), 50)
    viewed = run_interleaved(views_pool(), 50)
    for a, b in zip(gathered, viewed):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_windowed_cache_rings_through_its_range_and_holds_window_plus_one_blocks() -> None:
    # max_size 40: ceil(40 / 16) + 1 = 4 blocks; the range (16 positions) turns every ~12 blocks.
    pool = views_pool(8)
    cache = KVCache(40, pool=pool)
    other = KVCache(pool=pool)
    q, k, v = stream(3, 600)
    outs, held = [], []
    for t in range(600):
        outs.append(cache.attend(q[t], k[t], v[t]))
        if t < 40:
            other.attend(q[t], k[t], v[t])  # fragments the pool early on
        elif t == 40:
            other.close()
        held.append(cache.num_blocks)
        pool.check_invariants()
    assert max(held) == 4
    assert pool.num_mapped_blocks <= 2 * 4
    expected = recompute(q, k, v, max_size=40, dtype=F32)
    assert all(np.array_equal(a, b) for a, b in zip(outs, expected))


def test_at_the_map_budget_reads_fall_back_to_gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = map_budget()
    monkeypatch.setattr(budget, "limit", budget.num_used)  # nothing more may be mapped
    pool = views_pool()
    outs = run_interleaved(pool, 40)
    assert pool.view_stats.num_view_reads == 0 and pool.view_stats.num_fallbacks > 0
    assert pool.num_mapped_blocks == 0
    expected = recompute(*stream(0, 40), dtype=F32)
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], expected))


def test_a_mapping_the_kernel_refuses_falls_back_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = views_pool()
    used_before = map_budget().num_used
    monkeypatch.setattr(Reservation, "map", lambda self, *args: False)
    outs = run_interleaved(pool, 40)
    assert pool.view_stats.num_fallbacks > 0 and pool.num_mapped_blocks == 0
    assert map_budget().num_used == used_before  # every refused range gave its areas back
    expected = recompute(*stream(1, 40), dtype=F32)
    assert all(np.array_equal(a, b) for a, b in zip(outs[1], expected))


def filled_table(pool: KVPool, values: float, num_tokens: int) -> BlockTable:
    table = BlockTable(BS)
    ids = pool.allocator.allocate(table.num_new_blocks(num_tokens))
    table.append(num_tokens, ids)
    pool.attach(table)
    slots = table.slot_array(table.live_ranges())
    fill = np.full((num_tokens, H, D), values, F32)
    pool.write(0, slots, fill, fill)
    return table


def test_an_array_that_outlives_its_view_reads_zeros_never_the_next_owner() -> None:
    pool = views_pool(8)
    spacer = filled_table(pool, 9.0, BS)  # so the table below is not one run
    mine = filled_table(pool, 1.0, 3 * BS)
    pool.allocator.free(spacer.clear())
    keys, _ = pool.read(0, mine, [(0, 3 * BS)])
    assert keys.min() == 1.0 and not keys.flags.writeable
    pool.release_views(mine)  # what closing a cache or freeing a sequence does
    pool.allocator.free(mine.clear())
    pool.detach(mine)
    theirs = filled_table(pool, 2.0, 8 * BS)  # every block of the pool, mine included, now holds 2.0
    assert np.all(keys == 0.0)  # zeros: not 1.0 (stale), not 2.0 (someone else's)
    del mine
    gc.collect()
    assert np.all(keys == 0.0)  # the range stays mapped while the array lives
    assert pool.read(0, theirs, [(0, 8 * BS)])[0].min() == 2.0


def test_a_table_whose_blocks_changed_reads_its_new_blocks() -> None:
    pool = views_pool(8)
    table = filled_table(pool, 1.0, 2 * BS + 1)
    pool.read(0, table, [(0, 2 * BS + 1)])
    # Copy-on-write of the last block, as the manager does: copy, write, swap the id.
    new_id = pool.allocator.allocate_one()
    pool.copy_blocks([table.last_block_id], [new_id])
    pool.write_one(0, new_id, 0, np.full((H, D), 5.0, F32), np.full((H, D), 5.0, F32))
    pool.allocator.free([table.replace_last(new_id)])
    keys, values = pool.read(0, table, [(0, 2 * BS + 1)])
    assert keys[-1].min() == 5.0 and keys[:-1].max() == 1.0 and values[-1].max() == 5.0
    # Restoring another state in place (what snapshots and compaction do) remaps too.
    moved = pool.allocator.allocate(table.num_blocks)
    pool.copy_blocks(table.block_ids, moved)
    pool.allocator.free(table.replace_all(moved))
    assert np.array_equal(pool.read(0, table, [(0, 2 * BS + 1)])[0], keys)
    pool.check_invariants()


def test_a_collected_table_gives_back_its_areas() -> None:
    pool = views_pool(8)
    used = map_budget().num_used
    table = filled_table(pool, 1.0, 4 * BS)
    pool.read(0, table, [(0, 4 * BS)])
    assert map_budget().num_used > used
    pool.allocator.free(table.clear())
    del table
    gc.collect()
    assert pool.num_mapped_blocks == 0 and map_budget().num_used == used


def test_caches_in_threads_on_one_views_pool_equal_the_recompute() -> None:
    pool = views_pool(64)
    n, num_threads = 60, 4
    results: dict[int, list[np.ndarray]] = {}

    def run(seed: int) -> None:
        cache = KVCache(pool=pool)
        q, k, v = stream(seed, n)
        results[seed] = [cache.attend(q[t], k[t], v[t]) for t in range(n)]
        cache.close()

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in range(num_threads):
        expected = recompute(*stream(seed, n), dtype=F32)
        assert all(np.array_equal(a, b) for a, b in zip(results[seed], expected))
    pool.check_invariants()


def test_the_manager_reads_forked_and_fragmented_tables_through_views() -> None:
    pool = KVPool(64, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, view_mode="views")
    manager = KVCacheManager(pool)
    rng = np.random.default_rng(5)
    history: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    manager.add_sequence("a")
    for step in range(3 * BS + 5):
        if step == BS + 3:
            manager.fork("a", "b")
            history["b"] = list(history["a"])
        seqs = ["a"] if step < BS + 3 else ["a", "b"]
        batch = manager.reserve({s: 1 for s in seqs})
        kv = rng.standard_normal((len(seqs), H, D)).astype(F32)
        manager.write(0, batch, kv, kv)
        q = rng.standard_normal((len(seqs), H, D)).astype(F32)
        out = manager.attend(0, batch, q)
        for row, seq in enumerate(seqs):
            history[seq].append(kv[row])
            past = np.stack(history[seq])
            assert np.array_equal(out[row], attend_window(q[row], past, past, dtype=F32))
    assert pool.view_stats.num_view_reads > 0
    manager.check_invariants()


def test_an_unchanged_table_is_read_again_without_mapping_and_a_changed_middle_block_is_seen() -> None:
    pool = views_pool(16)
    spacer = filled_table(pool, 9.0, BS)  # so the table below is not one run
    table = filled_table(pool, 1.0, 3 * BS)
    pool.allocator.free(spacer.clear())
    first = pool.read(0, table, [(0, 3 * BS)])[0].copy()
    num_maps = pool.view_stats.num_maps
    for end in range(2 * BS, 3 * BS + 1):  # decode steps: the blocks stay, the range grows
        assert np.array_equal(pool.read(0, table, [(0, end)])[0], first[:end])
    assert pool.view_stats.num_maps == num_maps
    # Swapping out and in (swap.py) replaces every id: the same count and, here,
    # the same last id, but a new first and middle block, holding other data.
    last = table.last_block_id
    moved = pool.allocator.allocate(2)
    fresh = np.full((BS, H, D), 3.0, F32)
    for block_id in moved:
        pool.write(0, block_id * BS + np.arange(BS), fresh, fresh)
    pool.allocator.free(table.replace_all([*moved, last])[:2])
    keys, values = pool.read(0, table, [(0, 3 * BS)])
    assert np.all(keys[: 2 * BS] == 3.0) and np.all(keys[2 * BS :] == 1.0) and np.all(values[:BS] == 3.0)
    assert pool.view_stats.num_maps == num_maps + 4  # two new blocks, keys and values
    pool.check_invariants()


def test_a_dropped_pool_gives_its_areas_back_to_the_process_budget() -> None:
    used = map_budget().num_used
    pool = views_pool(8)
    table = filled_table(pool, 1.0, 4 * BS)
    pool.read(0, table, [(0, 4 * BS)])
    assert map_budget().num_used == used + 2 * (4 + 2)  # keys and values: 4 blocks + 2 zero pages each
    del pool, table  # never released: no close(), no free
    gc.collect()
    assert map_budget().num_used == used


def test_a_budget_with_room_for_one_side_maps_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = map_budget()
    monkeypatch.setattr(budget, "limit", budget.num_used + 4 + 2)  # room for the keys' range only
    pool = views_pool(8)
    spacer = filled_table(pool, 9.0, BS)
    table = filled_table(pool, 1.0, 4 * BS)
    pool.allocator.free(spacer.clear())
    for _ in range(3):
        keys, _ = pool.read(0, table, [(0, 4 * BS)])
        assert np.all(keys == 1.0)  # gathered
    assert pool.view_stats.num_maps == 0 and pool.view_stats.num_fallbacks == 3
    pool.check_invariants()


# ------------------------------------------------------------------ residency
# A fresh shared page faults once per mapping at its first touch; a block's pages
# are populated when the allocator hands it out, so writes do not fault and a
# view's first read maps them all around it. /proc/self/pagemap says which
# virtual pages have a page now.


def pages_present(address: int, size: int) -> list[bool]:
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as handle:
        handle.seek(address // page * 8)
        entries = handle.read(size // page * 8)
    return [bool(int.from_bytes(entries[i : i + 8], "little") >> 63) for i in range(0, len(entries), 8)]


def block_address(pool: KVPool, side: int, block_id: int) -> int:
    pages = pool.key_pages(0) if side == 0 else pool.value_pages(0)
    return int(pages[block_id].ctypes.data)


BLOCK_BYTES = BS * H * D * 4  # one 4 KiB page at this shape


@pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK), reason="no /proc/self/pagemap")
def test_a_block_is_resident_when_handed_out() -> None:
    pool = views_pool(8, num_layers=2)
    for block_id in range(8):
        for side in (0, 1):
            assert not any(pages_present(block_address(pool, side, block_id), BLOCK_BYTES))
    first = pool.allocator.allocate_one()
    run = pool.allocator.allocate(3)
    taken = [first, *run]
    for layer in range(2):
        for pages in (pool.key_pages(layer), pool.value_pages(layer)):
            for block_id in range(8):
                present = pages_present(int(pages[block_id].ctypes.data), BLOCK_BYTES)
                assert all(present) if block_id in taken else not any(present), (layer, block_id)
    assert pool.key_pages(0)[taken].max() == 0.0  # the bytes did not change
    pool.allocator.free(taken)

    spacer = filled_table(pool, 9.0, BS)
    table = filled_table(pool, 1.0, 3 * BS)  # not one run: read through views
    keys, values = pool.read(0, table, [(0, 3 * BS)])
    assert pool.view_stats.num_view_reads == 1
    assert np.all(keys == 1.0) and np.all(values == 1.0)
    pool.allocator.free(spacer.clear())


def test_each_block_is_populated_once_in_runs_of_consecutive_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(
        "pagedkv.memory.views.populate", lambda address, size: calls.append((address, size)) or True
    )
    pool = views_pool(16, num_layers=2)
    page_file = pool.pages.page_file
    assert page_file is not None
    base = page_file.address
    pool.allocator.allocate(3)  # blocks 0, 1, 2: one run per (layer, side)
    assert calls == [(base + (side * 16) * BLOCK_BYTES, 3 * BLOCK_BYTES) for side in range(4)]
    calls.clear()
    pool.allocator.free([1])
    assert pool.allocator.allocate(14)[-1] == 1  # 3 .. 15 fresh, then 1 again, already resident
    assert calls == [(base + (side * 16 + 3) * BLOCK_BYTES, 13 * BLOCK_BYTES) for side in range(4)]
    calls.clear()
    page_file.make_resident([5, 9, 1])
    assert calls == []  # resident already
    assert pool.allocator.on_take is not None


def test_without_populate_the_kernel_faults_pages_in_and_outputs_are_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedkv.memory import vmem

    libc = vmem._libc()
    monkeypatch.setattr(libc, "can_populate", True)
    asked: list[int] = []

    def old_kernel(address: int, size: int, advice: int) -> int:
        asked.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(libc, "madvise", old_kernel)
    pool = views_pool()
    outs = run_interleaved(pool, 40)
    assert asked == [23] and libc.can_populate is False  # asked once, then never again
    for which in range(2):
        expected = recompute(*stream(which, 40), dtype=F32)
        assert all(np.array_equal(a, b) for a, b in zip(outs[which], expected))


def test_a_pool_of_plain_arrays_takes_blocks_without_a_hook() -> None:
    pool = KVPool(8, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, view_mode="gather")
    assert pool.allocator.on_take is None
    assert pool.allocator.allocate(2) == [0, 1]


def test_page_files_keep_to_their_share_of_descriptors_and_pools_past_it_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedkv.memory.vmem import FDS_PER_PAGE_FILE, descriptor_budget

    budget = descriptor_budget()
    monkeypatch.setattr(budget, "limit", budget.num_used + FDS_PER_PAGE_FILE)  # room for one file
    first = KVPool(8, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    second = KVPool(8, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    assert (first.view_mode, second.view_mode) == ("views", "gather")
    outs = run_interleaved(second, 20)
    for which in range(2):
        expected = recompute(*stream(which, 20), dtype=F32)
        assert all(np.array_equal(a, b) for a, b in zip(outs[which], expected))
    del first
    gc.collect()  # its file is closed and its descriptors given back
    assert KVPool(8, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32).view_mode == "views"
    budget.check_invariants()
