"""KV-cache groups: the layout, the hybrid manager's all-or-nothing commands, vLLM's hit rule."""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import manager_state

from pagedkv import (
    ConfigError,
    InputTypeError,
    KVCacheManager,
    KVPool,
    LayerIndexError,
    PoolExhaustedError,
    SequenceStateError,
    UnknownSequenceError,
)
from pagedkv.manager.groups import GroupLayout, KVCacheGroup
from pagedkv.manager.hybrid import GroupBatch, HybridKVCacheManager

GEMMA3_270M = ([512] * 5 + [None]) * 3  # 18 layers: five sliding (window 512) to one full


def hybrid(windows, num_blocks=64, block_size=4, **kwargs):
    layout = GroupLayout.from_layer_windows(windows)
    pool = KVPool(num_blocks, block_size=block_size, head_dim=2, num_layers=layout.layers_per_group)
    return HybridKVCacheManager(pool, layout, **kwargs)


def step(manager, request, value=1.0):
    """Reserve ``request`` and write every model layer with ``value``; return the batch."""
    batch = manager.reserve(request)
    n = batch.num_tokens
    for layer in range(manager.num_layers):
        manager.write(layer, batch, np.full((n, 1, 2), value), np.full((n, 1, 2), value))
    return batch


def snapshot(manager):
    """Everything observable of a hybrid manager: each group's state, the pool's free blocks."""
    return [manager_state(group) for group in manager.groups], manager.pool.num_free_blocks


# ------------------------------------------------------------------ the layout


def test_gemma3_layers_form_one_full_group_and_five_sliding_groups_of_three_with_no_padding():
    layout = GroupLayout.from_layer_windows(GEMMA3_270M)
    assert layout.layers_per_group == 3
    assert [group.kind for group in layout.groups] == ["full"] + ["sliding"] * 5
    assert layout.groups[0].layers == (5, 11, 17)
    assert layout.num_padding_slots == 0
    assert sorted(layer for group in layout.groups for layer in group.layers) == list(range(18))


def test_gemma3_27b_like_layers_trade_a_little_padding_for_fewer_tables():
    windows = ([1024] * 5 + [None]) * 10 + [1024, 1024]  # 62 layers: 52 sliding, 10 full
    layout = GroupLayout.from_layer_windows(windows)
    assert layout.layers_per_group == 6
    assert layout.num_padding_slots <= 0.1 * 62
    assert len(layout.groups) == 11


def test_a_uniform_model_is_one_group_of_every_layer():
    layout = GroupLayout.from_layer_windows([None] * 4)
    assert layout.groups == (KVCacheGroup((0, 1, 2, 3), None),)


def test_a_layout_refuses_a_missing_layer_and_a_bad_window():
    with pytest.raises(ConfigError, match="cover layers"):
        GroupLayout((KVCacheGroup((0, 2), None),), 2)
    with pytest.raises(ConfigError):
        GroupLayout.from_layer_windows([0, None])
    with pytest.raises(InputTypeError, match="windows must be a list"):
        GroupLayout.from_layer_windows("full")


def test_a_pool_whose_layers_are_not_the_group_size_is_refused_with_the_size_to_use():
    layout = GroupLayout.from_layer_windows(GEMMA3_270M)
    with pytest.raises(ConfigError, match=r"num_layers=3"):
        HybridKVCacheManager(KVPool(8, block_size=4, head_dim=2, num_layers=18), layout)


# ------------------------------------------------------------------ memory per group


def test_each_group_frees_what_its_own_window_no_longer_sees_at_block_granularity():
    manager = hybrid([8, None], block_size=4)  # layer 0: window 8; layer 1: full
    manager.add_sequence("a")
    step(manager, {"a": 20})
    assert [manager.block_table("a", g).num_blocks for g in range(2)] == [5, 5]
    step(manager, {"a": 1})  # token 20 sees 13..20: blocks 3..5 of the window group
    assert manager.block_table("a", 1).num_blocks == 3
    assert manager.block_table("a", 0).num_blocks == 6
    manager.check_invariants()


def test_gemma3_layout_holds_about_what_a_plain_cache_holds_after_a_long_prompt():
    manager = hybrid(GEMMA3_270M, num_blocks=800, block_size=16)
    manager.add_sequence("a")
    step(manager, {"a": 2000})
    for _ in range(8):
        step(manager, {"a": 1})
    layer_tokens_held = sum(
        manager.block_table("a", g).num_blocks * 16 * len(group.layers)
        for g, group in enumerate(manager.layout.groups)
    )
    plain = 3 * 2008 + 15 * 512  # DynamicCache: full layers keep every token, sliding ones their window
    assert layer_tokens_held <= 1.05 * plain


# ------------------------------------------------------------------ all or nothing


def test_a_reservation_that_fits_no_group_together_changes_no_group():
    manager = hybrid([4, None], num_blocks=6, block_size=2)
    manager.add_sequence("a")
    step(manager, {"a": 4})  # 2 blocks in each group: 4 of 6 used
    before = snapshot(manager)
    with pytest.raises(PoolExhaustedError, match="need 4 blocks"):
        manager.reserve({"a": 4})  # each group needs 2 more (the window group frees none yet)
    assert snapshot(manager) == before
    manager.check_invariants()


