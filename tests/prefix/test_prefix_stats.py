"""Prefix hit rates: cumulative and over the last N requests, against sums over a plain list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.managers import make_manager
from support.prefix import make

from pagedkv.errors import ConfigError
from pagedkv.prefix.stats import HitWindow


@given(requests=st.lists(st.integers(0, 20).flatmap(lambda q: st.tuples(st.just(q), st.integers(0, q))),
                         max_size=30),
       window=st.integers(1, 5))
def test_the_window_matches_sums_over_the_last_requests(requests: list[tuple[int, int]], window: int) -> None:
    hits = HitWindow(window)
    for queries, num_hit in requests:
        hits.record(queries, num_hit)
        hits.check_invariants()
    total_q, total_h = sum(q for q, _ in requests), sum(h for _, h in requests)
    stats = hits.stats(total_q, total_h)
    recent = requests[-window:]
    assert (stats.num_requests, stats.num_recent_requests) == (len(requests), len(recent))
    recent_q, recent_h = sum(q for q, _ in recent), sum(h for _, h in recent)
    assert stats.hit_rate == (total_h / total_q if total_q else 0.0)
    assert stats.recent_hit_rate == (recent_h / recent_q if recent_q else 0.0)


def test_the_manager_counts_each_admission_and_resets() -> None:
    manager = make(16)
    for seq_id in ("a", "b"):
        num_hit = manager.add_sequence(seq_id, [1, 2, 3, 4, 5])
        batch = manager.reserve({seq_id: [1, 2, 3, 4, 5][num_hit:]})
        kv = np.ones((batch.num_tokens, 1, 2))
        manager.write(0, batch, kv, kv)
    stats = manager.prefix_stats()
    assert (stats.num_requests, stats.num_queries, stats.num_hits) == (2, 10, 4)
    assert stats.hit_rate == stats.recent_hit_rate == 0.4
    manager.reset_prefix_stats()
    assert manager.prefix_stats().num_requests == 0 and manager.prefix_stats().num_queries == 0
    assert manager.metrics().num_prefix_queries == 0
    manager.check_invariants()


def test_stats_need_prefix_caching() -> None:
    manager = make_manager(4)
    with pytest.raises(ConfigError, match="prefix caching is off"):
        manager.prefix_stats()
    with pytest.raises(ConfigError, match="prefix caching is off"):
        manager.reset_prefix_stats()
    with pytest.raises(ConfigError, match="max_requests"):
        HitWindow(0)
