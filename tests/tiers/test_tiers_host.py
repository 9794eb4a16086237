"""The host tier's slots and policies, hand-built, and the worker that loads off the step."""

from __future__ import annotations

import threading

import pytest

from pagedkv.errors import ConfigError
from pagedkv.tiers.codec import BlockLayout
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.tiered import TieredStore
from pagedkv.tiers.worker import TierWorker

LAYOUT = BlockLayout("m", 4, 1, 2, 1, "float32", None, None, 0, 2)


def test_lru_evicts_the_least_recently_read() -> None:
    host = HostTier(block_nbytes=2, num_blocks=2, policy="lru")
    host.put(b"a", b"aa")
    host.put(b"b", b"bb")
    host.get(b"a")  # order, oldest first: b a
    assert host.put(b"c", b"cc") == [(b"b", b"bb")]
    host.check_invariants()


def test_s3fifo_drops_a_block_read_once_before_one_read_again() -> None:
    # 10 slots: small queue of 1. "hot" is read, then a scan of blocks read never.
    host = HostTier(block_nbytes=2, num_blocks=10, policy="s3fifo")
    host.put(b"hot", b"hh")
    host.get(b"hot")
    for i in range(30):
        host.put(b"scan%d" % i, b"ss")
        host.check_invariants()
    assert b"hot" in host  # LRU would have dropped it after 10 new blocks
    lru = HostTier(block_nbytes=2, num_blocks=10, policy="lru")
    lru.put(b"hot", b"hh")
    lru.get(b"hot")
    for i in range(30):
        lru.put(b"scan%d" % i, b"ss")
    assert b"hot" not in lru


def test_a_deleted_key_frees_its_slot_and_a_key_held_keeps_its_bytes() -> None:
    host = HostTier(block_nbytes=2, num_blocks=1, policy="s3fifo")
    host.put(b"a", b"aa")
    assert host.put(b"a", b"zz") == [] and host.get(b"a") == b"aa"
    host.delete(b"a")
    assert host.put(b"b", b"bb") == [] and len(host) == 1
    host.check_invariants()


def test_a_host_tier_refuses_an_unknown_policy_and_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(ConfigError, match="policy must be one of"):
        HostTier(block_nbytes=2, num_blocks=1, policy="arc")
    host = HostTier(block_nbytes=2, num_blocks=1)
    with pytest.raises(ConfigError, match="3 bytes, expected 2"):
        host.put(b"a", b"abc")
    assert len(host) == 0
    host.check_invariants()


def test_a_tiered_store_needs_a_tier_and_a_known_write_policy() -> None:
    with pytest.raises(ConfigError, match="needs a host tier, a store"):
        TieredStore(LAYOUT)
    with pytest.raises(ConfigError, match="write_policy"):
        TieredStore(LAYOUT, host=HostTier(block_nbytes=2, num_blocks=1), write_policy="never")


def test_the_host_tier_reports_stored_and_removed_events_with_its_medium() -> None:
    tiers = TieredStore(LAYOUT, host=HostTier(block_nbytes=2, num_blocks=1))
    tiers.offer(b"a", b"aa")
    tiers.offer(b"b", b"bb")
    events = [(type(e).__name__, e.block_hashes, e.medium) for e in tiers.drain_events()]  # type: ignore[union-attr]
    # one slot: "b" pushes "a" out
    assert events == [
        ("BlockStored", [b"a"], "CPU"), ("BlockStored", [b"b"], "CPU"), ("BlockRemoved", [b"a"], "CPU"),
    ]


class _Failing:
    medium = "BROKEN"

    def __init__(self) -> None:
        self.release = threading.Event()

    def put(self, key: bytes, value: bytes) -> None: ...

    def exists(self, key: bytes) -> bool:
        return False

    def delete(self, key: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None:
        self.release.wait(10)
        raise RuntimeError("a backend bug, not a StoreError")


def test_a_load_that_fails_or_is_cancelled_gives_no_blocks_and_is_counted() -> None:
    failing = _Failing()
    with TierWorker(TieredStore(LAYOUT, stores=[failing])) as worker:
        first = worker.load([b"k"])     # runs, and blocks in get until released
        second = worker.load([b"j"])    # queued behind it: still cancellable
        assert second.cancel()
        assert second.payloads() == []
        failing.release.set()
        assert first.payloads(timeout_s=10) == []
        assert worker.num_failed_loads == 2


def test_a_load_off_the_step_returns_the_leading_run() -> None:
    tiers = TieredStore(LAYOUT, host=HostTier(block_nbytes=2, num_blocks=4))
    with TierWorker(tiers) as worker:
        worker.offer(b"k0", b"ab")
        worker.offer(b"k1", b"cd")
        worker.flush()
        assert worker.load([b"k0", b"k1", b"k2", b"k0"]).payloads(timeout_s=10) == [b"ab", b"cd"]
        assert worker.num_failed_loads == 0
