"""A manager with tiers below its pool: evicted prefix blocks come back from the host, a file or Redis.

Every hit is checked against a manager that computed the same prefix itself
(the same k/v inputs): ``attend`` outputs must be bit-identical.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.redis_server import redis_server

from pagedkv import KVCacheManager, KVPool
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.tiers import (
    BlockLayout,
    FileStore,
    HostTier,
    RedisStore,
    StoreError,
    TieredStore,
    encode_block,
    store_key,
)
from pagedkv.tiers.hooks import DeviceTiering
from pagedkv.tiers.worker import PendingLoad

SHAPE = {"block_size": 4, "num_kv_heads": 2, "head_dim": 4, "num_layers": 2, "dtype": np.float32}
MODEL = "test-model"
PROMPT_A = [(5 * t + 1) % 97 for t in range(13)]   # 3 full blocks and one token to compute
PROMPT_B = [(3 * t + 50) % 89 for t in range(29)]  # 7 full blocks: pushes A's blocks out of 8


def inputs(prompt: list[int], positions: np.ndarray, layer: int, shape: dict) -> tuple[np.ndarray, ...]:
    """k, v, q for ``prompt``'s tokens at ``positions`` of ``layer``: a function of token and position."""
    heads, dim = shape["num_kv_heads"], shape["head_dim"]
    tokens = np.asarray(prompt, np.float64)[positions]
    grid = tokens[:, None, None] * 0.031 + positions[:, None, None] * 0.017 + layer
    grid = grid + np.arange(heads)[None, :, None] * 0.5 + np.arange(dim)[None, None, :] * 0.25
    k, v, q = np.sin(grid), np.cos(grid), np.sin(2 * grid)   # (num_tokens, num_kv_heads, head_dim)
    return tuple(x.astype(shape["dtype"]) for x in (k, v, q))


def run(
    manager: KVCacheManager,
    seq_id: str,
    prompt: list[int],
    shape: dict = SHAPE,
    prefetched: PendingLoad | None = None,
) -> tuple[int, list]:
    """Admit ``prompt``, write the tokens past its hit, attend them; the hit and each layer's output."""
    num_hit = manager.add_sequence(seq_id, prompt, prefetched=prefetched)
    batch = manager.reserve({seq_id: prompt[num_hit:]})
    positions = np.arange(num_hit, len(prompt))
    outputs = []
    for layer in range(shape["num_layers"]):
        k, v, q = inputs(prompt, positions, layer, shape)
        manager.write(layer, batch, k, v)
        outputs.append(manager.attend(layer, batch, q))
    return num_hit, outputs


