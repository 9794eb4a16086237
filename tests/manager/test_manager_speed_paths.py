"""The manager's fast paths (issue 13): each must do exactly what the general path does, checks included.

* every block of a request is hashed once: keys computed at admission are kept
  (``prompt_keys``) and registered as they stand when their blocks fill;
* ``reserve`` of one sequence takes ``reserve_one``; run side by side with the
  general path on the same calls, the two must leave identical states and
  batches, and raise the same errors;
* the stateful machines also pass with the fast path switched off, so both
  paths are held to the same model;
* token ids, k/v and batches are validated on fast paths that fall back to
  the general ones for anything unusual, with the same errors;
* ``trusted_inputs=True`` skips scanning values (and the score bound) and nothing else.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import importlib
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from support.managers import make_manager, manager_state, settle
from support.prefix import SHA256, key_chain, make, prefix_of

import pagedkv.manager.manager
import pagedkv.manager.prefix_sharing
import pagedkv.manager.reserve
from pagedkv import KVCacheManager
from pagedkv.blocks.table import BlockTable
from pagedkv.errors import (
    InputTypeError,
    NonFiniteError,
    PagedKVError,
    SequenceStateError,
    ShapeError,
)
from pagedkv.inputs import as_tokens, check_tokens
from pagedkv.manager.reserve import SlotRun, reserve_requests
from pagedkv.prefix.cache import ROOT_KEY, block_keys, check_token_ids, pack_token_ids, token_bytes

# ------------------------------------------------------------- hashing once


class HashCounter:
    """Wraps ``pagedkv.manager.prefix_sharing.block_keys`` (every block key is made there) and counts keys."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.num_hashed = 0
        monkeypatch.setattr(pagedkv.manager.prefix_sharing, "block_keys", self)

    def __call__(
        self, parent: bytes, tokens: bytes, block_size: int, extras: bytes, hasher: Any, first_block: int = 0
    ) -> Any:
        keys = block_keys(parent, tokens, block_size, extras, hasher, first_block)
        self.num_hashed += len(keys)
        return keys


def _request(manager: KVCacheManager, seq_id: str, prompt: list[int], decodes: list[int]) -> int:
    """A request cycle: admission, prefill of the uncached rest, single-token decodes; its hit tokens."""
    num_hit = manager.add_sequence(seq_id, prompt)
    settle_ids(manager, {seq_id: prompt[num_hit:]})
    for token in decodes:
        settle_ids(manager, {seq_id: [token]})
    return num_hit


def settle_ids(manager: KVCacheManager, request: dict[str, list[int]]) -> None:
    batch = manager.reserve(request)
    kv = np.ones((batch.num_tokens, manager.pool.num_kv_heads, manager.pool.head_dim))
    for layer in range(manager.pool.num_layers):
        manager.write(layer, batch, kv, kv)


def test_each_block_of_a_request_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # block_size 4, a 10-token prompt, then 6 single-token decodes: 16 tokens, 4 full blocks.
    #
    #   tokens      0 .. 3 | 4 .. 7 | 8 .. 11      | 12 .. 15
    #   hashed at   add_sequence     | block full  | block full (decodes)
    #               (the lookup: (10 - 1) // 4 = 2 usable blocks)
    #
    # Before issue 13 the lookup's 2 keys were dropped and every block hashed
    # again when keyed: 2 + 4 = 6 hashes. Now 4, and they are the right keys.
    counter = HashCounter(monkeypatch)
    manager = make(num_blocks=16, block_size=4)
    prompt, decodes = list(range(100, 110)), [7, 8, 9, 10, 11, 12]
    assert _request(manager, "a", prompt, decodes) == 0
    assert counter.num_hashed == 4
    tokens = prompt + decodes
    table = manager.block_table("a")
    keys = [prefix_of(manager).key_of(block_id) for block_id in table.block_ids]
    assert keys == key_chain(tokens, block_size=4)
    manager.check_invariants()

    # The same prompt again: its lookup reuses the last lookup's keys (no hashing)
    # and hits both usable blocks; blocks 2 and 3 are hashed once each when they
    # fill (and stay unkeyed: taken).
    counter.num_hashed = 0
    assert _request(manager, "b", prompt, decodes) == 8
    assert counter.num_hashed == 2
    manager.check_invariants()


