"""Snapshots of a ``HybridKVCacheManager``: per-group round trips that continue identically, hostile files.

A round trip runs a random history on a hybrid manager (several KV-cache
groups over one pool, maybe a host pool, prefix caching), saves it, loads it,
then feeds both the same further operations: every output bit for bit, every
group's block table, metric and prefix key the same, and saving the loaded
manager captures the same state again. Hostile files are validly re-signed
states whose groups disagree with their pool or with each other: each is
refused with a ``SnapshotError`` before any pool is built.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from test_snapshot import Driver, equal
from test_snapshot import same_view as same_manager_view

from pagedkv import KVCacheManager, KVPool, snapshot
from pagedkv.counts import ChunkedWindow
from pagedkv.errors import ConfigError, PoolExhaustedError, SequenceStateError, SnapshotError
from pagedkv.manager.groups import GroupLayout, KVCacheGroup
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.snapshot import format as snapshot_format
from pagedkv.snapshot.capture import capture_hybrid
from pagedkv.snapshot.pools import PoolPlan

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")


class HybridDriver(Driver):
    """``test_snapshot.Driver`` over every *model* layer of a hybrid manager, plus truncation."""

    KINDS = (*Driver.KINDS, "truncate")

    def step(self, requests: dict[Hashable, list[int]], method: str = "loop") -> Any:
        manager = self.manager
        starts = {seq_id: manager.num_tokens(seq_id) for seq_id in requests}
        with_ids = manager.prefix_caching
        batch = manager.reserve({s: (t if with_ids else len(t)) for s, t in requests.items()})
        outputs = []
        for layer in range(manager.num_layers):
            parts = [self.kv(t, starts[s], layer) for s, t in requests.items()]
            k, v, q = (np.concatenate([p[i] for p in parts]) for i in range(3))
            manager.write(layer, batch, k, v)
            outputs.append(manager.attend(layer, batch, q, method=method))
        return outputs

    def apply(self, op: tuple[int, int, int]) -> Any:
        kind = self.KINDS[op[0] % len(self.KINDS)]
        running = self.running()
        if kind != "truncate":
            try:
                return super().apply(op)
            except SequenceStateError as error:
                return type(error).__name__
        if not running:
            return None
        seq_id = running[op[1] % len(running)]
        try:
            self.manager.truncate(seq_id, op[2] % (self.manager.num_tokens(seq_id) + 1))
        except (SequenceStateError, PoolExhaustedError, ConfigError) as error:
            return type(error).__name__
        return "truncated"


def build_hybrid(config: dict[str, Any]) -> HybridKVCacheManager:
    layout = GroupLayout.from_layer_windows(config["windows"], num_sink_tokens=config["num_sink_tokens"])
    num_kv_heads, num_q_heads = config["heads"]
    key_dtype, value_dtype = config["storage"]
    shape = dict(block_size=config["block_size"], num_kv_heads=num_kv_heads, head_dim=config["head_dim"],
                 num_layers=layout.layers_per_group, dtype=config["dtype"], key_dtype=key_dtype,
                 value_dtype=value_dtype)
    host = KVPool(config["host_blocks"], **shape) if config["host_blocks"] else None
    return HybridKVCacheManager(KVPool(config["num_blocks"], **shape), layout, num_q_heads=num_q_heads,
                                scale=0.5, host_pool=host, enable_prefix_caching=config["prefix"])


def same_view(one: HybridKVCacheManager, two: HybridKVCacheManager) -> None:
    """Every group's tables, keys and metrics, and the pools' queues, are the same."""
    assert one.layout == two.layout
    assert one.seq_ids == two.seq_ids
    for seq_id in one.seq_ids:
        assert one.state(seq_id) == two.state(seq_id)
        assert one.num_tokens(seq_id) == two.num_tokens(seq_id)
        for group in range(len(one.groups)):
            assert one.block_table(seq_id, group).block_ids == two.block_table(seq_id, group).block_ids
    assert one.metrics() == two.metrics()
    for pool, twin in ((one.pool, two.pool), (one.host_pool, two.host_pool)):
        if pool is None:
            assert twin is None
            continue
        assert twin is not None
        assert pool.allocator.free_block_ids() == twin.allocator.free_block_ids()
        assert pool.allocator.cached_free_block_ids() == twin.allocator.cached_free_block_ids()
    if one.prefix_caching:
        for mine, theirs in zip(one.groups, two.groups):
            assert mine.prefix_cache is not None and theirs.prefix_cache is not None
            assert [mine.prefix_cache.key_of(b) for b in range(one.pool.num_blocks)] == [
                theirs.prefix_cache.key_of(b) for b in range(one.pool.num_blocks)]


def same_outputs(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, list):
        assert len(got) == len(want) and all(
            equal(x, y) if not isinstance(x, list) else all(map(equal, x, y)) for x, y in zip(got, want))
    else:
        assert got == want


def round_trip(manager: HybridKVCacheManager, folder: str) -> HybridKVCacheManager:
    """Save and load ``manager`` (trusting its own cached keys); the load captures the same state again."""
    path = os.path.join(folder, "hybrid.safetensors")
    snapshot.save(manager, path)
    loaded = snapshot.load(path, trust_cached_keys=True)
    assert isinstance(loaded, HybridKVCacheManager)
    loaded.check_invariants()
    same_view(manager, loaded)
    (state, tensors), (state2, tensors2) = capture_hybrid(manager), capture_hybrid(loaded)
    assert state == state2 and tensors.keys() == tensors2.keys()
    assert all(equal(tensors[name], tensors2[name]) for name in tensors)
    return loaded


hybrid_configs = st.fixed_dictionaries({
    "windows": st.lists(st.one_of(st.none(), st.integers(2, 6)), min_size=2, max_size=4),
    "num_blocks": st.integers(8, 24),
    "block_size": st.integers(1, 3),
    "heads": st.sampled_from([(1, 1), (2, 4)]),
    "head_dim": st.integers(2, 3),
    "dtype": st.sampled_from([np.float32, np.float64]),
    "storage": st.sampled_from([(None, None), ("int8", "int8"), ("float8_e4m3", None)]),
    "num_sink_tokens": st.integers(0, 2),
    "prefix": st.booleans(),
    "host_blocks": st.one_of(st.none(), st.integers(2, 12)),
})
ops = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 255), st.integers(0, 255)), min_size=1,
               max_size=30)


@settings(max_examples=25, deadline=None)
@given(config=hybrid_configs, before=ops, after=ops)
def test_a_hybrid_manager_round_trip_continues_identically(
    config: dict[str, Any], before: list[tuple[int, int, int]], after: list[tuple[int, int, int]]
) -> None:
    manager = build_hybrid(config)
    driver = HybridDriver(manager)
    for op in before:
        note(f"before: {HybridDriver.KINDS[op[0]]} -> {driver.apply(op)!r:.80}")
    with tempfile.TemporaryDirectory() as folder:
        loaded = round_trip(manager, folder)
    twin = HybridDriver(loaded, driver.next_id)
    for op in after:
        got, want = twin.apply(op), driver.apply(op)
        note(f"after: {HybridDriver.KINDS[op[0]]} -> {want!r:.80}")
        same_outputs(got, want)
        same_view(manager, loaded)
        loaded.check_invariants()


# ----------------------------------------------------------- a hand-built case


def gemma_like(host_blocks: int = 8) -> tuple[HybridKVCacheManager, HybridDriver]:
    """Layers [window 4, full, window 4, full] as two groups of two (one full, one sliding), block_size 2.

    After the history below, group 1 (window 4) has freed the oldest blocks of
    "a" while group 0 (full) keeps them, prefix-cached blocks wait in both
    groups' caches, and one sequence is swapped out to the host pool::

        "a"  prompt 9 tokens + 3 decoded   group 0: 6 blocks   group 1: the window's 3
        "b"  a fork of "a", swapped        its blocks on the host pool
    """
    layout = GroupLayout.from_layer_windows([4, None, 4, None])
    shape = dict(block_size=2, num_kv_heads=1, head_dim=2, num_layers=layout.layers_per_group,
                 dtype=np.float32)
    manager = HybridKVCacheManager(KVPool(32, **shape), layout, host_pool=KVPool(host_blocks, **shape),
                                   enable_prefix_caching=True)
    driver = HybridDriver(manager)
    driver.apply((0, 0, 8))  # add a prompt of 9 tokens (id 1)
    for _ in range(3):
        driver.apply((2, 0, 0))  # decode
    driver.apply((0, 1, 5))  # add 6 tokens sharing "1 2 1 1 2" with the first (id s2)
    driver.apply((5, 1, 0))  # free s2: its full blocks stay cached in both groups
    driver.apply((4, 0, 0))  # fork 1 -> 3
    driver.apply((7, 1, 0))  # swap 3 out
    return manager, driver


def test_a_hand_built_hybrid_round_trip_keeps_each_groups_tables_keys_and_host_pool(tmp_path: Any) -> None:
    manager, driver = gemma_like()
    assert manager.state(3) is not manager.state(1)  # 3 is swapped
    full, sliding = (manager.block_table(1, group) for group in range(2))
    assert full.num_blocks > sliding.num_blocks  # the window group freed what it no longer sees
    assert manager.pool.allocator.num_cached_free_blocks > 0
    loaded = round_trip(manager, str(tmp_path))
    assert loaded.host_pool is not None and loaded.host_pool.num_used_blocks == manager.num_held_blocks(3)
    # The loaded manager continues exactly: a prompt sharing the cached prefix hits the same tokens.
    twin = HybridDriver(loaded, driver.next_id)
    for op in [(0, 0, 8), (8, 0, 0), (2, 0, 0), (9, 0, 5), (3, 0, 2), (0, 1, 6)]:
        same_outputs(twin.apply(op), driver.apply(op))
        same_view(manager, loaded)


def test_a_window_that_is_not_a_plain_int_is_refused_and_nothing_is_written(tmp_path: Any) -> None:
    class ChunkLike(int):  # chunked local attention's window is an int subclass; saved as an int it
        pass               # would load as a sliding window

    layout = GroupLayout((KVCacheGroup((1,), None), KVCacheGroup((0,), ChunkLike(4))), 1)
    manager = HybridKVCacheManager(KVPool(8, block_size=2, head_dim=2, num_layers=1), layout)
    path = str(tmp_path / "chunked.safetensors")
    with pytest.raises(SnapshotError, match=r"ChunkLike.*sliding windows and ChunkedWindow only"):
        snapshot.save(manager, path)
    assert os.listdir(tmp_path) == []


def test_pool_is_refused_for_a_hybrid_snapshot(tmp_path: Any) -> None:
    manager, _ = gemma_like()
    path = str(tmp_path / "h.safetensors")
    snapshot.save(manager, path)
    pool = KVPool(4, block_size=2, head_dim=2)
    with pytest.raises(ConfigError, match="pool= is for cache snapshots"):
        snapshot.load(path, pool=pool)
    assert pool.num_free_blocks == 4


# ----------------------------------------------------------------- hostile files


def resigned(source: str, folder: str, edit: Any) -> str:
    """A copy of ``source`` with its state edited and a valid checksum."""
    metadata, tensors = snapshot_format._read(source)
    state = json.loads(metadata["state"])
    edit(state)
    path = os.path.join(folder, "hostile.safetensors")
    snapshot_format._write(path, state, {name: np.array(array) for name, array in tensors.items()})
    return path


@pytest.fixture
def no_pool_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every pool a load builds (a refused file must build none)."""
    built: list[str] = []
    original = PoolPlan.build

    def build(self: PoolPlan, growable: bool) -> KVPool:
        built.append(self.role)
        return original(self, growable)

    monkeypatch.setattr(PoolPlan, "build", build)
    return built