def recomputed(prompt: list[int], num_hit: int, shape: dict = SHAPE) -> list:
    """The outputs of ``run`` for a manager that computed the first ``num_hit`` tokens itself."""
    manager = KVCacheManager(KVPool(-(-len(prompt) // shape["block_size"]) + 1, **shape))
    manager.add_sequence("s")
    if num_hit:
        batch = manager.reserve({"s": num_hit})
        for layer in range(shape["num_layers"]):
            k, v, _ = inputs(prompt, np.arange(num_hit), layer, shape)
            manager.write(layer, batch, k, v)
    batch = manager.reserve({"s": len(prompt) - num_hit})
    positions = np.arange(num_hit, len(prompt))
    outputs = []
    for layer in range(shape["num_layers"]):
        k, v, q = inputs(prompt, positions, layer, shape)
        manager.write(layer, batch, k, v)
        outputs.append(manager.attend(layer, batch, q))
    return outputs


def file_tiers(directory: Path, **options: object) -> Callable[[BlockLayout], TieredStore]:
    store = FileStore(directory, max_bytes=1 << 20)
    return lambda layout: TieredStore(layout, stores=[store], **options)  # type: ignore[arg-type]


def tiered_manager(make_tiers: Callable[[BlockLayout], TieredStore], **options: object) -> KVCacheManager:
    pool = KVPool(8, **SHAPE)
    tiers = make_tiers(BlockLayout.of_pool(pool, MODEL))
    return KVCacheManager(pool, enable_prefix_caching=True, tiers=tiers, **options)  # type: ignore[arg-type]


def evict_a(manager: KVCacheManager) -> None:
    """Compute A, free it, then run B, whose 8 blocks push A's cached blocks out of the pool."""
    run(manager, "a", PROMPT_A)
    manager.free("a")
    run(manager, "b", PROMPT_B)
    manager.free("b")
    manager.flush_tiers()


def host_tiers(layout: BlockLayout) -> TieredStore:
    return TieredStore(layout, host=HostTier(block_nbytes=layout.block_nbytes, num_blocks=16))


def assert_same(outputs: list, expected: list) -> None:
    for got, want in zip(outputs, expected, strict=True):
        assert np.array_equal(got, want), "attend outputs differ from recomputing the prefix"


# ---------------------------------------------------------------- hits from each tier


def test_a_prefix_evicted_to_the_host_tier_is_loaded_back_bit_identical() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    assert manager.prefix_cache is not None and manager.prefix_cache.num_evictions >= 3
    assert manager.lookup(PROMPT_A).num_tier_blocks == 3
    num_hit, outputs = run(manager, "a2", PROMPT_A)
    # 13 tokens: 3 full blocks (12 tokens) came from the host tier, token 12 is computed
    assert num_hit == 12
    metrics = manager.metrics()
    assert metrics.num_tier_hits == 12 and metrics.num_prefix_hits == 12 and metrics.num_tier_errors == 0
    assert_same(outputs, recomputed(PROMPT_A, 12))
    manager.check_invariants()


def test_without_tiers_the_same_traffic_recomputes_the_evicted_prefix() -> None:
    manager = KVCacheManager(KVPool(8, **SHAPE), enable_prefix_caching=True)
    evict_a(manager)
    assert run(manager, "a2", PROMPT_A)[0] == 0   # the contrast: the host tier is what gives the hit


def test_a_prefix_evicted_to_a_file_store_is_loaded_back_bit_identical(tmp_path: Path) -> None:
    manager = tiered_manager(file_tiers(tmp_path))
    evict_a(manager)
    num_hit, outputs = run(manager, "a2", PROMPT_A)
    assert num_hit == 12 and manager.metrics().num_tier_hits == 12
    assert_same(outputs, recomputed(PROMPT_A, 12))
    manager.check_invariants()


def test_a_prefix_evicted_to_redis_is_loaded_back_bit_identical() -> None:
    with redis_server() as server:
        store = RedisStore(port=server.port, timeout_s=5)
        manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store]))
        evict_a(manager)
        num_hit, outputs = run(manager, "a2", PROMPT_A)
        assert num_hit == 12 and manager.metrics().num_tier_hits == 12
        assert_same(outputs, recomputed(PROMPT_A, 12))
        store.close()


def test_write_through_stores_blocks_as_soon_as_they_are_keyed(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=1 << 20)
    manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store], write_policy="write_through"))
    run(manager, "a", PROMPT_A)           # nothing evicted: the blocks are still on the device
    manager.flush_tiers()
    assert len(list(tmp_path.iterdir())) == 3
    other = tiered_manager(file_tiers(tmp_path))
    num_hit, outputs = run(other, "a", PROMPT_A)
    assert num_hit == 12
    assert_same(outputs, recomputed(PROMPT_A, 12))


def test_tier_events_name_their_medium_and_device_events_say_gpu() -> None:
    manager = tiered_manager(host_tiers, kv_events=True)
    evict_a(manager)
    events = manager.drain_kv_events()
    mediums = {type(event).__name__ + ":" + str(event.medium) for event in events if hasattr(event, "medium")}
    assert {"BlockStored:GPU", "BlockRemoved:GPU", "BlockStored:CPU"} <= mediums


# ---------------------------------------------------------------- failures mean recompute


class FlakyStore:
    """A dict store whose ``get`` fails from the ``num_good_gets``-th call on (the server died mid-load)."""

    medium = "REDIS"

    def __init__(self, num_good_gets: int) -> None:
        self.values: dict[bytes, bytes] = {}
        self.num_good_gets = num_good_gets

    def put(self, key: bytes, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: bytes) -> bytes | None:
        if self.num_good_gets <= 0:
            raise StoreError("the server went away")
        self.num_good_gets -= 1
        return self.values.get(key)

    def exists(self, key: bytes) -> bool:
        return key in self.values

    def delete(self, key: bytes) -> None:
        self.values.pop(key, None)