def test_a_prompt_reserved_token_by_token_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = HashCounter(monkeypatch)
    manager = make(num_blocks=16, block_size=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 3 usable blocks at admission, 3 full blocks written
    manager.add_sequence("a", prompt)
    for token in prompt:
        settle_ids(manager, {"a": [token]})
        manager.check_invariants()
    assert counter.num_hashed == 3
    cache = prefix_of(manager)
    assert [cache.key_of(b) for b in manager.block_table("a").block_ids[:3]] == key_chain(prompt)


def test_resume_after_recompute_reuses_the_keys_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = HashCounter(monkeypatch)
    manager = make(num_blocks=16, block_size=2)
    prompt = list(range(20, 29))  # 9 tokens: 4 usable blocks
    _request(manager, "a", prompt, [1, 2, 3])  # 12 tokens, 6 full blocks
    assert counter.num_hashed == 6
    manager.preempt("a")
    assert manager.resume("a") == 10  # 5 usable blocks of 12 tokens, all still cached
    assert counter.num_hashed == 6  # nothing hashed again
    manager.check_invariants()


def test_prompt_keys_stop_where_the_reserved_ids_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # The prompt given to add_sequence was [1 2 | 3 4 | 5 6 | 7]; the caller reserves
    # [1 2 | 3 9 | 5 6 | 7] instead. Block 0's prompt key still names its contents;
    # blocks 1 and 2 must be hashed from the ids actually reserved.
    counter = HashCounter(monkeypatch)
    manager = make(num_blocks=16, block_size=2)
    manager.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    assert counter.num_hashed == 3
    actual = [1, 2, 3, 9, 5, 6, 7]
    settle_ids(manager, {"a": actual})
    assert counter.num_hashed == 3 + 2
    cache = prefix_of(manager)
    assert [cache.key_of(b) for b in manager.block_table("a").block_ids[:3]] == key_chain(actual)
    manager.check_invariants()


def test_prompt_keys_stop_where_ids_reserved_one_at_a_time_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # As above, but a token at a time: the decode path of reserve compares each id too.
    counter = HashCounter(monkeypatch)
    manager = make(num_blocks=16, block_size=2)
    manager.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    actual = [1, 2, 3, 9, 5, 6, 7]
    for token in actual:
        settle_ids(manager, {"a": [token]})
        manager.check_invariants()
    assert counter.num_hashed == 3 + 2
    cache = prefix_of(manager)
    assert [cache.key_of(b) for b in manager.block_table("a").block_ids[:3]] == key_chain(actual)


def test_a_count_ends_prompt_keys_with_keying(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make(num_blocks=16, block_size=2)
    manager.add_sequence("a", [1, 2, 3, 4, 5], cache_blocks=False)
    settle(manager, {"a": 5})
    assert prefix_of(manager).num_cached_blocks == 0  # a sequence that does not cache keys nothing
    manager.check_invariants()


def test_an_invariant_catches_a_prompt_key_for_other_ids() -> None:
    manager = make(num_blocks=16, block_size=2)
    manager.add_sequence("a", [1, 2, 3, 4, 5])
    settle_ids(manager, {"a": [1]})
    record = manager._seqs["a"]
    assert record.prompt_keys  # kept for blocks 0 and 1
    record.token_ids[0] = 99  # a planted bug: the ids no longer match the key's prompt
    with pytest.raises(AssertionError, match="differ from its prompt"):
        manager.check_invariants()


def test_block_keys_are_unchanged_by_the_faster_encoding() -> None:
    # The bytes hashed for a key did not change (snapshots and other managers rely on them).
    tokens = token_bytes([3, 1, 4, 1])

    def field(tag: bytes, data: bytes) -> bytes:
        return tag + len(data).to_bytes(8, "little") + data

    first = SHA256(field(b"P", ROOT_KEY) + field(b"T", tokens[:16]))
    second = SHA256(field(b"P", first) + field(b"T", tokens[16:]))
    assert block_keys(ROOT_KEY, tokens, 2, b"", SHA256) == [first, second]


# ------------------------------------------------- one reserve, two paths


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["add", "add_prompt", "one", "one_id", "many", "write", "write", "free", "fork", "cancel",
             "preempt", "resume", "bad"]
        ),
        st.integers(0, 3),
        st.integers(1, 6),
    ),
    max_size=40,
)


