"""Tests for ``KVCacheManager.metrics()``: hand-computed snapshots of small states.

Block usage counts blocks with a ref count >= 1; token occupancy counts the
physical slots that hold a live (not evicted) token, shared slots once; they
are reported side by side because they differ (vLLM #57336).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from support.managers import make_manager, settle

from pagedkv import KVCacheManager, KVPool, ManagerMetrics
from pagedkv.memory.vmem import map_budget


def memory(m: KVCacheManager) -> tuple[int, int, int, int, float, float, float]:
    x = m.metrics()
    return (
        x.num_used_blocks,
        x.num_free_blocks,
        x.num_live_slots,
        x.num_live_tokens,
        x.block_usage,
        x.token_occupancy,
        x.internal_fragmentation,
    )


def events(m: KVCacheManager) -> tuple[int, int, int, int, int]:
    x = m.metrics()
    return (x.num_forks, x.num_copy_on_write, x.num_preemptions, x.num_swaps_out, x.num_swaps_in)


def test_empty_manager_reports_zeros() -> None:
    m = make_manager()
    x = m.metrics()
    assert isinstance(x, ManagerMetrics)
    assert (x.num_blocks, x.block_size) == (8, 4)
    assert memory(m) == (0, 8, 0, 0, 0.0, 0.0, 0.0)
    assert events(m) == (0, 0, 0, 0, 0)
    assert (x.num_sequences, x.num_running, x.num_swapped, x.num_host_used_blocks) == (0, 0, 0, 0)


def test_usage_occupancy_and_fragmentation_of_one_sequence() -> None:
    # 8 blocks of 4 slots; a holds 6 tokens:   [a0 a1 a2 a3] [a4 a5 . .]
    #   used 2 of 8 blocks      -> block usage     2/8  = 0.25
    #   6 live slots of 32      -> token occupancy 6/32 = 0.1875
    #   2 empty of 8 used slots -> fragmentation   2/8  = 0.25
    m = make_manager()
    m.add_sequence("a")
    settle(m, {"a": 6})
    assert memory(m) == (2, 6, 6, 6, 0.25, 0.1875, 0.25)
    assert m.metrics().num_sequences == m.metrics().num_running == 1


def test_forks_count_shared_slots_once_and_tokens_per_sequence() -> None:
    # fork a -> b: same two blocks; 6 slots, 12 tokens (6 per sequence)
    m = make_manager()
    m.add_sequence("a")
    settle(m, {"a": 6})
    m.fork("a", "b")
    assert memory(m) == (2, 6, 6, 12, 0.25, 6 / 32, 0.25)
    assert events(m) == (1, 0, 0, 0, 0)
    # b appends b6: block 1 is copied (copy-on-write) to block 2
    #   block 0 [a0 a1 a2 a3]  shared      4 live slots
    #   block 1 [a4 a5 .  . ]  a           2
    #   block 2 [a4 a5 b6 . ]  b           3      -> 9 slots, 13 tokens, 3 of 12 slots empty
    settle(m, {"b": 1})
    assert memory(m) == (3, 5, 9, 13, 3 / 8, 9 / 32, 0.25)
    assert events(m) == (1, 1, 0, 0, 0)
    # three more forks of b, no copies yet
    for child in ("c", "d", "e"):
        m.fork("b", child)
    assert memory(m) == (3, 5, 9, 13 + 3 * 7, 3 / 8, 9 / 32, 0.25)
    assert events(m) == (4, 1, 0, 0, 0)


def test_window_eviction_leaves_fragmentation_in_the_first_block() -> None:
    # block_size 4, max_size 3, 10 tokens: token 9 sees 7..9
    #   block 1 [x  x  x  t7]  block 2 [t8 t9 .  .]   -> 3 live of 8 slots
    m = make_manager(max_size=3)
    m.add_sequence("a")
    for _ in range(10):
        settle(m, {"a": 1})
    assert memory(m) == (2, 6, 3, 3, 0.25, 3 / 32, 1 - 3 / 8)


def test_sinks_and_window_in_one_block_count_only_live_slots() -> None:
    # block_size 4, 1 sink, max_size 2, 4 tokens: token 3 sees sink 0 and 2..3
    #   block 0 [s0 x t2 t3]   -> 3 live slots (slot 1 is evicted), 3 live tokens
    # (the union of the ranges (0, 1) and (2, 4) once counted 4 slots)
    m = make_manager(max_size=2, num_sink_tokens=1)
    m.add_sequence("a")
    for _ in range(4):
        settle(m, {"a": 1})
    assert m.block_table("a").window_start == 2
    assert memory(m) == (1, 7, 3, 3, 1 / 8, 3 / 32, 0.25)


def test_preemption_and_swap_counters() -> None:
    m = make_manager(host_blocks=4)
    m.add_sequence("a")
    m.add_sequence("b")
    settle(m, {"a": 6, "b": 3})
    assert memory(m)[:4] == (3, 5, 9, 9)
    m.preempt("b")  # recompute: b's block goes back, b holds nothing
    assert memory(m)[:4] == (2, 6, 6, 6)
    assert events(m) == (0, 0, 1, 0, 0)
    assert (m.metrics().num_sequences, m.metrics().num_running) == (2, 1)
    m.preempt("a", "swap")  # a's 2 blocks move to the host pool
    x = m.metrics()
    assert memory(m) == (0, 8, 0, 0, 0.0, 0.0, 0.0)
    assert (x.num_running, x.num_swapped, x.num_host_used_blocks) == (0, 1, 2)
    assert events(m) == (0, 0, 2, 1, 0)
    m.resume("a")
    m.resume("b")
    x = m.metrics()
    assert memory(m)[:4] == (2, 6, 6, 6)
    assert (x.num_running, x.num_swapped, x.num_host_used_blocks) == (2, 0, 0)
    assert events(m) == (0, 0, 2, 1, 1)
    # counters are events since creation: freeing does not lower them
    m.free("a")
    m.free("b")
    assert events(m) == (0, 0, 2, 1, 1)
    assert memory(m) == (0, 8, 0, 0, 0.0, 0.0, 0.0)


def test_block_usage_and_token_occupancy_differ() -> None:
    # vLLM #57336: 3 blocks of 4; a holds 5 tokens in 2 blocks:
    #   [a0 a1 a2 a3] [a4 . . .] [free]
    #   block usage 2/3 = 66.7%, token occupancy 5/12 = 41.7%, fragmentation 3/8
    m = make_manager(num_blocks=3)
    m.add_sequence("a")
    settle(m, {"a": 5})
    x = m.metrics()
    assert x.block_usage == pytest.approx(2 / 3)
    assert x.token_occupancy == pytest.approx(5 / 12)
    assert x.internal_fragmentation == pytest.approx(3 / 8)
    assert x.block_usage != x.token_occupancy


def test_metrics_is_a_query() -> None:
    m = make_manager()
    m.add_sequence("a")
    settle(m, {"a": 5})
    free = m.pool.allocator.free_block_ids()
    first, second = m.metrics(), m.metrics()
    assert first == second
    assert m.pool.allocator.free_block_ids() == free
    data = first.as_dict()
    assert data["num_live_slots"] == 5 and data["num_used_blocks"] == 2
    assert json.loads(json.dumps(data)) == data
    with pytest.raises(AttributeError):
        first.num_used_blocks = 0  # type: ignore[misc]


def decode_two_interleaved(m: KVCacheManager, num_steps: int) -> None:
    """Sequences a and b take one token each per step and attend, so their blocks interleave."""
    m.add_sequence("a")
    m.add_sequence("b")
    shape = (2, m.pool.num_kv_heads, m.pool.head_dim)
    for _ in range(num_steps):
        batch = m.reserve({"a": 1, "b": 1})
        kv = np.full(shape, 0.5, np.float32)
        m.write(0, batch, kv, kv)
        m.attend(0, batch, kv)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="views are Linux only")
def test_view_metrics_count_reads_maps_and_areas() -> None:
    # block_size 16 x 1 head x 64 float32 = 4096 bytes a block: one page, so views apply.
    # 17 steps: a holds blocks [0, 2], b [1, 3] (taken in turn); every attend is a view read.
    #   reads 2 x 17 = 34; maps: 2 sequences x 2 blocks x (K, V) = 8, all still mapped;
    #   areas: 4 ranges x (2 blocks + 2 zero pages around them) = 16
    pool = KVPool(8, block_size=16, num_kv_heads=1, head_dim=64, dtype=np.float32, view_mode="views")
    m = KVCacheManager(pool)
    areas_before = map_budget().num_used
    decode_two_interleaved(m, 17)
    x = m.metrics()
    assert x.view_mode == "views"
    assert (x.num_view_reads, x.num_gather_reads, x.num_view_fallbacks) == (34, 0, 0)
    assert (x.num_view_maps, x.num_mapped_blocks) == (8, 8)
    assert x.num_map_areas_used - areas_before == 16
    assert x.map_area_limit == map_budget().limit
    assert x.as_dict()["view_mode"] == "views"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="views are Linux only")
def test_view_metrics_count_fallbacks_at_the_map_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = map_budget()
    monkeypatch.setattr(budget, "limit", budget.num_used)  # nothing more may be mapped
    pool = KVPool(8, block_size=16, num_kv_heads=1, head_dim=64, dtype=np.float32, view_mode="views")
    m = KVCacheManager(pool)
    decode_two_interleaved(m, 3)
    x = m.metrics()
    # every read tried to map, was refused, and gathered: 2 sequences x 3 steps
    assert (x.num_view_reads, x.num_view_fallbacks, x.num_gather_reads) == (0, 6, 6)
    assert (x.num_view_maps, x.num_mapped_blocks, x.map_area_limit) == (0, 0, budget.num_used)


def test_a_gather_pool_reports_gather_and_no_view_counts() -> None:
    m = KVCacheManager(KVPool(8, block_size=4, num_kv_heads=1, head_dim=2, dtype=np.float32))
    decode_two_interleaved(m, 5)
    x = m.metrics()
    assert x.view_mode == "gather"
    assert (x.num_view_reads, x.num_gather_reads, x.num_view_maps, x.num_mapped_blocks) == (0, 0, 0, 0)