@pytest.mark.parametrize("num_good_gets", [0, 1, 2])
def test_a_load_that_fails_part_way_frees_its_blocks_and_computes_the_rest(num_good_gets: int) -> None:
    store = FlakyStore(num_good_gets)
    manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store]))
    evict_a(manager)
    num_free = manager.pool.num_free_blocks
    num_hit, outputs = run(manager, "a2", PROMPT_A)
    # found 3 in the store, loaded num_good_gets of them; the failed ones went back and were computed
    assert num_hit == 4 * num_good_gets
    assert manager.metrics().num_tier_errors == 1
    assert manager.pool.num_free_blocks == num_free - 4   # the sequence holds 4 blocks, nothing leaked
    assert_same(outputs, recomputed(PROMPT_A, num_hit))
    manager.check_invariants()


def test_killing_redis_mid_run_recomputes_and_counts_an_error() -> None:
    with redis_server() as server:
        store = RedisStore(port=server.port, timeout_s=0.5)
        manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store]))
        evict_a(manager)
        assert manager.lookup(PROMPT_A).num_tier_blocks == 3
        server.stop()
        num_hit, outputs = run(manager, "a2", PROMPT_A)
        assert num_hit == 0
        assert manager.metrics().num_tier_errors >= 1
        assert_same(outputs, recomputed(PROMPT_A, 0))
        # and the next admission, while the store is marked down, neither waits nor fails
        manager.free("a2")
        run(manager, "b2", PROMPT_B)
        manager.check_invariants()


def test_a_stale_value_planted_under_a_key_is_refused_and_recomputed(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=1 << 20)
    manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store]))
    layout = manager.tiering.tiers.layout if manager.tiering is not None else None
    assert layout is not None
    evict_a(manager)
    # plant B's first block (a valid value, its own checksum) under A's first key
    a_key = _prompt_keys(manager, PROMPT_A)[0]
    b_key = _prompt_keys(manager, PROMPT_B)[0]
    payload = np.frombuffer(bytes(layout.block_nbytes), np.uint8)
    store.put(store_key(layout, a_key), encode_block(layout, b_key, payload))
    num_hit, outputs = run(manager, "a2", PROMPT_A)
    assert num_hit == 0
    assert manager.metrics().num_tier_errors == 1   # refused, counted
    assert_same(outputs, recomputed(PROMPT_A, 0))


def _prompt_keys(manager: KVCacheManager, prompt: list[int]) -> list[bytes]:
    from pagedkv.prefix.cache import ROOT_KEY, block_keys, hash_function, token_bytes

    return block_keys(ROOT_KEY, token_bytes(prompt), manager.pool.block_size, b"", hash_function("sha256"))


# ---------------------------------------------------------------- configuration


def test_tiers_without_prefix_caching_are_refused_and_nothing_changes() -> None:
    pool = KVPool(8, **SHAPE)
    tiers = host_tiers(BlockLayout.of_pool(pool, MODEL))
    with pytest.raises(ConfigError, match="enable_prefix_caching=True"):
        KVCacheManager(pool, tiers=tiers)
    with pytest.raises(ConfigError, match="full attention only"):
        KVCacheManager(pool, enable_prefix_caching=True, max_size=8, tiers=tiers)
    assert pool.allocator.on_evict is None and pool.num_free_blocks == 8
    assert len(tiers.host or ()) == 0 and tiers.drain_events() == []
    KVCacheManager(pool, enable_prefix_caching=True)   # the pool is free for a prefix cache


def test_tiers_of_another_layout_are_refused() -> None:
    pool = KVPool(8, **SHAPE)
    other = BlockLayout.of_pool(KVPool(8, **{**SHAPE, "block_size": 8}), MODEL)
    with pytest.raises(ConfigError, match="tiers of"):
        KVCacheManager(pool, enable_prefix_caching=True, tiers=host_tiers(other))
    assert pool.allocator.on_evict is None


# ---------------------------------------------------------------- two processes over Redis

SCRIPT = textwrap.dedent('''
    import os, sys
    sys.path[:0] = [sys.argv[3], os.path.dirname(sys.argv[3])]  # this file's folder, and tests/ (support)
    import numpy as np
    from test_tiers_manager import recomputed, run
    from pagedkv import KVCacheManager, KVPool
    from pagedkv.tiers import BlockLayout, RedisStore, TieredStore

    role, port = sys.argv[1], int(sys.argv[2])
    shape = {"block_size": 16, "num_kv_heads": 2, "head_dim": 8, "num_layers": 2, "dtype": np.float32}
    prompt = [(7 * t + 3) % 32000 for t in range(2000)]
    pool = KVPool(130, **shape)
    store = RedisStore(port=port, timeout_s=5)
    tiers = TieredStore(BlockLayout.of_pool(pool, "test-model"), stores=[store], write_policy="write_through")
    manager = KVCacheManager(pool, enable_prefix_caching=True, tiers=tiers)
    num_hit, outputs = run(manager, "p", prompt, shape)
    manager.flush_tiers()
    same = all(np.array_equal(a, b) for a, b in zip(outputs, recomputed(prompt, num_hit, shape)))
    metrics = manager.metrics()
    print(role, num_hit, metrics.num_tier_hits, metrics.num_tier_errors, same)
''')