class Twin:
    """Two managers fed the same calls: ``fast`` as it is, ``slow`` with reserve's fast path off."""

    def __init__(self, **options: Any) -> None:
        self.fast = make_manager(12, block_size=2, **options)
        self.slow = make_manager(12, block_size=2, **options)
        self.batches: dict[str, Any] = {"fast": None, "slow": None}

    def call(self, name: str, *args: Any) -> None:
        outcomes = []
        for label, manager in (("fast", self.fast), ("slow", self.slow)):
            method = getattr(manager, name)
            if name == "reserve" and label == "slow":
                method = _general_reserve(manager)
            try:
                result = method(*args)
            except PagedKVError as error:
                outcomes.append((type(error), str(error)))
                continue
            if name == "reserve":
                self.batches[label] = result
                result = (result.seq_ids, result.num_new_tokens, result.first_positions,
                          result.query_start.tolist(), result.slot_mapping.tolist())
            outcomes.append(result)
        assert outcomes[0] == outcomes[1]
        assert manager_state(self.fast) == manager_state(self.slow)

    def write(self) -> None:
        for label, manager in (("fast", self.fast), ("slow", self.slow)):
            batch = self.batches[label]
            if batch is None:
                return
            kv = np.full((batch.num_tokens, 1, 1), 0.5)
            with contextlib.suppress(SequenceStateError):  # stale on both sides, or on neither
                manager.write(0, batch, kv, kv)


def _general_reserve(manager: KVCacheManager) -> Any:
    def reserve(requests: Any) -> Any:
        with manager.pool.lock:
            return reserve_requests(
                manager._seqs, requests, manager.pool, manager.max_size, manager.prefix_caching,
                manager._counters,
            )

    return reserve


@pytest.mark.parametrize("options", [
    {}, {"enable_prefix_caching": True}, {"num_sink_tokens": 1},
    {"max_size": 3}, {"max_size": 5, "num_sink_tokens": 1}, {"max_size": 4, "enable_prefix_caching": True},
])
@given(ops=OPS)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reserve_one_does_what_the_general_path_does(options: dict[str, Any], ops: list[Any]) -> None:
    twin = Twin(**options)
    caching = bool(options)
    for op, index, count in ops:
        seq_id = f"s{index}"
        if op == "add":
            twin.call("add_sequence", seq_id)
        elif op == "add_prompt":
            twin.call("add_sequence", seq_id, list(range(index, index + count)))
        elif op == "one":
            twin.call("reserve", {seq_id: count if count < 3 else 1})
        elif op == "one_id":
            twin.call("reserve", {seq_id: [count] if count < 5 else list(range(count))})
        elif op == "many":
            twin.call("reserve", {f"s{i}": [i] if caching else 1 for i in range(index + 1)})
        elif op == "write":
            twin.write()
            assert manager_state(twin.fast) == manager_state(twin.slow)
        elif op == "free":
            twin.call("free", seq_id)
        elif op == "fork":
            twin.call("fork", seq_id, f"s{(index + 1) % 4}")
        elif op == "cancel":
            twin.call("cancel_reservation", seq_id)
        elif op == "preempt":
            twin.call("preempt", seq_id)
        elif op == "resume":
            twin.call("resume", seq_id)
        else:
            twin.call("reserve", {seq_id: [True] if count % 2 else 0})
        twin.fast.check_invariants()


