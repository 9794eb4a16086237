"""Bad input to ``KVCacheManager``: each a specific error, and nothing changed.

Every case runs against a manager built by :func:`build` and compares it with
an untouched twin built the same way: the free queue, every ref count, every
table (state, block ids, token count, window start), the metrics, the pool
storage, and then the outputs of the steps that follow, bit for bit.

The standard state (block_size 4, 12 device blocks, 2 host blocks)::

    a  running   6 tokens   [a0..a3] [a4 a5 . .]        shared with c
    c  running   fork of a  (same two blocks)
    b  running   3 tokens   [b0 b1 b2 .]
    d  swapped   5 tokens   2 host blocks (the host pool is full)
    e  preempted (recompute), no blocks
    f  running   2 tokens reserved, layer 0 written, layer 1 pending
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from support.managers import make_manager, manager_state

from pagedkv import (
    Batch,
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    KVCacheManager,
    LayerIndexError,
    NonFiniteError,
    PagedKVError,
    PoolExhaustedError,
    SequenceState,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
)

L, HKV, HQ, D, BS = 2, 2, 4, 3, 4
SHAPE = {"block_size": BS, "num_kv_heads": HKV, "head_dim": D, "num_layers": L}


def arrays(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [
        (rng.standard_normal((n, HKV, D)), rng.standard_normal((n, HKV, D)), rng.standard_normal((n, HQ, D)))
        for _ in range(L)
    ]


def feed(m: KVCacheManager, rng: np.random.Generator, request: dict[str, int]) -> list[np.ndarray]:
    batch = m.reserve(request)
    outs = []
    for layer, (k, v, q) in enumerate(arrays(rng, batch.num_tokens)):
        m.write(layer, batch, k, v)
        outs.append(m.attend(layer, batch, q))
    return outs


@dataclass
class World:
    m: KVCacheManager
    rng: np.random.Generator
    pending: Batch | None
    pending_kvq: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    last: Batch | None = None


def build(*, host: bool = True, fill: bool = False, window: int | None = None) -> World:
    """The standard state above; ``fill`` adds ``g``, which takes every free device block."""
    m = make_manager(12, host_blocks=2 if host else 0, **SHAPE, num_q_heads=HQ, max_size=window)
    rng = np.random.default_rng(2024)
    for s in "abcdef":
        if s != "c":
            m.add_sequence(s)
    feed(m, rng, {"a": 6, "b": 3})
    m.fork("a", "c")
    feed(m, rng, {"d": 5})
    if host:
        m.preempt("d", "swap")
    feed(m, rng, {"e": 2})
    m.preempt("e")
    last = m.reserve({"b": 1})
    for layer, (k, v, q) in enumerate(arrays(rng, 1)):
        m.write(layer, last, k, v)
        m.attend(layer, last, q)
    if fill:
        m.add_sequence("g")
        feed(m, rng, {"g": BS * m.pool.num_free_blocks})
        assert m.pool.num_free_blocks == 0
    pending = None
    kvq: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if not fill:
        pending = m.reserve({"f": 2})
        kvq = arrays(rng, 2)
        m.write(0, pending, kvq[0][0], kvq[0][1])
    m.check_invariants()
    return World(m, rng, pending, kvq, last)


def continue_world(w: World) -> list[np.ndarray]:
    """Finish the pending layer, then one step for every running, settled sequence."""
    outs = []
    if w.pending is not None:
        k, v, q = w.pending_kvq[1]
        w.m.write(1, w.pending, k, v)
        outs.append(w.m.attend(1, w.pending, q))
        outs.append(w.m.attend(0, w.pending, w.pending_kvq[0][2]))
    if "g" in w.m:
        w.m.free("g")  # the filled pool: make room for the step
    running = [s for s in w.m.seq_ids if w.m.state(s) is SequenceState.RUNNING]
    outs += feed(w.m, w.rng, dict.fromkeys(running, 1))
    w.m.check_invariants()
    return outs


def assert_refused(
    action: Callable[[World], object],
    error: type[Exception],
    fragment: str,
    **build_kwargs: Any,
) -> None:
    """``action`` raises ``error`` (a PagedKVError) whose message holds ``fragment``; nothing changes."""
    world, twin = build(**build_kwargs), build(**build_kwargs)
    assert manager_state(world.m) == manager_state(twin.m)
    with pytest.raises(error, match=fragment) as info:
        action(world)
    assert isinstance(info.value, PagedKVError)
    assert manager_state(world.m) == manager_state(twin.m)
    world.m.check_invariants()
    outs, twin_outs = continue_world(world), continue_world(twin)
    assert len(outs) == len(twin_outs) > 0
    for a, b in zip(outs, twin_outs):
        assert np.array_equal(a, b)
    assert manager_state(world.m) == manager_state(twin.m)


def assert_refused_after(
    setup: Callable[[World], Any],
    call: Callable[[World, Any], object],
    error: type[Exception],
    fragment: str,
) -> None:
    """After ``setup(world)`` (which may change it), ``call(world, what setup returned)`` raises
    ``error`` whose message holds ``fragment``, and changes nothing."""
    world = build()
    context = setup(world)
    before = manager_state(world.m)
    with pytest.raises(error, match=fragment) as info:
        call(world, context)
    assert isinstance(info.value, PagedKVError)
    assert manager_state(world.m) == before
    world.m.check_invariants()


def kv(n: int, heads: int = HKV, dim: int = D) -> np.ndarray:
    return np.ones((n, heads, dim))


# ------------------------------------------------------------ sequence ids

UNKNOWN_ID_ACTIONS: dict[str, Callable[[World], object]] = {
    "reserve": lambda w: w.m.reserve({"zz": 1}),
    "reserve_with_known": lambda w: w.m.reserve({"a": 1, "zz": 1}),
    "plan": lambda w: w.m.plan({"zz": 1}),
    "fork_parent": lambda w: w.m.fork("zz", "new"),
    "free": lambda w: w.m.free("zz"),
    "preempt": lambda w: w.m.preempt("zz"),
    "preempt_swap": lambda w: w.m.preempt("zz", "swap"),
    "resume": lambda w: w.m.resume("zz"),
    "state": lambda w: w.m.state("zz"),
    "block_table": lambda w: w.m.block_table("zz"),
    "num_tokens": lambda w: w.m.num_tokens("zz"),
}


@pytest.mark.parametrize("action", UNKNOWN_ID_ACTIONS.values(), ids=UNKNOWN_ID_ACTIONS.keys())
def test_unknown_sequence_id_is_refused(action: Callable[[World], object]) -> None:
    assert_refused(action, UnknownSequenceError, "no sequence 'zz'")


def test_unknown_sequence_error_is_a_lookup_error() -> None:
    world = build()
    with pytest.raises(LookupError):
        world.m.free("zz")


FREED_ID_ACTIONS: dict[str, Callable[[KVCacheManager], object]] = {
    "free_twice": lambda m: m.free("b"),
    "reserve": lambda m: m.reserve({"b": 1}),
    "fork": lambda m: m.fork("b", "new"),
    "preempt": lambda m: m.preempt("b"),
    "resume": lambda m: m.resume("b"),
}


@pytest.mark.parametrize("action", FREED_ID_ACTIONS.values(), ids=FREED_ID_ACTIONS.keys())
def test_freed_sequence_id_is_refused_and_nothing_changes(action: Callable[[KVCacheManager], object]) -> None:
    assert_refused_after(
        lambda w: w.m.free("b"), lambda w, _: action(w.m), UnknownSequenceError, "no sequence 'b'"
    )


def test_stale_batch_of_a_freed_sequence_is_refused() -> None:
    assert_refused_after(
        lambda w: w.m.free("b"),
        lambda w, _: w.m.attend(0, w.last, np.ones((1, HQ, D))),
        SequenceStateError,
        "no longer reserved",
    )


@pytest.mark.parametrize("seq_id", ["a", "d", "e", "f"])
def test_duplicate_sequence_id_is_refused(seq_id: str) -> None:
    assert_refused(lambda w: w.m.add_sequence(seq_id), DuplicateSequenceError, f"'{seq_id}' already exists")


def test_duplicate_id_in_one_reservation_is_refused() -> None:
    assert_refused(
        lambda w: w.m.reserve([("a", 1), ("b", 1), ("a", 1)]), DuplicateSequenceError, "appears twice"
    )
    assert_refused(lambda w: w.m.plan([("b", 1), ("b", 2)]), DuplicateSequenceError, "appears twice")


@pytest.mark.parametrize("child", ["a", "b", "c", "d", "e", "f"])
def test_fork_onto_an_existing_id_is_refused(child: str) -> None:
    assert_refused(lambda w: w.m.fork("b", child), DuplicateSequenceError, f"'{child}' already exists")


def test_unhashable_id_is_a_type_error() -> None:
    assert_refused(lambda w: w.m.add_sequence(["x"]), InputTypeError, "hashable")
    assert_refused(lambda w: w.m.free(["x"]), InputTypeError, "hashable")
    assert_refused(lambda w: w.m.fork("a", {"x": 1}), InputTypeError, "hashable")


# ------------------------------------------------------- shapes and layers


def _write_last_layer(w: World, k: Any, v: Any) -> None:
    assert w.pending is not None
    w.m.write(1, w.pending, k, v)


@pytest.mark.parametrize(
    ("k", "v", "fragment"),
    [
        (kv(2, dim=D + 1), kv(2), r"keys must have shape .* = \(2, 2, 3\), got \(2, 2, 4\)"),
        (kv(2), kv(2, heads=1), r"values must have shape .* got \(2, 1, 3\)"),
        (kv(3), kv(3), r"got \(3, 2, 3\)"),
        (kv(1), kv(1), r"got \(1, 2, 3\)"),
        (np.ones((2, HKV * D)), kv(2), "must have 3 dimensions"),
    ],
)
def test_wrong_kv_shape_for_a_layer_is_refused(k: np.ndarray, v: np.ndarray, fragment: str) -> None:
    assert_refused(lambda w: _write_last_layer(w, k, v), ShapeError, fragment)


def test_wrong_query_shape_is_refused() -> None:
    # f wrote layer 0: attend there with 2 kv heads instead of 4 query heads
    def attend(q: np.ndarray) -> Callable[[World], object]:
        return lambda w: w.m.attend(0, w.pending, q)

    assert_refused(attend(np.ones((2, HKV, D))), ShapeError, r"queries must have shape .* \(2, 4, 3\)")
    assert_refused(attend(np.ones((3, HQ, D))), ShapeError, r"got \(3, 4, 3\)")
    assert_refused(attend(np.ones((2, HQ, D - 1))), ShapeError, r"got \(2, 4, 2\)")


def test_bad_kv_values_are_refused() -> None:
    bad = kv(2)
    bad[1, 0, 2] = np.nan
    assert_refused(lambda w: _write_last_layer(w, kv(2), bad), NonFiniteError, "nan")
    assert_refused(lambda w: _write_last_layer(w, "keys", kv(2)), InputTypeError, "keys must be a list")
    assert_refused(lambda w: _write_last_layer(w, kv(2).astype(complex), kv(2)), InputTypeError, "complex")


@pytest.mark.parametrize("layer", [2, 3, -1, -3, 100])
def test_layer_index_out_of_range_is_refused(layer: int) -> None:
    fragment = f"layer {layer} is out of range 0..1"
    assert_refused(lambda w: w.m.write(layer, w.pending, kv(2), kv(2)), LayerIndexError, fragment)
    assert_refused(lambda w: w.m.attend(layer, w.pending, np.ones((2, HQ, D))), LayerIndexError, fragment)
    assert issubclass(LayerIndexError, IndexError)


@pytest.mark.parametrize("layer", [True, 1.0, "0", None])
def test_layer_of_the_wrong_type_is_refused(layer: Any) -> None:
    assert_refused(
        lambda w: w.m.write(layer, w.pending, kv(2), kv(2)), InputTypeError, "layer must be an int"
    )


# ------------------------------------------------- slots never reserved


def test_writing_a_layer_twice_is_refused() -> None:
    assert_refused(lambda w: w.m.write(0, w.pending, kv(2), kv(2)), SequenceStateError, "already written")


def test_writing_a_stale_batch_is_refused() -> None:
    # last reserved b's token 3 and every layer wrote it; b reserved again since
    def reserve_again(w: World) -> None:
        w.m.free("f")  # leaves no pending layer; b may reserve again
        fresh = w.m.reserve({"b": 1})
        for layer in range(L):
            w.m.write(layer, fresh, kv(1), kv(1))

    assert_refused_after(
        reserve_again,
        lambda w, _: w.m.write(0, w.last, kv(1), kv(1)),
        SequenceStateError,
        "no longer reserved",
    )


def test_writing_a_batch_from_another_manager_is_refused() -> None:
    # both managers stamp their first reservation; a batch of one must never
    # write slots the other never reserved (block 1 belongs to no one here)
    def action(w: World) -> None:
        other = make_manager(4, **SHAPE)
        other.add_sequence("b")
        foreign = other.reserve({"b": 7})
        w.m.write(0, foreign, kv(7), kv(7))

    assert_refused(action, SequenceStateError, "no longer reserved")


def test_batch_of_a_twin_manager_with_the_same_stamps_is_refused() -> None:
    # Two fresh managers make the same calls, so per-manager stamps would
    # collide: m's "a" holds 3 slots in block 0, the foreign batch names 5
    # slots (block 1 is free in m). Writing it would mark 5 tokens written
    # of 3 reserved and store k/v in a free block.
    def fresh() -> KVCacheManager:
        m = make_manager(4, **SHAPE)
        m.add_sequence("a")
        return m

    m, other = fresh(), fresh()
    m.reserve({"a": 3})
    foreign = other.reserve({"a": 5})
    before = manager_state(m)
    with pytest.raises(SequenceStateError, match="no longer reserved"):
        m.write(0, foreign, kv(5), kv(5))
    with pytest.raises(SequenceStateError, match="no longer reserved"):
        m.attend(0, foreign, np.ones((5, HQ, D)))
    assert manager_state(m) == before
    m.check_invariants()


def test_tampered_batch_is_refused() -> None:
    def action(w: World) -> None:
        assert w.pending is not None
        p = w.pending
        forged = Batch(  # reserve's batch with other stamps
            p.seq_ids, p.num_new_tokens, p.first_positions, p.query_start, p.slot_mapping,
            tuple(i + 10**9 for i in p.reservation_ids),
        )
        w.m.write(1, forged, kv(2), kv(2))

    assert_refused(action, SequenceStateError, "no longer reserved")
    assert_refused(lambda w: w.m.write(1, "batch", kv(2), kv(2)), InputTypeError, "batch must be a Batch")


def test_batch_of_a_preempted_sequence_is_refused() -> None:
    assert_refused_after(
        lambda w: w.m.preempt("f"),
        lambda w, _: w.m.write(1, w.pending, kv(2), kv(2)),
        SequenceStateError,
        "no longer reserved",
    )


# ------------------------------------------------------- attend too early


def test_attending_before_write_is_refused() -> None:
    # f's layer 1 is not written yet
    assert_refused(lambda w: w.m.attend(1, w.pending, np.ones((2, HQ, D))), SequenceStateError, "call write")


def test_attending_a_sequence_with_no_tokens_is_refused() -> None:
    # a fresh sequence has nothing to attend: its batch exists only after
    # reserve, and until write there are no k/v in any layer
    def reserve_fresh(w: World) -> Batch:
        w.m.add_sequence("h")
        return w.m.reserve({"h": 1})

    assert_refused_after(
        reserve_fresh,
        lambda w, batch: w.m.attend(0, batch, np.ones((1, HQ, D))),
        SequenceStateError,
        "no k/v written in layer 0",
    )


def test_unknown_attend_method_is_refused() -> None:
    assert_refused(
        lambda w: w.m.attend(0, w.pending, np.ones((2, HQ, D)), method="vectorized"), ConfigError, "method"
    )


# ------------------------------------------------------------- reserve


@pytest.mark.parametrize("count", [0, -1, -100])
def test_reserving_zero_or_negative_tokens_is_refused(count: int) -> None:
    fragment = f"tokens for sequence 'b' must be an int >= 1, got {count}"
    assert_refused(lambda w: w.m.reserve({"b": count}), ConfigError, fragment)
    assert_refused(lambda w: w.m.reserve({"a": 1, "b": count}), ConfigError, fragment)
    assert_refused(lambda w: w.m.plan({"b": count}), ConfigError, fragment)


@pytest.mark.parametrize("count", [True, 1.5, "2", None])
def test_reserving_a_non_int_count_is_refused(count: Any) -> None:
    assert_refused(lambda w: w.m.reserve({"b": count}), InputTypeError, "sequence 'b'")


@pytest.mark.parametrize("requests", [{}, [], ()])
def test_reserving_for_no_sequence_is_an_empty_step(requests: Any) -> None:
    # Not a misuse: can_reserve({}) is True. The empty batch goes through every
    # layer with 0-token inputs; nothing changes, pending batch included.
    world, twin = build(), build()
    assert world.m.can_reserve(requests) is True
    batch = world.m.reserve(requests)
    assert (batch.num_seqs, batch.num_tokens, batch.slot_mapping.tolist()) == (0, 0, [])
    for layer in range(L):
        world.m.write(layer, batch, kv(0), kv(0))
        assert world.m.attend(layer, batch, kv(0, HQ)).shape == (0, HQ, D)
    assert manager_state(world.m) == manager_state(twin.m)
    world.m.check_invariants()
    outs, twin_outs = continue_world(world), continue_world(twin)
    assert len(outs) == len(twin_outs) > 0
    for a, b in zip(outs, twin_outs):
        assert np.array_equal(a, b)
    assert manager_state(world.m) == manager_state(twin.m)


def test_reserving_malformed_requests_is_refused() -> None:
    assert_refused(lambda w: w.m.reserve(["b"]), InputTypeError, "requests must be")
    assert_refused(lambda w: w.m.reserve(5), InputTypeError, "requests must be")


@pytest.mark.parametrize(("seq_id", "state"), [("d", "swapped"), ("e", "preempted")])
def test_reserving_for_a_sequence_that_is_not_running_is_refused(seq_id: str, state: str) -> None:
    assert_refused(lambda w: w.m.reserve({"b": 1, seq_id: 1}), SequenceStateError, f"it is {state}")


def test_reserve_while_layers_are_pending_is_refused() -> None:
    assert_refused(lambda w: w.m.reserve({"f": 1}), SequenceStateError, r"layers \[1\] have not written")
    assert_refused(lambda w: w.m.reserve({"a": 1, "f": 1}), SequenceStateError, "have not written")
    assert_refused(lambda w: w.m.plan({"f": 1}), SequenceStateError, "have not written")


def test_reserve_beyond_the_pool_is_refused_whole() -> None:
    # 12 blocks: a/c 2, b 1, f 1 used -> 8 free; b asks for 9 blocks' worth
    assert_refused(
        lambda w: w.m.reserve({"a": 1, "b": 33}), PoolExhaustedError, "need 10 blocks, 8 free of 12"
    )
    assert_refused(lambda w: w.m.reserve({"c": 1, "b": 40}), PoolExhaustedError, "free of 12")
    assert issubclass(PoolExhaustedError, MemoryError)


# ------------------------------------------------------- fork, preempt, resume


def test_fork_of_a_sequence_that_is_not_settled_is_refused() -> None:
    assert_refused(lambda w: w.m.fork("f", "new"), SequenceStateError, "cannot fork sequence 'f'")
    assert_refused(lambda w: w.m.fork("d", "new"), SequenceStateError, "it is swapped")
    assert_refused(lambda w: w.m.fork("e", "new"), SequenceStateError, "it is preempted")


def test_swap_without_host_pool_is_refused() -> None:
    assert_refused(lambda w: w.m.preempt("b", "swap"), ConfigError, "host pool", host=False)


def test_swap_when_the_host_pool_is_full_is_refused() -> None:
    # d holds both host blocks; b needs one
    assert_refused(lambda w: w.m.preempt("b", "swap"), PoolExhaustedError, "need 1 block, 0 free of 2")


def test_swap_mid_prefill_is_refused() -> None:
    # f reserved 2 tokens and only layer 0 wrote them (nano-vllm PR #211/#233)
    assert_refused(lambda w: w.m.preempt("f", "swap"), SequenceStateError, "cannot swap out sequence 'f'")


def test_resume_when_the_device_pool_is_full_is_refused() -> None:
    # g took every free block; d needs 2 to come back
    assert_refused(lambda w: w.m.resume("d"), PoolExhaustedError, "need 2 blocks, 0 free of 12", fill=True)


def test_preempt_and_resume_in_the_wrong_state_are_refused() -> None:
    assert_refused(lambda w: w.m.preempt("d"), SequenceStateError, "'d' is swapped, not running")
    assert_refused(lambda w: w.m.preempt("e", "swap"), SequenceStateError, "'e' is preempted, not running")
    assert_refused(lambda w: w.m.resume("a"), SequenceStateError, "'a' is running")
    assert_refused(lambda w: w.m.preempt("a", "evict"), ConfigError, "mode must be")


def test_every_refusal_is_also_the_builtin_that_fits() -> None:
    world = build()
    for action, builtin in [
        (lambda: world.m.free("zz"), LookupError),
        (lambda: world.m.add_sequence("a"), ValueError),
        (lambda: world.m.reserve({"b": 0}), ValueError),
        (lambda: world.m.reserve({"b": 10**6}), MemoryError),
        (lambda: world.m.reserve({"f": 1}), RuntimeError),
        (lambda: world.m.write(5, world.pending, kv(2), kv(2)), IndexError),
        (lambda: world.m.write(1, world.pending, kv(3), kv(3)), ValueError),
    ]:
        with pytest.raises(builtin):
            action()