def test_a_second_process_admits_a_2000_token_prompt_from_redis_bit_identical(tmp_path: Path) -> None:
    script = tmp_path / "side.py"
    script.write_text(SCRIPT)
    tests = str(Path(__file__).parent)
    with redis_server() as server:
        lines = []
        for role in ("first", "second"):
            done = subprocess.run([sys.executable, str(script), role, str(server.port), tests],
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            lines.append(done.stdout.split())
    # the first computes all of it; the second loads 124 full blocks (1,984 tokens) and computes 16
    assert lines[0] == ["first", "0", "0", "0", "True"]
    assert lines[1] == ["second", "1984", "1984", "0", "True"]


# ---------------------------------------------------------------- off the step: prefetch, then admit


class GatedStore(FlakyStore):
    """A dict store whose ``get`` waits for ``gate`` (a slow server), and can raise a non-store error."""

    def __init__(self) -> None:
        super().__init__(num_good_gets=1 << 30)
        self.gate = threading.Event()
        self.gate.set()
        self.broken = False
        self.num_stalls = 0   # gets that gave up waiting: someone waited on this store for 5 s

    def get(self, key: bytes) -> bytes | None:
        if not self.gate.wait(timeout=5):
            self.num_stalls += 1
        if self.broken:
            raise RuntimeError("a bug in the store client")   # not a StoreError: fetch itself raises
        return super().get(key)


def gated_manager() -> tuple[KVCacheManager, GatedStore]:
    store = GatedStore()
    manager = tiered_manager(lambda layout: TieredStore(layout, stores=[store]))
    evict_a(manager)
    return manager, store


def tiering_of(manager: KVCacheManager) -> DeviceTiering:
    assert manager.tiering is not None
    return manager.tiering


def test_a_prefetched_prefix_is_admitted_from_the_load_bit_identical() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    load = manager.prefetch(PROMPT_A)
    assert load.wait(timeout_s=10) and load.status == "ready" and len(load.keys) == 3
    num_free = manager.pool.num_free_blocks
    assert num_free == 8   # the prefetch took no device block
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)
    assert num_hit == 12
    assert manager.metrics().num_tier_hits == 12 and tiering_of(manager).num_prefetched_blocks == 3
    assert_same(outputs, recomputed(PROMPT_A, 12))
    manager.check_invariants()


def test_a_prefetch_from_a_slow_store_holds_no_lock_while_the_store_answers() -> None:
    manager, store = gated_manager()
    store.gate.clear()                       # the server stalls every get
    load = manager.prefetch(PROMPT_A)
    # the step goes on while the worker waits on the store: B runs to the end, under the pool's lock
    assert not load.done()
    run(manager, "b2", PROMPT_B[:9])
    manager.free("b2")
    store.gate.set()
    assert load.wait(timeout_s=10) and load.status == "ready"
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)
    assert num_hit == 12 and manager.metrics().num_tier_errors == 0
    assert_same(outputs, recomputed(PROMPT_A, 12))
    manager.check_invariants()


def test_a_synchronous_admission_does_not_wait_behind_a_stalled_prefetch() -> None:
    manager, store = gated_manager()
    store.gate.clear()
    load = manager.prefetch(PROMPT_A)          # stalls on the store
    # a prompt the device lacks: admission asks the tiers, after waiting for their queued writes
    num_hit, _ = run(manager, "c", [40 + t for t in range(9)])
    stalled = store.num_stalls
    store.gate.set()
    assert num_hit == 0 and stalled == 0       # it waited for the writes, not for the load
    assert load.wait(timeout_s=10) and load.status == "ready"


