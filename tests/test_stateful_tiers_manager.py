"""A state machine over a manager with tiers: a tiny pool, prefix caching, a host tier and a flaky store.

The oracle: a token's k/v are a function of its whole prefix (as a model's
are), so whatever a hit hands back, from the device, the host, the store or a
prefetch, must be bit for bit what computing the prompt writes. After each
admission the machine reads the sequence's blocks from the pool and compares
them with that function, and compares ``attend`` with a manager without
prefix caching or tiers fed the same tokens; every payload a prefetch returns
is compared with the function too. The store can be switched down (every call
fails) or to damage the values it returns (a flipped byte in the payload).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv.tiers.tiered as tiered_module
from pagedkv import KVCacheManager, KVPool
from pagedkv.errors import PoolExhaustedError
from pagedkv.prefix.cache import ROOT_KEY, block_keys, hash_function, token_bytes
from pagedkv.tiers import BlockLayout, HostTier, PendingLoad, RefusedValueError, StoreError, TieredStore
from pagedkv.tiers.codec import decode_block

NUM_KV_HEADS, HEAD_DIM = 1, 2
BASES = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
#: Prompts that share prefixes, so hits recur: each base cut at a few lengths.
PROMPTS = [base[:n] for base in BASES for n in (3, 5, 7, 10)]
MAX_SEQS = 3


def kv_of(tokens: list[int], positions: np.ndarray, layer: int) -> tuple[np.ndarray, ...]:
    """k, v, q at ``positions``: each a function of the tokens up to and including its position."""
    prefix_hash, hashes = 0, []
    for token in tokens[: int(positions.max()) + 1] if len(positions) else []:
        prefix_hash = (prefix_hash * 131 + token + 1) % 1_000_003
        hashes.append(prefix_hash)
    h = np.asarray(hashes, np.float64)[positions]
    grid = h[:, None, None] * 1e-3 + layer + np.arange(HEAD_DIM)[None, None, :] * 0.25  # (n, 1, head_dim)
    grid = np.broadcast_to(grid, (len(positions), NUM_KV_HEADS, HEAD_DIM))
    return tuple(x.astype(np.float32) for x in (np.sin(grid), np.cos(grid), np.sin(2 * grid)))


class FlakyStore:
    """A dict as a store: ``"up"``, ``"down"`` (calls fail) or ``"damaging"`` (gets flip a payload byte)."""

    medium = "MEMORY"

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.mode = "up"

    def _check(self) -> None:
        if self.mode == "down":
            raise StoreError("flaky store is down (injected)")

    def put(self, key: bytes, value: bytes) -> None:
        self._check()
        self.values[key] = value

    def get(self, key: bytes) -> bytes | None:
        self._check()
        value = self.values.get(key)
        if value is None or self.mode != "damaging":
            return value
        return value[:-1] + bytes([value[-1] ^ 0x01])   # the last payload byte

    def exists(self, key: bytes) -> bool:
        self._check()
        return key in self.values

    def delete(self, key: bytes) -> None:
        self._check()
        self.values.pop(key, None)


class TieredManagerMachine(RuleBasedStateMachine):
    """Drives a tiered, prefix-caching manager; every hit is checked against recomputing it."""

    seqs = Bundle("seqs")
    prefetches = Bundle("prefetches")

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager
        #: Per live sequence: the tokens it holds (every layer written).
        self.tokens: dict[Hashable, list[int]] = {}
        self.next_id = 0

    @initialize(
        block_size=st.integers(1, 2), num_blocks=st.integers(4, 8), num_layers=st.integers(1, 2),
        host_size=st.integers(0, 3), policy=st.sampled_from(["lru", "s3fifo"]),
        write_policy=st.sampled_from(["write_back", "write_through"]),
    )
    def setup(self, block_size: int, num_blocks: int, num_layers: int, host_size: int, policy: str,
              write_policy: str) -> None:
        note(f"block_size={block_size} num_blocks={num_blocks} layers={num_layers} "
             f"host={host_size} ({policy}) {write_policy}")
        self.block_size, self.num_layers = block_size, num_layers
        pool = KVPool(num_blocks, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                      num_layers=num_layers, dtype=np.float32)
        layout = BlockLayout.of_pool(pool, "machine-model")
        nbytes = layout.block_nbytes
        host = HostTier(block_nbytes=nbytes, num_blocks=host_size, policy=policy) if host_size else None
        self.store = FlakyStore()
        self.tiers = TieredStore(layout, host=host, stores=[self.store], write_policy=write_policy)
        self.manager = KVCacheManager(pool, enable_prefix_caching=True, tiers=self.tiers)

    def teardown(self) -> None:
        tiering = getattr(getattr(self, "manager", None), "tiering", None)
        if tiering is not None and tiering.worker is not None:
            tiering.worker.close()

    # ------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _expected_payload(self, prompt: list[int], block: int) -> bytes:
        """The bytes a tier must hold for ``prompt``'s block ``block``: every layer's k, then v."""
        bs = self.block_size
        positions = np.arange(block * bs, (block + 1) * bs)
        parts = []
        for layer in range(self.num_layers):
            k, v, _ = kv_of(prompt, positions, layer)
            parts += [k.tobytes(), v.tobytes()]
        return b"".join(parts)

    def _admit(self, prompt: list[int], prefetched: PendingLoad | None) -> tuple[str, int] | None:
        """Admit ``prompt``, compute past its hit, check the KV and the outputs; None if it did not fit."""
        manager = self.manager
        seq_id = self._new_id()
        tier_hits = dict(self.tiers.num_hits)
        num_tier_tokens = manager.metrics().num_tier_hits
        num_hit = manager.add_sequence(seq_id, prompt, prefetched=prefetched)
        note(f"admit {seq_id} {prompt} -> hit {num_hit}")
        if manager.metrics().num_tier_hits > num_tier_tokens:
            event(f"a hit loaded {'by a prefetch' if prefetched else 'synchronously'}")
        for medium, count in self.tiers.num_hits.items():
            if count > tier_hits.get(medium, 0):
                event(f"a tier hit from {medium}")
        assert num_hit % self.block_size == 0 and num_hit < len(prompt)
        self._check_kv(seq_id, prompt, num_hit, "the hit")
        try:
            batch = manager.reserve({seq_id: prompt[num_hit:]})
        except PoolExhaustedError:
            note(f"{seq_id} does not fit: freed")
            manager.free(seq_id)
            return None
        positions = np.arange(num_hit, len(prompt))
        outputs = []
        for layer in range(self.num_layers):
            k, v, q = kv_of(prompt, positions, layer)
            manager.write(layer, batch, k, v)
            outputs.append(manager.attend(layer, batch, q))
        for got, want in zip(outputs, self._recomputed(prompt, num_hit), strict=True):
            assert np.array_equal(got, want), f"{seq_id}: wrong KV: attend differs from recomputing {prompt}"
        self.tokens[seq_id] = list(prompt)
        return seq_id, num_hit

    def _check_kv(self, seq_id: str, tokens: list[int], num_tokens: int, what: str) -> None:
        """The pool holds, for ``seq_id``'s first ``num_tokens`` tokens, what computing them writes."""
        if not num_tokens:
            return
        table = self.manager.block_table(seq_id)
        bs = self.block_size
        positions = np.arange(num_tokens)
        for layer in range(self.num_layers):
            k, v, _ = kv_of(tokens, positions, layer)
            pool = self.manager.pool
            got_k = np.concatenate([pool.key_pages(layer)[b] for b in table.block_ids])[:num_tokens]
            got_v = np.concatenate([pool.value_pages(layer)[b] for b in table.block_ids])[:num_tokens]
            assert np.array_equal(got_k, k) and np.array_equal(got_v, v), (
                f"{seq_id}: wrong KV in {what} (layer {layer}, blocks {table.block_ids}, block_size {bs})"
            )

    def _recomputed(self, prompt: list[int], num_hit: int) -> list[Any]:
        """``attend`` outputs of a manager without prefix caching or tiers that wrote the same tokens."""
        bs = self.block_size
        reference = KVCacheManager(KVPool(-(-len(prompt) // bs), block_size=bs, num_kv_heads=NUM_KV_HEADS,
                                          head_dim=HEAD_DIM, num_layers=self.num_layers, dtype=np.float32))
        reference.add_sequence("r")
        for start, end, attend in ((0, num_hit, False), (num_hit, len(prompt), True)):
            if start == end:
                continue
            batch = reference.reserve({"r": end - start})
            outputs = []
            for layer in range(self.num_layers):
                k, v, q = kv_of(prompt, np.arange(start, end), layer)
                reference.write(layer, batch, k, v)
                if attend:
                    outputs.append(reference.attend(layer, batch, q))
        return outputs

    def _check_payloads(self, prompt: list[int], load: PendingLoad) -> None:
        """Every payload ``load`` hands out is the oracle's bytes for the block its key names."""
        keys = block_keys(ROOT_KEY, token_bytes(prompt), self.block_size, b"", hash_function("sha256"))
        for key, payload in zip(load.keys, load.take(load.keys)):
            block = keys.index(key)
            assert payload == self._expected_payload(prompt, block), f"wrong KV: a prefetched block {block}"

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(target=seqs, prompt=st.sampled_from(PROMPTS))
    def admit(self, prompt: list[int]) -> Any:
        """Admit synchronously: the tiers are asked and loaded under the pool's lock."""
        plan = self.manager.lookup(prompt)
        admitted = self._admit(prompt, None)
        if admitted is None:
            return consumes_nothing()
        num_device = plan.num_shared_blocks * self.block_size
        assert num_device <= admitted[1] <= plan.num_cached_tokens
        return admitted[0]

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(target=seqs, prompt=st.sampled_from(PROMPTS), cancel=st.booleans())
    def prefetch_then_admit(self, prompt: list[int], cancel: bool) -> Any:
        """Prefetch off the step, then admit from it (or cancel it first: the tiers' part is computed)."""
        manager = self.manager
        load = manager.prefetch(prompt)
        assert load.wait(timeout_s=30)
        self._check_payloads(prompt, load)
        if cancel:
            load.cancel()
        num_device = manager.lookup(prompt).num_shared_blocks * self.block_size
        admitted = self._admit(prompt, load)
        if admitted is None:
            return consumes_nothing()
        if cancel:
            assert admitted[1] == num_device, "a cancelled prefetch still gave blocks"
        return admitted[0]

    @rule(target=prefetches, prompt=st.sampled_from(PROMPTS))
    def start_prefetch(self, prompt: list[int]) -> tuple[list[int], PendingLoad]:
        """A prefetch the machine admits later, when its keys may no longer be what the prompt needs."""
        load = self.manager.prefetch(prompt)
        assert load.wait(timeout_s=30)   # NOTE: done now, so the machine stays deterministic
        note(f"prefetch {prompt}: {len(load.keys)} keys, {len(load.take(load.keys))} fetched")
        self._check_payloads(prompt, load)
        return prompt, load

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(target=seqs, started=consumes(prefetches), other=st.one_of(st.none(), st.sampled_from(PROMPTS)))
    def admit_prefetched_later(self, started: tuple[list[int], PendingLoad], other: list[int] | None) -> Any:
        """Admit from a prefetch after other steps, or give it to ``other``: only matching keys count."""
        prompt, load = started
        admitted = self._admit(prompt if other is None else other, load)
        return consumes_nothing() if admitted is None else admitted[0]

    @rule(prompt=st.sampled_from(PROMPTS))
    def concurrent_readers(self, prompt: list[int]) -> None:
        """Three threads prefetch the same prompt while this one looks it up: every payload is right."""
        loads: list[PendingLoad] = []
        def read() -> None:
            loads.append(self.manager.prefetch(prompt))

        threads = [threading.Thread(target=read) for _ in range(3)]
        for thread in threads:
            thread.start()
        self.manager.lookup(prompt)
        for thread in threads:
            thread.join()
        assert len(loads) == 3
        for load in loads:
            assert load.wait(timeout_s=30)
            self._check_payloads(prompt, load)

    @rule(started=consumes(prefetches))
    def cancel_prefetch(self, started: tuple[list[int], PendingLoad]) -> None:
        started[1].cancel()
        assert started[1].take(started[1].keys) == []

    @rule(seq_id=seqs, token=st.integers(0, 9))
    def decode(self, seq_id: str, token: int) -> None:
        if seq_id not in self.tokens:
            return
        tokens = self.tokens[seq_id] + [token]
        try:
            batch = self.manager.reserve({seq_id: [token]})
        except PoolExhaustedError:
            note(f"decode {seq_id}: pool full")
            return
        position = np.arange(len(tokens) - 1, len(tokens))
        for layer in range(self.num_layers):
            k, v, q = kv_of(tokens, position, layer)
            self.manager.write(layer, batch, k, v)
            self.manager.attend(layer, batch, q)
        self.tokens[seq_id] = tokens

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        if seq_id in self.tokens:
            self._check_kv(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]), "a live sequence")
            self.manager.free(seq_id)
            del self.tokens[seq_id]

    @rule(tokens=st.lists(st.integers(10, 12), min_size=1, max_size=16))
    def unrelated_traffic(self, tokens: list[int]) -> None:
        """Admit, compute and free a prompt no one else has: it evicts cached blocks to the tiers."""
        admitted = self._admit(tokens, None)
        if admitted is not None:
            self.manager.free(admitted[0])
            del self.tokens[admitted[0]]

    @rule(mode=st.sampled_from(["up", "down", "damaging"]))
    def switch_store(self, mode: str) -> None:
        self.manager.flush_tiers()   # the queued writes meet the store as it was when they were queued
        note(f"store {mode}")
        self.store.mode = mode

    # ------------------------------------------------------------ invariants

    @invariant()
    def manager_and_tiers_hold_their_invariants(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        self.tiers.check_invariants()
        pool = self.manager.pool
        held = {b for seq_id in self.tokens for b in self.manager.block_table(seq_id).block_ids}
        assert pool.num_free_blocks + len(held) == pool.num_blocks, "a block leaked"


def consumes_nothing() -> Any:
    """What a rule with a target returns when it made nothing (the admission did not fit)."""
    from hypothesis.stateful import multiple

    return multiple()


TestTieredManagerMachine = TieredManagerMachine.TestCase


def test_the_machine_catches_a_reader_that_skips_the_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: values are read without their checksum, so a damaged payload is loaded as KV."""

    def decode_without_checksum(layout: BlockLayout, prefix_key: bytes, value: bytes) -> memoryview:
        try:
            return decode_block(layout, prefix_key, value)
        except RefusedValueError as error:
            if "checksum" not in str(error):
                raise
            return memoryview(value)[-layout.block_nbytes :]

    monkeypatch.setattr(tiered_module, "decode_block", decode_without_checksum)
    with pytest.raises(AssertionError, match="wrong KV"):
        run_state_machine_as_test(
            TieredManagerMachine,
            settings=settings(max_examples=300, stateful_step_count=30, deadline=None, derandomize=True,
                              database=None, report_multiple_bugs=False, phases=[Phase.generate]),
        )


def _a_prefetch_given_to_another_prompt() -> None:
    """A shrunk run of the machine: a load of ``[3, 1, 4]``'s block, admitted for ``[2, 7, 1, 8, 2]``."""

    @settings(max_examples=1, database=None)
    @given(st.none())
    def drive(_: None) -> None:
        machine = TieredManagerMachine()
        try:
            machine.setup(block_size=1, num_blocks=4, num_layers=1, host_size=0, policy="lru",
                          write_policy="write_back")
            machine.free(machine.admit(prompt=[3, 1, 4]))
            machine.free(machine.prefetch_then_admit(cancel=False, prompt=[2, 7, 1]))
            started = machine.start_prefetch(prompt=[3, 1, 4])
            machine.admit_prefetched_later(other=[2, 7, 1, 8, 2], started=started)
            machine.manager_and_tiers_hold_their_invariants()
        finally:
            machine.teardown()

    drive()


def test_a_prefetch_given_to_another_prompt_loads_only_blocks_of_its_keys() -> None:
    _a_prefetch_given_to_another_prompt()


def test_the_machine_catches_a_prefetch_that_hands_out_blocks_by_position_not_by_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted bug: a load gives its payloads in order, whatever keys the prompt needs now.

    Right while the device hit and the prompt are what they were at the
    prefetch; wrong for another prompt. The machine found it (2,000 examples);
    its shrunk run is replayed here, so the check is fast and certain.
    """

    def take_by_position(self: PendingLoad, keys: list[bytes]) -> list[bytes]:
        if self.status != "ready":
            return []
        return list(self._future.result()[: len(keys)])

    monkeypatch.setattr(PendingLoad, "take", take_by_position)
    with pytest.raises(AssertionError, match="wrong KV"):
        _a_prefetch_given_to_another_prompt()