def test_a_reservation_fits_when_one_group_frees_what_another_takes():
    manager = hybrid([2, None], num_blocks=6, block_size=2)
    manager.add_sequence("a")
    step(manager, {"a": 5})  # window group 3 blocks, full group 3 blocks: the pool is full
    assert manager.pool.num_free_blocks == 0
    assert manager.can_reserve({"a": 1})  # the window group frees 2 blocks, the full group takes 1... it fits
    step(manager, {"a": 1})
    manager.check_invariants()


def test_bad_calls_name_the_problem_and_change_nothing():
    manager = hybrid([4, None])
    manager.add_sequence("a")
    batch = step(manager, {"a": 3})
    before = snapshot(manager)
    with pytest.raises(LayerIndexError):
        manager.write(2, batch, np.ones((3, 1, 2)), np.ones((3, 1, 2)))
    with pytest.raises(InputTypeError, match="GroupBatch"):
        manager.attend(0, batch.batches[0], np.ones((3, 1, 2)))
    with pytest.raises(UnknownSequenceError):
        manager.reserve({"zz": 1})
    with pytest.raises(UnknownSequenceError):
        manager.free("zz")
    with pytest.raises(LayerIndexError):
        manager.block_table("a", 2)
    assert snapshot(manager) == before


def test_fork_and_swap_refuse_a_sequence_one_group_has_not_written_and_change_nothing():
    manager = hybrid([4, None], host_pool=None)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 3})
    manager.write(1, batch, np.ones((3, 1, 2)), np.ones((3, 1, 2)))  # the full layer only
    before = snapshot(manager)
    with pytest.raises(SequenceStateError, match=r"layers \[0\]"):
        manager.fork("a", "b")
    assert snapshot(manager) == before
    assert "b" not in manager


def test_truncate_that_one_window_group_refuses_changes_no_group():
    manager = hybrid([2, None], block_size=2)
    manager.add_sequence("a")
    step(manager, {"a": 8})
    step(manager, {"a": 1})  # the window group freed tokens before 7
    before = snapshot(manager)
    with pytest.raises(SequenceStateError):
        manager.truncate("a", 3)  # token 3 would attend to token 2, long gone from the window group
    assert snapshot(manager) == before
    manager.truncate("a", 8)
    assert [manager.num_tokens("a")] == [8]
    manager.check_invariants()


def test_swap_out_and_in_moves_every_group_and_keeps_each_tokens_values():
    layout = GroupLayout.from_layer_windows([4, None])
    pool = KVPool(16, block_size=2, head_dim=2, num_layers=1)
    host = KVPool(16, block_size=2, head_dim=2, num_layers=1)
    manager = HybridKVCacheManager(pool, layout, host_pool=host)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 5})
    rows = np.arange(10.0).reshape(5, 1, 2)
    for layer in range(2):
        manager.write(layer, batch, rows + layer, rows + layer)
    query = np.ones((1, 1, 2))
    batch = step(manager, {"a": 1}, value=0.5)
    before = [manager.attend(layer, batch, query) for layer in range(2)]
    manager.preempt("a", "swap")
    assert pool.num_used_blocks == 0
    manager.resume("a")
    batch2 = step(manager, {"a": 1}, value=0.25)
    manager.check_invariants()
    after = [manager.attend(layer, batch2, query) for layer in range(2)]
    assert all(np.isfinite(out).all() for out in after)
    assert before[0].shape == after[0].shape


# ------------------------------------------------------------------ prefix hits across groups


def test_two_requests_sharing_a_1500_token_prefix_on_gemma3_groups_hit_1488_tokens():
    """vLLM's rule: full attention bounds the hit at 93 whole blocks of 16; each sliding group (window
    512) accepts it, for the blocks its window needs there (tokens 977..1487) are still cached."""
    manager = hybrid(GEMMA3_270M, num_blocks=1200, block_size=16, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(0, 30000, 1500)]
    first = prefix + [1] * 100
    assert manager.add_sequence("a", first) == 0
    step(manager, {"a": first})
    for token in range(8):
        step(manager, {"a": [token]})  # the sliding groups free their blocks before the window
    second = prefix + [2] * 100
    assert manager.lookup(second).num_cached_tokens == 1488
    assert manager.add_sequence("b", second) == 1488
    assert [manager.num_tokens("b")] == [1488]
    for g in range(1, 6):  # a sliding group holds only what token 1488's window needs
        assert manager.block_table("b", g).num_blocks == 1488 // 16 - (1488 - 511) // 16
    manager.check_invariants()