def plain_hybrid_file(folder: str) -> str:
    """Two groups (full | window 8), no prefix caching, "a" of 5 tokens; block_size 2, window in reach."""
    layout = GroupLayout.from_layer_windows([None, 8])
    pool = KVPool(8, block_size=2, head_dim=2, num_layers=1, dtype=np.float32)
    manager = HybridKVCacheManager(pool, layout)
    HybridDriver(manager).apply((0, 0, 4))  # add "1": 5 tokens
    path = os.path.join(folder, "valid.safetensors")
    snapshot.save(manager, path)
    return path


def refused(path: str, match: str, built: list[str]) -> None:
    with pytest.raises(SnapshotError, match=match):
        snapshot.load(path)
    assert built == []


def test_the_valid_hybrid_file_loads(tmp_path: Any, no_pool_built: list[str]) -> None:
    assert isinstance(snapshot.load(plain_hybrid_file(str(tmp_path))), HybridKVCacheManager)
    assert no_pool_built == ["device"]


def test_a_layout_whose_block_holds_other_layers_than_the_pool_is_refused(
    tmp_path: Any, no_pool_built: list[str]
) -> None:
    def edit(state: dict[str, Any]) -> None:  # two layers a block, the pool's blocks hold one
        layout = state["hybrid"]["layout"]
        layout["layers_per_group"] = 2
        layout["groups"] = [{"layers": [0, 1], "window": None, "num_sink_tokens": 0}]
        state["hybrid"]["groups"] = state["hybrid"]["groups"][:1]

    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path), edit)
    refused(path, "layout puts 2 layers in a block but the device pool's blocks hold 1", no_pool_built)