def test_admitting_with_a_load_not_done_computes_the_prefix_and_counts_it_late() -> None:
    manager, store = gated_manager()
    store.gate.clear()
    load = manager.prefetch(PROMPT_A)
    num_free = manager.pool.num_free_blocks
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)   # returns at once: no wait
    store.gate.set()
    assert num_hit == 0 and load.status == "cancelled"
    assert tiering_of(manager).num_prefetch_late == 1 and manager.metrics().num_tier_errors == 1
    assert manager.pool.num_free_blocks == num_free - 4   # the sequence's own 4 blocks, nothing leaked
    assert_same(outputs, recomputed(PROMPT_A, 0))
    manager.check_invariants()


def test_a_cancelled_prefetch_gives_no_blocks_and_is_counted() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    load = manager.prefetch(PROMPT_A)
    load.cancel()
    assert load.status == "cancelled" and load.payloads() == []
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)
    assert num_hit == 0 and tiering_of(manager).num_prefetch_cancelled == 1
    assert manager.metrics().num_tier_errors == 0   # a cancel is the caller's choice, not an error
    assert_same(outputs, recomputed(PROMPT_A, 0))
    manager.check_invariants()


def test_a_prefetch_that_raises_is_a_counted_error_and_the_prefix_is_computed() -> None:
    manager, store = gated_manager()
    store.broken = True
    load = manager.prefetch(PROMPT_A)
    assert load.wait(timeout_s=10) and load.status == "failed"
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)
    assert num_hit == 0 and tiering_of(manager).num_prefetch_failed == 1
    assert manager.metrics().num_tier_errors == 1
    assert_same(outputs, recomputed(PROMPT_A, 0))
    manager.check_invariants()


def test_a_prefetch_of_another_prompt_is_stale_and_the_prompt_is_computed() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    load = manager.prefetch(PROMPT_A)
    assert load.wait(timeout_s=10)
    num_hit, _ = run(manager, "a2", PROMPT_A[:1] + PROMPT_A[1:][::-1], prefetched=load)
    assert num_hit == 0 and tiering_of(manager).num_prefetch_stale == 1
    manager.check_invariants()


def test_a_prefetch_overtaken_by_the_device_uses_only_the_blocks_past_the_new_device_hit() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    load = manager.prefetch(PROMPT_A)            # fetches A's 3 blocks
    assert load.wait(timeout_s=10)
    run(manager, "a1", PROMPT_A[:9])             # meanwhile the device computes A's first 2 blocks
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load)
    assert num_hit == 12
    assert tiering_of(manager).num_prefetched_blocks == 1   # block 2 alone came from the load
    assert_same(outputs, recomputed(PROMPT_A, 12))
    manager.check_invariants()


def test_a_prefetch_with_other_extra_keys_loads_nothing() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    load = manager.prefetch(PROMPT_A, extra_keys={"salt": "tenant-2"})
    assert load.wait(timeout_s=10) and load.payloads() == []
    assert run(manager, "a2", PROMPT_A, prefetched=load)[0] == 0


def test_a_prefetch_through_a_file_store_runs_on_the_worker_and_is_bit_identical(tmp_path: Path) -> None:
    manager = tiered_manager(file_tiers(tmp_path))
    evict_a(manager)
    load = manager.prefetch(PROMPT_A)
    num_hit, outputs = run(manager, "a2", PROMPT_A, prefetched=load if load.wait(timeout_s=10) else None)
    assert num_hit == 12
    assert_same(outputs, recomputed(PROMPT_A, 12))


def test_bad_prefetched_arguments_are_refused_and_nothing_changes() -> None:
    manager = tiered_manager(host_tiers)
    evict_a(manager)
    other = tiered_manager(host_tiers)
    foreign = other.prefetch(PROMPT_A)
    load = manager.prefetch(PROMPT_A)
    before = (manager.pool.num_free_blocks, manager.seq_ids, manager.metrics())
    with pytest.raises(InputTypeError, match="PendingLoad"):
        manager.add_sequence("x", PROMPT_A, prefetched=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a load of this manager"):
        manager.add_sequence("x", PROMPT_A, prefetched=foreign)
    with pytest.raises(ConfigError, match="needs the prompt"):
        manager.add_sequence("x", prefetched=load)
    assert (manager.pool.num_free_blocks, manager.seq_ids, manager.metrics()) == before
    assert load.status == "ready"   # untouched: still usable
    plain = KVCacheManager(KVPool(8, **SHAPE), enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="prefetch loads from tiers"):
        plain.prefetch(PROMPT_A)
    with pytest.raises(ConfigError, match="not a load of this manager"):
        plain.add_sequence("x", PROMPT_A, prefetched=load)
    assert plain.seq_ids == [] and plain.pool.num_free_blocks == 8