def test_a_hit_the_sliding_group_cannot_take_shrinks_to_the_longest_every_group_accepts():
    """The window group's blocks for the end of the full group's hit are gone: the hit shrinks."""
    manager = hybrid([2, None], num_blocks=40, block_size=2, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 5 full blocks
    manager.add_sequence("a", prompt)
    step(manager, {"a": prompt})
    manager.check_invariants()
    window = manager.groups[1]
    full = manager.groups[0]
    # Forget the window group's key of logical block 4 (as if reused): its cache no longer has it.
    block_id = window.block_table("a").block_ids[4]
    window.prefix_cache.forget(block_id)
    assert full.lookup([*prompt, 99]).num_cached_tokens == 10  # the full group alone would take 5 blocks
    assert manager.lookup([*prompt, 99]).num_cached_tokens == 8  # token 8's window (7..8) is block 3
    assert manager.add_sequence("b", [*prompt, 99]) == 8
    manager.check_invariants()


def test_a_block_is_keyed_by_one_group_only_and_evictions_reach_its_owner():
    manager = hybrid([2, None], num_blocks=10, block_size=2, enable_prefix_caching=True)
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    step(manager, {"a": [1, 2, 3, 4, 5]})
    manager.free("a")
    manager.check_invariants()
    manager.add_sequence("b", cache_blocks=False)
    step(manager, {"b": 10})  # takes every block: cached ones are evicted from the owning group's cache
    manager.check_invariants()
    assert all(group.prefix_cache.num_cached_blocks == 0 for group in manager.groups)


def test_kv_events_carry_their_group():
    manager = hybrid([2, None], block_size=2, enable_prefix_caching=True, kv_events=True)
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    step(manager, {"a": [1, 2, 3, 4, 5]})
    events = manager.drain_kv_events()
    assert {group for group, _ in events} == {0, 1}
    assert all(event.group_idx == group for group, event in events if hasattr(event, "group_idx"))


def test_a_single_group_hybrid_behaves_as_a_plain_manager():
    plain = KVCacheManager(KVPool(8, block_size=2, head_dim=2, num_layers=2), max_size=3)
    grouped = hybrid([3, 3], num_blocks=8, block_size=2)
    for manager in (plain, grouped):
        manager.add_sequence("a")
    outputs = []
    for manager in (plain, grouped):
        batch = manager.reserve({"a": 5})
        rows = np.arange(10.0).reshape(5, 1, 2)
        for layer in range(2):
            manager.write(layer, batch, rows, rows)
        outputs.append([manager.attend(layer, batch, rows) for layer in range(2)])
    for a, b in zip(*outputs):
        np.testing.assert_array_equal(a, b)


def test_group_batch_lays_tokens_out_as_each_group_does():
    manager = hybrid([4, None])
    for seq in ("a", "b"):
        manager.add_sequence(seq)
    batch = manager.reserve({"a": 3, "b": 1})
    assert isinstance(batch, GroupBatch)
    assert batch.seq_ids == ("a", "b") and batch.num_tokens == 4 and batch.query_start.tolist() == [0, 3, 4]


def test_a_router_index_fed_one_groups_events_holds_that_groups_keys():
    """A prefix-aware router keeps working: each group's events rebuild that group's keys; group 0
    (full attention) bounds every hit, so its index is the one a router asks."""
    from pagedkv.prefix.events import PrefixIndex

    manager = hybrid([2, None], num_blocks=40, block_size=2, enable_prefix_caching=True, kv_events=True)
    for seq, prompt in (("a", [1, 2, 3, 4, 5, 6, 7]), ("b", [1, 2, 3, 4, 9, 9, 9]), ("c", [5] * 9)):
        manager.add_sequence(seq, prompt)
        step(manager, {seq: prompt[manager.num_tokens(seq) :]})
        step(manager, {seq: [0]})
    manager.free("a")
    indexes = [PrefixIndex() for _ in manager.groups]
    for group, event in manager.drain_kv_events():
        indexes[group].apply([event])
    for index, group in zip(indexes, manager.groups):
        assert group.kv_events is not None
        assert set(index.parent_of) == group.kv_events.keyed_hashes
    assert len(indexes[0]) >= len(indexes[1])  # the window group keeps fewer blocks


def test_a_hybrid_admission_hashes_each_prompt_block_once_for_every_group(monkeypatch):
    """The groups key blocks alike (same pool, same hash): one hashing serves the fixed point and
    every group's admission."""
    import pagedkv.manager.prefix_sharing as sharing_module

    calls = []
    original = sharing_module.block_keys

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    manager = hybrid(GEMMA3_270M, num_blocks=400, block_size=16, enable_prefix_caching=True)
    monkeypatch.setattr(sharing_module, "block_keys", counted)
    prompt = list(range(1, 500))
    assert manager.add_sequence("a", prompt) == 0
    assert len(manager.groups) == 6 and len(calls) == 1


def test_a_reservation_refused_by_one_group_changes_no_group():
    """A sequence whose window layer has not written its tokens: every group refuses, before any
    group reserved (the pool has room for all, so only the check stops it)."""
    manager = hybrid([4, None], num_blocks=64)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 3})
    manager.write(1, batch, np.ones((3, 1, 2)), np.ones((3, 1, 2)))  # the full layer only
    before = snapshot(manager)
    with pytest.raises(SequenceStateError):
        manager.reserve({"a": 1})
    assert snapshot(manager) == before
    manager.write(0, batch, np.ones((3, 1, 2)), np.ones((3, 1, 2)))
    step(manager, {"a": 1})  # settled: it fits without planning
    manager.check_invariants()