def test_a_layout_that_is_no_layout_is_refused(tmp_path: Any, no_pool_built: list[str]) -> None:
    def edit(state: dict[str, Any]) -> None:  # layer 1 in no group
        state["hybrid"]["layout"]["groups"][1]["layers"] = [0]

    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path), edit)
    refused(path, "layout is not a valid layout: groups must cover layers", no_pool_built)


def test_a_group_state_missing_for_a_layout_group_is_refused(tmp_path: Any, no_pool_built: list[str]) -> None:
    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path),
                    lambda state: state["hybrid"]["groups"].pop())
    refused(path, "holds 1 group states for the layout's 2 groups", no_pool_built)


def test_groups_that_disagree_on_a_sequences_token_count_are_refused(
    tmp_path: Any, no_pool_built: list[str]
) -> None:
    def edit(state: dict[str, Any]) -> None:
        # group 1's "a": 6 tokens in the same 3 blocks (a block table consistent on its own), group 0's 5
        record = state["hybrid"]["groups"][1]["sequences"][0]
        record["table"]["num_tokens"] = 6
        record["num_written"] = [6]

    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path), edit)
    refused(path, r"sequence 1 holds 6 tokens \(running\) in group 1 but 5 \(running\) in group 0",
            no_pool_built)


def test_groups_that_disagree_on_their_sequences_are_refused(tmp_path: Any, no_pool_built: list[str]) -> None:
    def edit(state: dict[str, Any]) -> None:
        state["hybrid"]["groups"][1]["sequences"][0]["seq_id"] = ["s", "other"]

    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path), edit)
    refused(path, r"group 1 holds sequences \['other'\], group 0 \[1\]", no_pool_built)


