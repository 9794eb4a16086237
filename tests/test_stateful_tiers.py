"""A state machine over the tiers (host, a flaky in-memory store, a bounded file store) against a dict oracle.

Two tenants (layouts that differ only in ``model_id``) share the same stores. The
oracle is the dumbest one possible: a block's payload is a function of its tenant and
prefix key, so any block a tier returns must equal it; the machine also pins
what must hit (a block just offered is in the host tier; a block the events say
reached the store is there while the store is up).
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import pagedkv.tiers.tiered as tiered_module
from pagedkv.prefix.events import BlockStored
from pagedkv.tiers.codec import HEADER_SIZE, BlockLayout, store_key
from pagedkv.tiers.host import HOST_POLICIES, HostTier
from pagedkv.tiers.store import FileStore, StoreError
from pagedkv.tiers.tiered import WRITE_POLICIES, TieredStore

NBYTES = 16
TENANTS = ("tenant-a", "tenant-b")
KEYS = [bytes([i]) * 4 for i in range(6)]


def payload_of(tenant: str, prefix_key: bytes) -> bytes:
    """What block ``prefix_key`` of ``tenant`` holds: the oracle."""
    return hashlib.blake2b(tenant.encode() + prefix_key, digest_size=NBYTES).digest()


class MemoryStore:
    """A dict as a store, which an injected failure takes down (every call raises ``StoreError``)."""

    medium = "MEMORY"

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreError("memory store is down (injected)")

    def put(self, key: bytes, value: bytes) -> None:
        self._check()
        self.values[key] = value

    def get(self, key: bytes) -> bytes | None:
        self._check()
        return self.values.get(key)

    def exists(self, key: bytes) -> bool:
        self._check()
        return key in self.values

    def delete(self, key: bytes) -> None:
        self._check()
        self.values.pop(key, None)


class TiersMachine(RuleBasedStateMachine):
    """Two tenants' ``TieredStore`` over shared stores; every block returned is checked against the oracle."""

    #: Host tier sizes drawn from (0: no host tier).
    HOST_SIZES = (0, 1, 2, 3)

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.memory = MemoryStore()
        self.tiers: dict[str, TieredStore] = {}
        # Keys whose value the events say reached the memory store, per tenant, not damaged since.
        self.in_memory: dict[str, set[bytes]] = {tenant: set() for tenant in TENANTS}

    def teardown(self) -> None:
        self.directory.cleanup()

    @initialize(
        host_size=st.sampled_from(HOST_SIZES), policy=st.sampled_from(HOST_POLICIES),
        write_policy=st.sampled_from(WRITE_POLICIES), file_values=st.integers(1, 4),
    )
    def configure(self, host_size: int, policy: str, write_policy: str, file_values: int) -> None:
        note(f"host {host_size} ({policy}), {write_policy}, file store of {file_values} values")
        value_size = HEADER_SIZE + 4 + 16 + NBYTES
        files = FileStore(Path(self.directory.name), max_bytes=file_values * value_size)
        for tenant in TENANTS:
            layout = BlockLayout(tenant, 4, 1, 2, 1, "float32", None, None, 0, NBYTES)
            host = HostTier(block_nbytes=NBYTES, num_blocks=host_size, policy=policy) if host_size else None
            self.tiers[tenant] = TieredStore(layout, host=host, stores=[self.memory, files],
                                             write_policy=write_policy, max_events=1000)
        self.files = files

    def _sync_events(self, tenant: str) -> None:
        for event in self.tiers[tenant].drain_events():
            if isinstance(event, BlockStored) and event.medium == MemoryStore.medium:
                self.in_memory[tenant].update(event.block_hashes)

    def _check_run(self, tenant: str, keys: list[bytes], payloads: list[bytes]) -> None:
        assert len(payloads) <= len(keys)
        for prefix_key, payload in zip(keys, payloads):
            assert payload == payload_of(tenant, prefix_key), f"{tenant}: wrong block for {prefix_key!r}"

    @rule(tenant=st.sampled_from(TENANTS), index=st.integers(0, len(KEYS) - 1))
    def offer(self, tenant: str, index: int) -> None:
        """The device evicts a block: it is in the host tier right after (when there is one)."""
        tiers, prefix_key = self.tiers[tenant], KEYS[index]
        tiers.offer(prefix_key, payload_of(tenant, prefix_key))
        self._sync_events(tenant)
        if tiers.host is not None:
            assert prefix_key in tiers.host
            assert tiers.fetch([prefix_key]) == [payload_of(tenant, prefix_key)]

    @rule(tenant=st.sampled_from(TENANTS), index=st.integers(0, len(KEYS) - 1))
    def write_through(self, tenant: str, index: int) -> None:
        tiers, prefix_key = self.tiers[tenant], KEYS[index]
        tiers.write_through(prefix_key, payload_of(tenant, prefix_key))
        self._sync_events(tenant)

    @rule(tenant=st.sampled_from(TENANTS), start=st.integers(0, len(KEYS) - 1), length=st.integers(1, 4))
    def fetch(self, tenant: str, start: int, length: int) -> None:
        """A prompt's keys: whatever comes back is right, and a block the memory store holds is a hit."""
        keys = KEYS[start : start + length]
        tiers = self.tiers[tenant]
        payloads = tiers.fetch(keys)
        note(f"fetch {tenant} {[k[:1].hex() for k in keys]} -> {len(payloads)} blocks")
        self._check_run(tenant, keys, payloads)
        if not self.memory.down and keys[0] in self.in_memory[tenant]:
            assert payloads, f"{tenant}: block {keys[0]!r} is in the memory store, yet fetch missed it"
        self._sync_events(tenant)

    @rule(tenant=st.sampled_from(TENANTS), start=st.integers(0, len(KEYS) - 1))
    def find(self, tenant: str, start: int) -> None:
        mediums = self.tiers[tenant].find(KEYS[start:])
        assert set(mediums) <= {"CPU", MemoryStore.medium, "DISK"}

    @rule(down=st.booleans())
    def inject_store_failure(self, down: bool) -> None:
        note(f"memory store {'down' if down else 'up'}")
        self.memory.down = down

    @rule(tenant=st.sampled_from(TENANTS), index=st.integers(0, len(KEYS) - 1), at=st.integers(0, 200))
    def damage_a_stored_value(self, tenant: str, index: int, at: int) -> None:
        """Flip one byte of a value in the memory store (a hostile or broken store)."""
        key = store_key(self.tiers[tenant].layout, KEYS[index])
        value = self.memory.values.get(key)
        if value is None:
            return
        at %= len(value)
        self.memory.values[key] = value[:at] + bytes([value[at] ^ 0xFF]) + value[at + 1 :]
        for other in TENANTS:
            self.in_memory[other].discard(KEYS[index])

    @rule(tenant=st.sampled_from(TENANTS), start=st.integers(0, len(KEYS) - 1))
    def concurrent_readers(self, tenant: str, start: int) -> None:
        keys = KEYS[start:]
        results: list[list[bytes]] = []
        tiers = self.tiers[tenant]
        threads = [threading.Thread(target=lambda: results.append(tiers.fetch(keys))) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results) == 3
        for payloads in results:
            self._check_run(tenant, keys, payloads)
        self._sync_events(tenant)

    @invariant()
    def each_part_holds_its_invariants(self) -> None:
        for tiers in self.tiers.values():
            tiers.check_invariants()
        if self.tiers:
            self.files.check_invariants()


