"""Snapshots: round trips that continue identically, and files that must be refused.

Round trips run a random history on a real object, save it, load it, and
then feed the original and the loaded object the same further operations:
every output must be equal bit for bit, every block table and every metric
the same, and saving the loaded object must capture the same state again.

Corruption tests start from one valid snapshot of a manager that uses
everything (prefix caching, forks, windows, sinks, a host tier, quantized
pages) and damage it: truncation at many offsets, flipped bytes in header
and payload, and hand-edited states that carry a *valid* checksum (re-signed
with the writer), so validation itself must refuse them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import sys
import tempfile
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from support.managers import make_manager

import pagedkv.snapshot.format
from pagedkv import KVCache, KVCacheManager, KVPool, snapshot
from pagedkv.errors import (
    ClosedCacheError,
    ConfigError,
    InputTypeError,
    PagedKVError,
    PoolExhaustedError,
    SnapshotError,
)
from pagedkv.manager.manager import SequenceState
from pagedkv.snapshot import format as snapshot_format
from pagedkv.snapshot.capture import capture_manager

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

STORAGE = [None, "int8", "float8_e4m3"]


def equal(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of outputs (arrays, lists of floats, or error names)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and (
            np.array_equal(a.view(np.uint8), b.view(np.uint8)))
    return bool(a == b)


# ====================================================================== caches


@settings(max_examples=20)
@given(
    max_size=st.one_of(st.none(), st.integers(1, 9)),
    block_size=st.integers(1, 4),
    dtype=st.sampled_from([np.float32, np.float64]),
    key_dtype=st.sampled_from(STORAGE),
    value_dtype=st.sampled_from(STORAGE),
    num_before=st.integers(0, 30),
    num_after=st.integers(1, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_cache_round_trip_continues_identically(
    max_size: int | None, block_size: int, dtype: Any, key_dtype: str | None, value_dtype: str | None,
    num_before: int, num_after: int, seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    tokens = [tuple(rng.standard_normal((3, 2, 4)).astype(dtype)) for _ in range(num_before + num_after)]
    cache = KVCache(max_size, block_size=block_size, dtype=dtype, key_dtype=key_dtype,
                    value_dtype=value_dtype)
    for q, k, v in tokens[:num_before]:
        cache.attend(np.tile(q, (2, 1)), k, v)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.safetensors")
        snapshot.save(cache, path)
        twin = snapshot.load(path)
    assert isinstance(twin, KVCache)
    assert twin.block_ids == cache.block_ids and len(twin) == len(cache)
    assert equal(twin.keys(), cache.keys()) and equal(twin.values(), cache.values())
    for q, k, v in tokens[num_before:]:
        assert equal(twin.attend(np.tile(q, (2, 1)), k, v), cache.attend(np.tile(q, (2, 1)), k, v))
        assert twin.block_ids == cache.block_ids
    twin.check_invariants()


def test_a_fresh_cache_and_list_outputs_round_trip(tmp_path: Any) -> None:
    path = str(tmp_path / "empty.safetensors")
    snapshot.save(KVCache(max_size=3), path)
    twin = snapshot.load(path)
    assert isinstance(twin, KVCache) and len(twin) == 0 and twin.pool is None
    assert twin.attend([1.0], [1.0], [42.0]) == [42.0]


def test_a_cache_on_a_shared_pool_loads_into_a_private_or_a_given_pool(tmp_path: Any) -> None:
    shared = KVPool(8, block_size=2, head_dim=3, key_dtype="int8")
    other = KVCache(pool=shared)
    cache = KVCache(max_size=5, pool=shared)
    rng = np.random.default_rng(0)
    for _ in range(7):
        other.attend(*(rng.standard_normal(3) for _ in range(3)))
        cache.attend(*(rng.standard_normal(3) for _ in range(3)))
    path = str(tmp_path / "shared.safetensors")
    snapshot.save(cache, path)
    private = snapshot.load(path)
    target = KVPool(6, block_size=2, head_dim=3, key_dtype="int8")
    blocker = KVCache(pool=target)  # holds block 0, so the loaded ids differ from both pools'
    blocker.attend([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])
    placed = snapshot.load(path, pool=target)
    assert isinstance(private, KVCache) and isinstance(placed, KVCache)
    assert private.pool is not shared and placed.pool is target
    assert target.num_free_blocks == 5 - placed.num_blocks
    for _ in range(6):
        q, k, v = (rng.standard_normal(3) for _ in range(3))
        out = cache.attend(q, k, v)
        assert equal(private.attend(q, k, v), out) and equal(placed.attend(q, k, v), out)
    private.check_invariants()
    placed.close()
    assert target.num_free_blocks == 5


def test_loading_into_a_pool_that_does_not_fit_changes_nothing(tmp_path: Any) -> None:
    cache = KVCache(block_size=2)
    for i in range(5):
        cache.attend([1.0, 0.0], [0.5, float(i)], [float(i), 1.0])
    path = str(tmp_path / "c.safetensors")
    snapshot.save(cache, path)
    full = KVPool(4, block_size=2, head_dim=2)
    holder = KVCache(pool=full)
    for i in range(3):
        holder.attend([1.0, 0.0], [1.0, 0.0], [float(i), 0.0])
    with pytest.raises(ConfigError, match="needs 3 blocks, 2 are free"):
        snapshot.load(path, pool=full)
    with pytest.raises(ConfigError, match="block_size=2"):
        snapshot.load(path, pool=KVPool(4, block_size=4, head_dim=2))
    with pytest.raises(ConfigError, match="key_dtype"):
        snapshot.load(path, pool=KVPool(4, block_size=2, head_dim=2, key_dtype="int8"))
    assert full.num_free_blocks == 2 and full.allocator.free_block_ids() == [2, 3]
    full.check_invariants()


# ==================================================================== managers


class Driver:
    """Applies one encoded operation to a manager; returns what an observer would see.

    Both the original and the loaded manager run the same operations through
    their own ``Driver`` (same counters), so outcomes must match exactly.
    Keys and values are a hash of (token, position, layer): honest for
    prefix caching, identical on both sides.
    """

    KINDS = ("add", "prefill", "decode", "decode_batch", "fork", "free", "recompute", "swap", "resume")
    PROMPTS = ([1, 2, 1, 1, 2, 2, 1, 2, 1], [1, 2, 1, 1, 2, 1, 1, 1, 2], [1, 2, 2, 2, 1, 1, 2, 1, 1],
               [2, 1, 1, 2])

    def __init__(self, manager: KVCacheManager, next_id: int = 0) -> None:
        self.manager = manager
        self.next_id = next_id
        pool = manager.pool
        self.shape = (pool.num_kv_heads, pool.head_dim)

    def new_id(self) -> Hashable:
        self.next_id += 1
        return self.next_id if self.next_id % 2 else f"s{self.next_id}"

    def kv(self, tokens: list[int], start: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = []
        for offset, token in enumerate(tokens):
            seed = int.from_bytes(hashlib.sha256(f"{token}/{start + offset}/{layer}".encode()).digest()[:8])
            rows.append(np.random.default_rng(seed).standard_normal((3, *self.shape)))
        k, v, q = (np.stack([row[i] for row in rows]) for i in range(3))
        q = np.repeat(q, self.manager.num_q_heads // self.shape[0], axis=1)
        dtype = self.manager.pool.dtype
        return k.astype(dtype), v.astype(dtype), q.astype(dtype)

    def step(self, requests: dict[Hashable, list[int]], method: str = "loop") -> Any:
        manager = self.manager
        starts = {seq_id: manager.num_tokens(seq_id) for seq_id in requests}
        with_ids = manager.prefix_caching
        batch = manager.reserve({s: (t if with_ids else len(t)) for s, t in requests.items()})
        outputs = []
        for layer in range(manager.pool.num_layers):
            parts = [self.kv(t, starts[s], layer) for s, t in requests.items()]
            k, v, q = (np.concatenate([p[i] for p in parts]) for i in range(3))
            manager.write(layer, batch, k, v)
            outputs.append(manager.attend(layer, batch, q, method=method))
        return outputs

    def running(self) -> list[Hashable]:
        return [s for s in self.manager.seq_ids if self.manager.state(s) is SequenceState.RUNNING]

    def apply(self, op: tuple[int, int, int]) -> Any:
        kind, a, b = self.KINDS[op[0] % len(self.KINDS)], op[1], op[2]
        manager = self.manager
        running = self.running()
        try:
            if kind == "add":
                seq_id = self.new_id()
                prompt = self.PROMPTS[a % len(self.PROMPTS)][: 1 + b % 9]  # shared prefixes, often
                num_cached = manager.add_sequence(seq_id, prompt)
                return [num_cached, self.step({seq_id: prompt[num_cached:]})]
            if kind in ("prefill", "decode") and running:
                seq_id = running[a % len(running)]
                num_new = 1 + b % 5 if kind == "prefill" else 1
                return self.step({seq_id: [1 + (a + i) % 3 for i in range(num_new)]})
            if kind == "decode_batch" and running:
                chosen = running[a % len(running):][: 1 + b % 3]
                return self.step({s: [1 + a % 3] for s in chosen}, method="padded" if b % 2 else "loop")
            if kind == "fork" and running:
                child = self.new_id()
                manager.fork(running[a % len(running)], child)
                return child
            if kind == "free" and manager.seq_ids:
                manager.free(manager.seq_ids[a % len(manager.seq_ids)])
                return "freed"
            if kind in ("recompute", "swap") and running:
                manager.preempt(running[a % len(running)], "swap" if kind == "swap" else "recompute")
                return kind
            if kind == "resume":
                waiting = [s for s in manager.seq_ids if s not in running]
                if waiting:
                    return manager.resume(waiting[a % len(waiting)])
        except (PoolExhaustedError, ConfigError) as error:
            return type(error).__name__
        return None


manager_configs = st.fixed_dictionaries({
    "num_blocks": st.integers(6, 16),
    "block_size": st.integers(1, 4),
    "num_layers": st.integers(1, 2),
    "heads": st.sampled_from([(1, 1), (2, 4)]),
    "head_dim": st.integers(2, 4),
    "dtype": st.sampled_from([np.float32, np.float64]),
    "storage": st.sampled_from([(None, None), ("int8", "int8"), ("float8_e4m3", None), (None, "int8")]),
    "max_size": st.one_of(st.none(), st.integers(2, 9)),
    "num_sink_tokens": st.integers(0, 3),
    "prefix": st.booleans(),
    "host_blocks": st.one_of(st.none(), st.integers(2, 10)),
})


def build_manager(config: dict[str, Any]) -> KVCacheManager:
    num_kv_heads, num_q_heads = config["heads"]
    key_dtype, value_dtype = config["storage"]
    return make_manager(config["num_blocks"], host_blocks=config["host_blocks"] or 0,
                        block_size=config["block_size"], num_kv_heads=num_kv_heads,
                        head_dim=config["head_dim"], num_layers=config["num_layers"], dtype=config["dtype"],
                        key_dtype=key_dtype, value_dtype=value_dtype, max_size=config["max_size"],
                        num_sink_tokens=config["num_sink_tokens"], num_q_heads=num_q_heads,
                        enable_prefix_caching=config["prefix"], scale=0.5)


def same_view(one: KVCacheManager, two: KVCacheManager) -> None:
    assert one.seq_ids == two.seq_ids
    for seq_id in one.seq_ids:
        assert one.state(seq_id) == two.state(seq_id)
        assert one.block_table(seq_id).block_ids == two.block_table(seq_id).block_ids
        assert one.num_tokens(seq_id) == two.num_tokens(seq_id)
    assert one.metrics() == two.metrics()
    assert one.pool.allocator.free_block_ids() == two.pool.allocator.free_block_ids()
    assert one.pool.allocator.cached_free_block_ids() == two.pool.allocator.cached_free_block_ids()


ops = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 255), st.integers(0, 255)), min_size=1,
               max_size=40)


@settings(max_examples=25)
@given(config=manager_configs, before=ops, after=ops)
def test_a_manager_round_trip_continues_identically(
    config: dict[str, Any], before: list[tuple[int, int, int]], after: list[tuple[int, int, int]]
) -> None:
    manager = build_manager(config)
    driver = Driver(manager)
    for op in before:
        note(f"before: {Driver.KINDS[op[0]]} -> {driver.apply(op)!r:.80}")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "manager.safetensors")
        snapshot.save(manager, path)
        loaded = snapshot.load(path, trust_cached_keys=True)  # our own file: keep its cached free keys
        assert isinstance(loaded, KVCacheManager)
        loaded.check_invariants()
        same_view(manager, loaded)
        # Saving the loaded manager captures the very same state and pages.
        (state, tensors), (state2, tensors2) = capture_manager(manager), capture_manager(loaded)
        assert state == state2 and tensors.keys() == tensors2.keys()
        assert all(equal(tensors[name], tensors2[name]) for name in tensors)
    twin = Driver(loaded, driver.next_id)
    for op in after:
        got, want = twin.apply(op), driver.apply(op)
        note(f"after: {Driver.KINDS[op[0]]} -> {want!r:.80}")
        assert type(got) is type(want)
        if isinstance(want, list):
            assert len(got) == len(want) and all(
                equal(x, y) if not isinstance(x, list) else all(map(equal, x, y)) for x, y in zip(got, want))
        else:
            assert got == want
        same_view(manager, loaded)
        loaded.check_invariants()


def test_only_blocks_in_use_are_saved(tmp_path: Any) -> None:
    manager = KVCacheManager(KVPool(10_000, block_size=16, num_kv_heads=2, head_dim=8, dtype=np.float32))
    manager.add_sequence("a")
    batch = manager.reserve({"a": 20})  # 2 blocks
    kv = np.ones((20, 2, 8), np.float32)
    manager.write(0, batch, kv, kv)
    path = str(tmp_path / "m.safetensors")
    snapshot.save(manager, path)
    _, tensors = snapshot_format._read(path)
    assert tensors["device.keys.0"].shape == (2, 2, 16, 8)
    assert os.path.getsize(path) < 8 * 1024  # the 10,000-block pool itself would be 10 MB


def test_what_cannot_be_saved_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "x.safetensors")
    pool = KVPool(8, block_size=2, head_dim=2)
    manager = KVCacheManager(pool)
    manager.add_sequence(("a", 1))
    with pytest.raises(SnapshotError, match="only str and int ids"):
        snapshot.save(manager, path)
    manager.free(("a", 1))
    manager.add_sequence("a")
    manager.reserve({"a": 3})  # reserved, never written
    with pytest.raises(SnapshotError, match="not written"):
        snapshot.save(manager, path)
    manager.free("a")
    stranger = KVCache(pool=pool)
    stranger.attend([1.0, 1.0], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(SnapshotError, match="another cache or manager"):
        snapshot.save(manager, path)
    stranger.close()
    with pytest.raises(ClosedCacheError):
        snapshot.save(stranger, path)
    with pytest.raises(InputTypeError, match="KVCache or a KVCacheManager"):
        snapshot.save(pool, path)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []  # no temporary file left behind either


def test_missing_safetensors_names_the_snapshot_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError, match=r'pip install "pagedkv\[snapshot\]"'):
        snapshot.save(KVCache(), str(tmp_path / "x"))
    with pytest.raises(ImportError, match=r"pagedkv\[snapshot\]"):
        snapshot.load(str(tmp_path / "x"))


def test_saving_replaces_the_file_atomically_and_leaves_no_temporary(tmp_path: Any) -> None:
    path = str(tmp_path / "c.safetensors")
    cache = KVCache()
    cache.attend([1.0], [1.0], [1.0])
    snapshot.save(cache, path)
    cache.attend([1.0], [1.0], [2.0])
    snapshot.save(cache, path)
    assert os.listdir(tmp_path) == ["c.safetensors"]
    loaded = snapshot.load(path)
    assert isinstance(loaded, KVCache) and len(loaded) == 2


def _fail(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "injected fault: no space left on device")


def _write_half_then_fail(out: Any, metadata: Any, tensors: Any) -> None:
    """A snapshot writer that dies half-way: half the file's bytes, then an error."""
    import io

    whole = io.BytesIO()
    _REAL_SERIALIZE(whole, metadata, tensors)
    data = whole.getvalue()
    out.write(data[: len(data) // 2])
    out.flush()
    _fail()


_REAL_SERIALIZE = pagedkv.snapshot.format._serialize

#: Ways a save can fail after it started writing; each is patched in for one save.
SAVE_FAULTS: dict[str, Any] = {
    "the writer stops half-way": lambda mp: mp.setattr(
        "pagedkv.snapshot.format._serialize", _write_half_then_fail
    ),
    "fsync fails": lambda mp: mp.setattr(os, "fsync", _fail),
    "the rename fails": lambda mp: mp.setattr(os, "replace", _fail),
}


@pytest.mark.parametrize("fault", sorted(SAVE_FAULTS))
def test_a_save_that_fails_mid_write_leaves_the_old_file_byte_for_byte(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    path = tmp_path / "c.safetensors"
    cache = KVCache(block_size=2)
    cache.attend([1.0], [1.0], [1.0])
    snapshot.save(cache, str(path))
    before = path.read_bytes()
    cache.attend([1.0], [2.0], [2.0])  # the next save writes other bytes
    with monkeypatch.context() as patched:
        SAVE_FAULTS[fault](patched)
        with pytest.raises(OSError, match="injected fault"):
            snapshot.save(cache, str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]  # no temporary file left beside it
    loaded = snapshot.load(str(path))
    assert isinstance(loaded, KVCache) and len(loaded) == 1


# ================================================================= corruption


@pytest.fixture(scope="module")
def valid(tmp_path_factory: Any) -> tuple[str, bytes]:
    """A snapshot of a manager using everything: prefix keys, forks, window, sinks, host tier, int8."""
    manager = make_manager(24, host_blocks=8, block_size=2, num_kv_heads=2, head_dim=4, num_layers=2,
                           dtype=np.float32, key_dtype="int8", value_dtype="float8_e4m3", max_size=6,
                           num_sink_tokens=1, enable_prefix_caching=True, num_q_heads=4)
    driver = Driver(manager)
    # add, add, decode, fork, decode, swap, add, free, batched decode
    history = [(0, 5, 6), (0, 5, 7), (2, 0, 0), (4, 1, 0), (2, 1, 0), (7, 0, 0), (0, 9, 3), (5, 2, 0),
               (3, 0, 2)]
    for op in history:
        driver.apply(op)
    assert manager.metrics().num_swapped == 1 and manager.metrics().num_cached_blocks > 0
    path = str(tmp_path_factory.mktemp("snapshots") / "valid.safetensors")
    snapshot.save(manager, path)
    with open(path, "rb") as handle:
        return path, handle.read()


def refused(data: bytes, folder: str, match: str | None = None) -> SnapshotError:
    path = os.path.join(folder, "bad.safetensors")
    with open(path, "wb") as handle:
        handle.write(data)
    with pytest.raises(SnapshotError, match=match) as caught:
        snapshot.load(path)
    return caught.value


def test_the_valid_snapshot_loads(valid: tuple[str, bytes]) -> None:
    loaded = snapshot.load(valid[0])
    assert isinstance(loaded, KVCacheManager)
    loaded.check_invariants()


def test_truncated_files_are_refused_at_every_offset(valid: tuple[str, bytes], tmp_path: Any) -> None:
    data = valid[1]
    (header_size,) = struct.unpack("<Q", data[:8])
    offsets = set(range(0, 24)) | set(range(8 + header_size - 8, 8 + header_size + 8))
    offsets |= set(random.Random(0).sample(range(len(data)), 60))
    for offset in sorted(offsets):
        refused(data[:offset], str(tmp_path))
    refused(data + b"\0", str(tmp_path), "payload bytes")  # and one byte too many


def test_every_flipped_byte_is_refused(valid: tuple[str, bytes], tmp_path: Any) -> None:
    data = valid[1]
    (header_size,) = struct.unpack("<Q", data[:8])
    chooser = random.Random(1)
    header = list(range(8)) + chooser.sample(range(8, 8 + header_size), min(200, header_size))
    payload = chooser.sample(range(8 + header_size, len(data)), 100)
    for position in header + payload:
        damaged = bytearray(data)
        damaged[position] ^= 1 << chooser.randrange(8)
        error = refused(bytes(damaged), str(tmp_path))
        if position >= 8 + header_size:
            assert "checksum" in str(error)


def resigned(valid: tuple[str, bytes], folder: str, edit: Any, *, version: int = snapshot.VERSION,
             tensors_edit: Any = None) -> str:
    """A copy of the valid snapshot with its state edited and a correct checksum."""
    metadata, tensors = snapshot_format._read(valid[0])
    state = json.loads(metadata["state"])
    edit(state)
    tensors = {name: np.array(array) for name, array in tensors.items()}
    if tensors_edit is not None:
        tensors_edit(tensors)
    path = os.path.join(folder, "resigned.safetensors")
    snapshot_format._write(path, state, tensors, version=version)
    return path


def load_refused(path: str, match: str) -> None:
    with pytest.raises(SnapshotError, match=match):
        snapshot.load(path)


def test_a_resigned_but_unchanged_snapshot_loads(valid: tuple[str, bytes], tmp_path: Any) -> None:
    assert isinstance(snapshot.load(resigned(valid, str(tmp_path), lambda state: None)), KVCacheManager)


def test_another_version_is_refused(valid: tuple[str, bytes], tmp_path: Any) -> None:
    load_refused(resigned(valid, str(tmp_path), lambda s: None, version=2), "version '2'.*reads version 1")


def first_running(state: dict[str, Any]) -> dict[str, Any]:
    sequences = state["manager"]["sequences"]
    return next(s for s in sequences if s["state"] == "running" and s["table"]["window_ids"])


EDITS = {
    "a wrong configured dtype": (lambda s: s["pools"]["device"]["config"].update(dtype="float16"), "dtype"),
    "an unknown storage dtype": (
        lambda s: s["pools"]["host"]["config"].update(key_dtype="int4"), "key_dtype"),
    "a block id out of range": (
        lambda s: first_running(s)["table"]["window_ids"].__setitem__(0, 24), "outside|24"),
    "a negative block id": (lambda s: first_running(s)["table"]["window_ids"].__setitem__(0, -1), "-1"),
    "an inconsistent ref count": (
        lambda s: s["pools"]["device"]["allocator"]["used"][0].__setitem__(1, 7), "inconsistent ref counts"),
    "a table longer than its tokens": (
        lambda s: first_running(s)["table"].update(num_tokens=1), "inconsistent"),
    "10**12 blocks": (lambda s: s["pools"]["device"]["config"].update(num_blocks=10**12), "more than the"),
    "a head_dim of 10**9": (lambda s: s["pools"]["device"]["config"].update(head_dim=10**9), "more than the"),
    "a free run past the pool": (
        lambda s: s["pools"]["device"]["allocator"]["free_runs"].append([23, 5]), "free_runs"),
    "a duplicate sequence id": (
        lambda s: s["manager"]["sequences"].append(s["manager"]["sequences"][0]), "twice|inconsistent"),
    "written counts past the table": (lambda s: first_running(s).update(num_written=[99, 99]), "num_written"),
    "a prefix key of the wrong size": (
        lambda s: s["manager"]["prefix"]["keys"][0].__setitem__(1, "00ff"), "key"),
    "a key on the wrong block": (
        lambda s: s["manager"]["prefix"]["keys"][0].__setitem__(
            0, s["pools"]["device"]["allocator"]["free_runs"][0][0]),
        "inconsistent|cached"),
    "a smaller recorded largest key": (lambda s: s["manager"].update(max_abs_key=[0.001, 0.001]), "largest"),
    "a bool where an int belongs": (lambda s: s["manager"].update(num_sink_tokens=True), "num_sink_tokens"),
    "a missing field": (lambda s: s["manager"].pop("counters"), "counters"),
    "an unknown kind": (lambda s: s.update(kind="Pickle"), "kind"),
    "a swapped sequence without its host pool": (lambda s: s["pools"].pop("host"), "host"),
}


def test_a_recorded_largest_key_below_a_negative_int8_key_is_refused(tmp_path: Any) -> None:
    # int8 keys, one group [-8, 0.5]: codes [-127, 8]. The pages' largest |key|
    # (8) is a negative code; a recorded bound of 1.0 is above every positive
    # key (0.5) but below it, so the load must refuse it.
    manager = make_manager(4, block_size=2, head_dim=2, key_dtype="int8")
    manager.add_sequence("a")
    batch = manager.reserve({"a": 1})
    manager.write(0, batch, np.array([[[-8.0, 0.5]]]), np.ones((1, 1, 2)))
    path = str(tmp_path / "negative.safetensors")
    snapshot.save(manager, path)
    assert isinstance(snapshot.load(path), KVCacheManager)  # as saved, it loads
    lowered = resigned((path, b""), str(tmp_path), lambda s: s["manager"].update(max_abs_key=[1.0]))
    load_refused(lowered, "holds keys up to 8 but the snapshot records a largest")


@pytest.mark.parametrize("what", sorted(EDITS))
def test_inconsistent_states_are_refused_despite_a_valid_checksum(
    valid: tuple[str, bytes], tmp_path: Any, what: str
) -> None:
    edit, match = EDITS[what]
    load_refused(resigned(valid, str(tmp_path), edit), match)


def test_pages_that_disagree_with_the_configuration_are_refused(
    valid: tuple[str, bytes], tmp_path: Any
) -> None:
    folder = str(tmp_path)

    def retype(tensors: dict[str, np.ndarray]) -> None:
        tensors["device.key_scales.0"] = tensors["device.key_scales.0"].astype(np.float64)

    load_refused(resigned(valid, folder, lambda s: None, tensors_edit=retype), "dtype float64")

    def reshape(tensors: dict[str, np.ndarray]) -> None:
        tensors["host.values.1"] = tensors["host.values.1"][:, :-1]

    load_refused(resigned(valid, folder, lambda s: None, tensors_edit=reshape), "shape")

    def drop(tensors: dict[str, np.ndarray]) -> None:
        del tensors["device.value_scales.1"]

    load_refused(resigned(valid, folder, lambda s: None, tensors_edit=drop), "missing")

    def nan_codes(tensors: dict[str, np.ndarray]) -> None:
        tensors["device.values.0"].reshape(-1)[3] = 0x7F  # NaN in float8_e4m3fn

    load_refused(resigned(valid, folder, lambda s: None, tensors_edit=nan_codes), "NaN")

    def huge_keys(tensors: dict[str, np.ndarray]) -> None:
        tensors["device.key_scales.0"][...] *= 1e6

    load_refused(resigned(valid, folder, lambda s: None, tensors_edit=huge_keys), "largest")


def test_a_header_declaring_absurd_tensor_sizes_is_refused_before_reading(tmp_path: Any) -> None:
    header = json.dumps({
        "__metadata__": {"format": snapshot.FORMAT, "version": "1", "state": "{}", "checksum": "x"},
        "device.keys.0": {"dtype": "F32", "shape": [10**12, 16, 8, 128], "data_offsets": [0, 2**62]},
    }).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 64
    refused(data, str(tmp_path), "cannot be true")
    refused(struct.pack("<Q", 10**12) + b"{}", str(tmp_path), "header")
    refused(b"not a snapshot at all", str(tmp_path))
    refused(struct.pack("<Q", 2) + b"{}", str(tmp_path), "not a pagedkv snapshot")


def test_a_failed_load_leaves_the_target_pool_untouched(tmp_path: Any) -> None:
    pool = KVPool(8, block_size=2, head_dim=2, key_dtype="int8")
    mine = KVCache(pool=pool)
    for i in range(5):
        mine.attend([1.0, 0.5], [0.5, float(i)], [float(i), 1.0])
    path = str(tmp_path / "c.safetensors")
    snapshot.save(mine, path)
    before = (pool.allocator.free_block_ids(), pool.keys(0).copy(), pool.key_scales(0).copy(), mine.block_ids)
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    data[-3] ^= 0xFF
    with open(path, "wb") as handle:
        handle.write(data)
    with pytest.raises(SnapshotError, match="checksum"):
        snapshot.load(path, pool=pool)
    assert pool.allocator.free_block_ids() == before[0] and mine.block_ids == before[3]
    assert np.array_equal(pool.keys(0), before[1]) and np.array_equal(pool.key_scales(0), before[2])
    pool.check_invariants()


def test_snapshot_errors_are_paged_kv_and_value_errors() -> None:
    assert issubclass(SnapshotError, PagedKVError) and issubclass(SnapshotError, ValueError)