def test_a_block_keyed_by_two_groups_is_refused(tmp_path: Any, no_pool_built: list[str]) -> None:
    manager, _ = gemma_like()
    source = str(tmp_path / "g.safetensors")
    snapshot.save(manager, source)

    def edit(state: dict[str, Any]) -> None:  # group 1 also claims one of group 0's keyed blocks
        groups = state["hybrid"]["groups"]
        block_id, _ = groups[0]["prefix"]["keys"][0]
        groups[1]["prefix"]["keys"].append([block_id, "ab" * 32])

    refused(resigned(source, str(tmp_path), edit), "keyed by two groups", no_pool_built)


# ----------------------------------------------------------------- chunked local attention


LLAMA4_LIKE = [ChunkedWindow(4), None, ChunkedWindow(4), None]  # chunked layers between full ones


@pytest.mark.parametrize("hybrid", [True, False])
def test_chunked_local_attention_round_trips_and_continues_identically(tmp_path: Any, hybrid: bool) -> None:
    """``ChunkedWindow`` layers (Llama 4), as a hybrid group and as a plain manager's layer windows.

    Saved as ``{"chunk": 4}``: loaded as an int they would be a sliding window of 4 and every later
    output would change, which the continuation here would show (the planted test below).
    """
    chunked_round_trip(str(tmp_path), hybrid, check_file=True)