TestTiersMachine = TiersMachine.TestCase


def test_the_machine_catches_a_store_key_without_the_layout_when_values_go_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted bug: keys that forget the tenant's layout, and a reader that trusts whatever it gets.

    Either defence alone holds (the header check refuses the other tenant's
    value); without both, one tenant reads the other's pages, and the machine
    must say so.
    """

    def key_without_layout(layout: BlockLayout, prefix_key: bytes) -> bytes:
        return b"stale/" + prefix_key.hex().encode()

    def decode_unchecked(layout: BlockLayout, prefix_key: bytes, value: bytes) -> memoryview:
        return memoryview(value)[-layout.block_nbytes :]

    monkeypatch.setattr(tiered_module, "store_key", key_without_layout)
    monkeypatch.setattr(tiered_module, "decode_block", decode_unchecked)

    class NoHost(TiersMachine):
        HOST_SIZES = (0,)

    with pytest.raises(AssertionError, match="wrong block"):
        run_state_machine_as_test(NoHost, settings=settings(max_examples=200, stateful_step_count=20))


def test_a_key_without_the_layout_alone_is_refused_by_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiered_module, "store_key", lambda layout, prefix_key: b"stale/" + prefix_key)
    memory = MemoryStore()
    a, b = (TieredStore(BlockLayout(t, 4, 1, 2, 1, "float32", None, None, 0, NBYTES), stores=[memory])
            for t in TENANTS)
    a.offer(KEYS[0], payload_of("tenant-a", KEYS[0]))
    assert b.fetch([KEYS[0]]) == [] and b.num_refused == 1
    assert a.fetch([KEYS[0]]) == [payload_of("tenant-a", KEYS[0])]