@pytest.mark.parametrize(
    ("module", "machine"),
    [("test_stateful_manager", "ManagerMachine"), ("test_stateful_prefix", "PrefixCachingMachine")],
)
def test_the_state_machines_pass_with_the_fast_path_off(
    module: str, machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both machines run with reserve_one as it is elsewhere in the suite; here the general
    # path takes every reservation, and must satisfy the same models.
    monkeypatch.setattr(pagedkv.manager.manager, "reserve_one", lambda *args: None)
    run_state_machine_as_test(
        getattr(importlib.import_module(module), machine),
        settings=settings(
            max_examples=15,
            stateful_step_count=30,
            phases=[Phase.generate],
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "token_ids",
    [[], [0], [1, 2**63 - 1], [0, 1, 0], list(range(300)), [np.int64(5), 3], (4, 5), np.array([1, 2])],
)
def test_packed_token_ids_match_the_general_path(token_ids: Any) -> None:
    ids, packed = pack_token_ids(token_ids, "ids")
    assert ids == [int(t) for t in token_ids] and all(type(t) is int for t in ids)
    assert packed == token_bytes(ids)
    check_token_ids(token_ids, "ids")


@pytest.mark.parametrize(
    ("token_ids", "fragment"),
    [
        ([1, True], "got a bool"),
        ([False, 2], "got a bool"),
        ([1, -1], r"in 0 \.\. 2\*\*63 - 1"),
        ([1, 2**63], "int64 range"),
        ([2**64], "int64 range"),
        ([1, 2.0], "int64 range"),
        (["a"], "int64 range"),
        ([None], "int64 range"),
        (5, "ids, got 5"),
        ("ab", "ids, got 'ab'"),
    ],
)
def test_bad_token_ids_are_refused_on_every_path(token_ids: Any, fragment: str) -> None:
    for check in (pack_token_ids, check_token_ids):
        with pytest.raises(InputTypeError, match=fragment):
            check(token_ids, "ids")


@given(st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=6, max_size=6))
def test_the_k_v_fast_path_finds_the_largest_magnitude(values: list[float]) -> None:
    array = np.array(values, np.float32).reshape(2, 1, 3)
    checked, largest = check_tokens("k", array, np.dtype(np.float32), (2, 1, 3))
    assert checked is array
    assert largest == float(np.abs(array).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
@pytest.mark.parametrize("where", [0, 2])
def test_the_k_v_fast_path_refuses_what_as_tokens_refuses(bad: float, where: int) -> None:
    array = np.ones((1, 1, 3), np.float32)
    array[0, 0, where] = bad
    with pytest.raises(NonFiniteError) as expected:
        as_tokens("k", array, np.dtype(np.float32), (1, 1, 3))
    with pytest.raises(NonFiniteError, match=re.escape(str(expected.value))):
        check_tokens("k", array, np.dtype(np.float32), (1, 1, 3))


def test_a_slot_run_holds_the_tables_slots() -> None:
    table = BlockTable(4)
    table.append(3, [7])
    table.append(9, [2, 5])
    # block_size 4:  block 7: . . . x | block 2: x x x x | block 5: x x x x
    expected = [31, 8, 9, 10, 11, 20, 21, 22, 23]
    assert SlotRun([7, 2, 5], 3, 9, 4).slots().tolist() == table.slot_array([(3, 12)]).tolist() == expected


def test_a_decode_batch_builds_its_arrays_only_when_read() -> None:
    manager = make_manager(8, block_size=4)
    manager.add_sequence("a")
    settle(manager, {"a": 5})
    batch = manager.reserve({"a": 1})
    made = ("_slot_mapping", "_query_start")  # the arrays' cached slots (a slotted Batch has no __dict__)
    assert not any(hasattr(batch, name) for name in made)  # every array is made when first read
    manager.write(0, batch, np.ones((1, 1, 1)), np.ones((1, 1, 1)))  # written by its slot
    assert not any(hasattr(batch, name) for name in made)
    assert batch.seq_ids == ("a",) and batch.first_positions == (5,) and batch.num_new_tokens == (1,)
    assert not hasattr(batch, "_slot_mapping")
    assert batch.slot_mapping.tolist() == [manager.block_table("a").slot(5)]
    assert batch.query_start.tolist() == [0, 1]
    assert not batch.slot_mapping.flags.writeable and not batch.query_start.flags.writeable
    copy = copy_module.copy(batch)
    with pytest.raises(SequenceStateError, match="not the one reserve"):
        manager.attend(0, copy, np.ones((1, 1, 1)))


# ------------------------------------------------------------ trusted inputs


def test_trusted_inputs_skips_the_value_scans_and_nothing_else() -> None:
    manager = make_manager(8, block_size=4, trusted_inputs=True)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 1})
    with pytest.raises(ShapeError):
        manager.write(0, batch, np.ones((2, 1, 1)), np.ones((2, 1, 1)))
    with pytest.raises(NonFiniteError):  # a list is converted, and then checked in full
        manager.write(0, batch, np.ones((1, 1, 1)), [[[np.inf]]])
    manager.write(0, batch, np.full((1, 1, 1), 1e300), np.full((1, 1, 1), np.nan))  # the engine vouched
    with pytest.raises(SequenceStateError, match="already written"):
        manager.write(0, batch, np.ones((1, 1, 1)), np.ones((1, 1, 1)))
    with pytest.raises(ShapeError):
        manager.attend(0, batch, np.ones((1, 2, 1)))
    # No score bound either: 1e300 * 1e300 overflows, and the engine gets what it asked for.
    with np.errstate(all="ignore"):
        assert np.isnan(manager.attend(0, batch, np.full((1, 1, 1), 1e300))).all()
    manager.check_invariants()
    default = make_manager(8, block_size=4)
    default.add_sequence("a")
    batch = default.reserve({"a": 1})
    with pytest.raises(NonFiniteError):  # the default manager scans keys and values
        default.write(0, batch, np.ones((1, 1, 1)), np.full((1, 1, 1), np.nan))
    default.write(0, batch, np.full((1, 1, 1), 1e300), np.ones((1, 1, 1)))
    with pytest.raises(NonFiniteError, match="attention scores could reach"):
        default.attend(0, batch, np.full((1, 1, 1), 1e300))