def chunked_round_trip(folder: str, hybrid: bool, check_file: bool) -> None:
    """Save and load a manager with ``LLAMA4_LIKE`` layers mid-history, then continue both alike.

    ``check_file``: also check the saved form and the loaded windows' types (off, only the
    continuation's outputs and tables can tell a chunked layer from a sliding one).
    """
    shape = dict(block_size=2, num_kv_heads=1, head_dim=2, dtype=np.float32)
    manager: Any
    if hybrid:
        layout = GroupLayout.from_layer_windows(LLAMA4_LIKE)
        manager = HybridKVCacheManager(KVPool(48, num_layers=layout.layers_per_group, **shape), layout,
                                       enable_prefix_caching=True)
        driver: Driver = HybridDriver(manager)
    else:
        manager = KVCacheManager(KVPool(48, num_layers=4, **shape), layer_max_sizes=LLAMA4_LIKE,
                                 enable_prefix_caching=True)
        driver = Driver(manager)
    driver.apply((0, 0, 8))  # a prompt of 9 tokens: chunks 0-3, 4-7, 8
    for _ in range(4):
        driver.apply((2, 0, 0))  # decode into the next chunk
    driver.apply((0, 1, 5))
    driver.apply((4, 0, 0))  # fork
    path = os.path.join(folder, "chunked.safetensors")
    snapshot.save(manager, path)
    loaded = snapshot.load(path, trust_cached_keys=True)
    assert type(loaded) is type(manager)
    loaded.check_invariants()
    if check_file:
        state = json.loads(snapshot_format._read(path)[0]["state"])
        saved = (state["hybrid"]["layout"]["groups"] if hybrid else state["manager"]["layer_max_sizes"])
        assert {"chunk": 4} in ([group["window"] for group in saved] if hybrid else saved)
    if check_file and hybrid:
        assert loaded.layout == manager.layout
        assert sorted(group.window.__class__.__name__ for group in loaded.layout.groups) == [
            "ChunkedWindow", "NoneType"]
    elif check_file:
        assert [window.__class__ for window in loaded.layer_max_sizes] == [w.__class__ for w in LLAMA4_LIKE]
    twin = (HybridDriver if hybrid else Driver)(loaded, driver.next_id)
    for op in [(2, 0, 0), (2, 1, 0), (0, 0, 6), (3, 0, 0), (2, 0, 0), (5, 1, 0), (2, 0, 0), (2, 0, 0)]:
        same_outputs(twin.apply(op), driver.apply(op))
        if hybrid:
            same_view(manager, loaded)
        else:
            same_manager_view(manager, loaded)


@pytest.mark.parametrize("window", [{"chunk": 0}, {"chunk": "4"}, {"chunked": 4}, {"chunk": 4, "extra": 1},
                                    [4], 0, True])
def test_a_saved_window_that_is_no_window_is_refused(
    tmp_path: Any, no_pool_built: list[str], window: Any
) -> None:
    def edit(state: dict[str, Any]) -> None:
        state["hybrid"]["layout"]["groups"][1]["window"] = window

    path = resigned(plain_hybrid_file(str(tmp_path)), str(tmp_path), edit)
    refused(path, r"groups\[1\]\.window = .* (is not a window|has the wrong type)", no_pool_built)


@pytest.mark.parametrize("window", [{"chunk": -2}, {"chunk": 2.0}, "4"])
def test_a_manager_layer_window_that_is_no_window_is_refused(tmp_path: Any, window: Any) -> None:
    manager = KVCacheManager(KVPool(8, block_size=2, head_dim=2, num_layers=2), layer_max_sizes=[None, 3])
    path = str(tmp_path / "valid.safetensors")
    snapshot.save(manager, path)

    def edit(state: dict[str, Any]) -> None:
        state["manager"]["layer_max_sizes"][1] = window

    hostile = resigned(path, str(tmp_path), edit)
    with pytest.raises(SnapshotError, match=r"layer_max_sizes\[1\] = .* is not a window"):
        snapshot.load(hostile)


def test_a_planted_save_of_a_chunked_window_as_its_int_changes_the_continuation(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: ``ChunkedWindow(4)`` saved as 4 (the refusal this replaced guarded against it). The
    loaded manager then attends like a sliding window: the continuation above must see it."""
    import pagedkv.snapshot.capture as capture

    monkeypatch.setattr(capture, "_window_json", lambda window: None if window is None else int(window))
    for hybrid in (True, False):
        with pytest.raises(AssertionError):
            chunked_round_trip(str(tmp_path), hybrid, check_file=False)
