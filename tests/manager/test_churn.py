"""Churn: 10,000 sequences admitted, grown, forked, preempted and freed leave the pools as they started.

Bookkeeping only (head_dim 1, one layer, zero k/v): the point is that every
block comes back exactly once, on the device pool and the host pool alike,
whatever order sequences come and go in (SGLang's "memory leak detected"
reports #105, #140, #6888, #11970 were this kind of slow drift).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.managers import make_manager

from pagedkv import KVCacheManager, SequenceState

NUM_SEQUENCES = 10_000


def assert_pristine(m: KVCacheManager) -> None:
    for pool in (m.pool, m.host_pool):
        assert pool is not None
        allocator = pool.allocator
        assert allocator.num_free_blocks == allocator.num_blocks
        assert allocator.num_used_blocks == 0
        assert sorted(allocator.free_block_ids()) == list(range(allocator.num_blocks))
        assert all(allocator.ref_count(i) == 0 for i in range(allocator.num_blocks))
    x = m.metrics()
    assert (x.num_used_blocks, x.num_live_slots, x.num_live_tokens, x.num_host_used_blocks) == (0, 0, 0, 0)
    assert (x.num_sequences, x.num_running, x.num_swapped) == (0, 0, 0)
    assert x.block_usage == x.token_occupancy == x.internal_fragmentation == 0.0
    m.check_invariants()


@pytest.mark.parametrize(
    ("block_size", "window", "sinks"), [(4, None, 0), (3, 20, 2)], ids=["unbounded", "window-sinks"]
)
def test_churn_of_10000_sequences_leaves_the_pool_as_it_started(
    block_size: int, window: int | None, sinks: int
) -> None:
    m = make_manager(256, host_blocks=64, block_size=block_size, max_size=window, num_sink_tokens=sinks)
    rng = random.Random(block_size)
    zeros = np.zeros((256, 1, 1))
    live: list[int] = []
    swapped: list[int] = []
    counts = dict.fromkeys(("admitted", "forked", "recompute", "swap", "freed", "refused"), 0)
    next_id = 0

    def settle(request: dict[int, int]) -> bool:
        if not m.can_reserve(request):
            counts["refused"] += 1
            return False
        batch = m.reserve(request)
        m.write(0, batch, zeros[: batch.num_tokens], zeros[: batch.num_tokens])
        return True

    def free_one() -> None:
        pool_of = swapped if swapped and (not live or rng.random() < 0.3) else live
        seq_id = pool_of.pop(rng.randrange(len(pool_of)))
        m.free(seq_id)
        counts["freed"] += 1

    while next_id < NUM_SEQUENCES or live or swapped:
        roll = rng.random()
        if next_id < NUM_SEQUENCES and (roll < 0.35 or not live):
            seq_id, next_id = next_id, next_id + 1
            m.add_sequence(seq_id)
            counts["admitted"] += 1
            live.append(seq_id)
            while not settle({seq_id: rng.randint(1, 48)}):
                if len(live) + len(swapped) == 1:
                    break
                victim = rng.choice([s for s in live if s != seq_id] or [seq_id])
                live.remove(victim)
                m.free(victim)
                counts["freed"] += 1
        elif roll < 0.55 and live:
            batch_ids = rng.sample(live, min(len(live), rng.randint(1, 4)))
            settle({s: rng.randint(1, 6) for s in batch_ids})
        elif roll < 0.62 and live and next_id < NUM_SEQUENCES:
            parent, child = rng.choice(live), next_id
            next_id += 1
            m.fork(parent, child)
            counts["forked"] += 1
            live.append(child)
        elif roll < 0.68 and live:
            seq_id = rng.choice(live)
            m.preempt(seq_id)
            m.resume(seq_id)
            counts["recompute"] += 1
        elif roll < 0.73 and live:
            seq_id = rng.choice(live)
            if m.block_table(seq_id).num_blocks <= m.host_pool.num_free_blocks:  # type: ignore[union-attr]
                m.preempt(seq_id, "swap")
                live.remove(seq_id)
                swapped.append(seq_id)
                counts["swap"] += 1
        elif roll < 0.78 and swapped:
            seq_id = swapped[0]
            if m.block_table(seq_id).num_blocks <= m.pool.num_free_blocks:
                m.resume(seq_id)
                swapped.pop(0)
                live.append(seq_id)
        elif live or swapped:
            free_one()
        if len(live) > 40:
            free_one()
        if next_id >= NUM_SEQUENCES and rng.random() < 0.5 and (live or swapped):
            free_one()
        if counts["admitted"] % 1000 == 0:
            m.check_invariants()
    for seq_id in m.seq_ids:
        assert m.state(seq_id) in (SequenceState.RUNNING, SequenceState.SWAPPED)
        m.free(seq_id)
    assert counts["admitted"] + counts["forked"] == NUM_SEQUENCES
    assert min(counts.values()) > 100, counts  # every path was exercised many times
    metrics = m.metrics()
    assert metrics.num_forks == counts["forked"]
    assert metrics.num_swaps_out == counts["swap"]
    assert metrics.num_preemptions == counts["swap"] + counts["recompute"]
    assert metrics.num_copy_on_write > 0
    assert_pristine(m)