def test_trusted_inputs_must_be_a_bool() -> None:
    with pytest.raises(InputTypeError, match="trusted_inputs must be True or False"):
        make_manager(8, trusted_inputs=1)


def test_a_planted_fast_path_that_ignores_the_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reserve_one`` plans a windowed sequence with ``plan_step``; planted: the window forgotten there
    (no eviction, the old blocks kept). The twin's comparison with the general path must fail."""
    original = pagedkv.manager.reserve.plan_step

    def window_forgotten(table: Any, count: int, allocator: Any, window: Any, ref_drops: Any) -> Any:
        return original(table, count, allocator, None, ref_drops)

    ops = [("add", 0, 1)] + [("one", 0, 1), ("write", 0, 1)] * 8
    run = test_reserve_one_does_what_the_general_path_does.hypothesis.inner_test
    run(options={"max_size": 3}, ops=ops)
    monkeypatch.setattr(pagedkv.manager.reserve, "plan_step", window_forgotten)
    with pytest.raises(AssertionError):
        run(options={"max_size": 3}, ops=ops)


@pytest.mark.parametrize("options", [
    {"max_size": 3}, {"max_size": 5, "num_sink_tokens": 1}, {"max_size": 4, "enable_prefix_caching": True},
])
def test_windowed_decodes_through_forks_and_frees_match_the_general_path(options: dict[str, Any]) -> None:
    """Forked sequences share blocks their windows then let go of (a drop, not a free), prompts of
    several tokens, frees between steps: the fast path and the general one, state for state."""
    twin = Twin(**options)
    caching = "enable_prefix_caching" in options
    twin.call("add_sequence", "s0")
    twin.call("reserve", {"s0": list(range(5)) if caching else 5})
    twin.write()
    twin.call("fork", "s0", "s1")
    for step in range(24):
        for seq_id in ("s0", "s1", "s2"):
            if seq_id == "s2" and step == 6:
                twin.call("add_sequence", "s2")
            if seq_id == "s1" and step == 17:
                twin.call("free", "s1")
            twin.call("reserve", {seq_id: [step] if caching else 1 + (step % 5 == 4)})
            twin.write()
            twin.fast.check_invariants()
    assert manager_state(twin.fast) == manager_state(twin.slow)
