"""The store backends: files (atomic, bounded) and a real Redis on loopback (down or killed: a miss)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.redis_server import redis_server

from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.tiers.codec import BlockLayout, encode_block, store_key
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.store import FileStore, KVStore, RedisStore, StoreError
from pagedkv.tiers.tiered import TieredStore

LAYOUT = BlockLayout("model-a", 4, 1, 2, 1, "float32", None, None, 0, 8)


# ---------------------------------------------------------------- files

def test_a_file_store_is_a_kv_store_and_round_trips(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=100)
    assert isinstance(store, KVStore)
    store.put(b"a", b"one")
    assert store.get(b"a") == b"one" and store.exists(b"a")
    store.put(b"a", b"two!")  # replaced: 4 bytes held, not 7
    assert store.get(b"a") == b"two!" and store.num_bytes == 4
    store.delete(b"a")
    assert store.get(b"a") is None and not store.exists(b"a") and store.num_bytes == 0
    store.check_invariants()


def test_a_file_store_evicts_the_oldest_past_its_bound_and_refuses_a_larger_value(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=10)
    for key in (b"a", b"b", b"c"):
        store.put(key, b"1234")
    # 12 > 10: "a", the oldest, went to make room for "c"
    assert [store.get(key) for key in (b"a", b"b", b"c")] == [None, b"1234", b"1234"]
    store.put(b"huge", b"x" * 11)
    assert store.get(b"huge") is None and store.num_refused == 1 and store.num_evictions == 1
    store.check_invariants()


def test_a_half_written_file_is_never_read_and_a_reopen_removes_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=100)
    store.put(b"a", b"done")
    (tmp_path / ".tmp-crashed").write_bytes(b"half")  # a writer killed before its rename
    reopened = FileStore(tmp_path, max_bytes=100)
    assert reopened.get(b"a") == b"done" and reopened.num_bytes == 4
    assert sorted(os.listdir(tmp_path)) == [FileStore._name(b"a")]


def test_a_truncated_value_in_a_file_is_a_counted_miss_not_a_wrong_block(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=1000)
    tiers = TieredStore(LAYOUT, stores=[store])
    tiers.offer(b"k", b"8 bytes!")
    path = tmp_path / FileStore._name(store_key(LAYOUT, b"k"))
    path.write_bytes(path.read_bytes()[:-3])  # e.g. a copy cut short
    assert tiers.fetch([b"k"]) == [] and tiers.num_refused == 1 and tiers.num_misses == 1


def test_an_unwritable_directory_raises_a_store_error_that_the_tiers_count(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "d", max_bytes=1000)
    (tmp_path / "d").rmdir()  # gone: every write fails
    with pytest.raises(StoreError, match="cannot write") as caught:
        store.put(b"k", b"v")
    assert isinstance(caught.value, PagedKVError) and isinstance(caught.value, OSError)
    assert store.num_bytes == 0
    tiers = TieredStore(LAYOUT, stores=[store])
    tiers.offer(b"k", b"8 bytes!")
    assert tiers.num_store_errors == 1 and tiers.fetch([b"k"]) == []


def test_a_file_store_refuses_a_bound_below_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        FileStore(tmp_path, max_bytes=0)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- Redis

def test_a_redis_store_round_trips_over_a_real_server() -> None:
    with redis_server() as server:
        store = RedisStore(port=server.port, timeout_s=2)
        assert isinstance(store, KVStore)
        store.put(b"a", b"\x00value\xff")
        assert store.get(b"a") == b"\x00value\xff" and store.exists(b"a")
        store.delete(b"a")
        assert store.get(b"a") is None and not store.exists(b"a")
        assert store.num_errors == 0
        store.close()


def test_a_killed_redis_server_gives_a_counted_error_and_a_miss_not_a_hang() -> None:
    with redis_server() as server:
        store = RedisStore(port=server.port, timeout_s=0.5, retry_after_s=60)
        tiers = TieredStore(LAYOUT, host=HostTier(block_nbytes=8, num_blocks=1), stores=[store])
        tiers.offer(b"k0", b"block k0")
        tiers.offer(b"k1", b"block k1")  # the host holds one block: k0 spills to Redis
        assert tiers.num_spilled == 1 and store.get(store_key(LAYOUT, b"k0")) is not None
        server.stop()  # killed mid-run
        assert tiers.fetch([b"k0", b"k1"]) == []  # k0 was only in Redis: recompute from the first block
        assert tiers.num_store_errors == 1 and store.num_errors == 1 and tiers.num_misses == 1
        assert tiers.find([b"k0"]) == [] and store.num_skipped == 1  # down: no second timeout
        assert tiers.fetch([b"k1"]) == [b"block k1"]  # the host tier still serves


def test_a_redis_server_that_is_not_there_raises_a_store_error_within_its_timeout() -> None:
    pytest.importorskip("redis")
    with redis_server() as server:
        port = server.port
    store = RedisStore(port=port, timeout_s=0.2)
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}: get failed"):
        store.get(b"k")
    with pytest.raises(StoreError, match="is down"):
        store.get(b"k")
    assert (store.num_errors, store.num_skipped) == (1, 1)


def test_a_redis_value_of_another_layout_under_our_key_is_refused() -> None:
    with redis_server() as server:
        store = RedisStore(port=server.port, timeout_s=2)
        other = BlockLayout("model-b", 4, 1, 2, 1, "float32", None, None, 0, 8)
        store.put(store_key(LAYOUT, b"k"), encode_block(other, b"k", b"8 bytes!"))
        tiers = TieredStore(LAYOUT, stores=[store])
        assert tiers.fetch([b"k"]) == [] and tiers.num_refused == 1


def test_a_redis_store_refuses_a_timeout_that_is_not_positive() -> None:
    pytest.importorskip("redis")
    with pytest.raises(ConfigError, match="timeout_s"):
        RedisStore(timeout_s=0)
