"""The empty step: ``reserve({})`` when no sequence runs, and what takes its batch.

A serving loop asks ``can_reserve(running)`` and then calls ``reserve(running)``;
when the running set is empty the answer is True, so the command must succeed
too: it returns the empty batch and changes nothing, and every layer's
``write`` and ``attend`` take inputs of 0 tokens::

    batch = manager.reserve({})      # num_seqs 0, num_tokens 0
    batch.query_start                # [0]
    batch.slot_mapping               # []   (int64)
    manager.write(layer, batch, k, v)        # k, v: (0, num_kv_heads, head_dim)
    manager.attend(layer, batch, q)          # q: (0, num_q_heads, head_dim) -> (0, num_q_heads, head_dim)

Shapes used here: 2 layers, 2 kv heads, 4 query heads, head_dim 3, blocks of 4.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.managers import make_manager, manager_state, settle

from pagedkv import (
    Batch,
    ConfigError,
    InputTypeError,
    KVCacheManager,
    LayerIndexError,
    PagedKVError,
    SequenceStateError,
    ShapeError,
)
from pagedkv.integrations.interop import flashinfer_csr, slot_mapping

L, HKV, HQ, D = 2, 2, 4, 3
SHAPE: dict[str, Any] = {"num_layers": L, "num_kv_heads": HKV, "head_dim": D, "num_q_heads": HQ}
NOTHING = [{}, [], ()]


def running_manager(**options: Any) -> KVCacheManager:
    """Two sequences with written tokens (a: 6, b: 3), so an empty step has state to leave alone."""
    m = make_manager(8, **{**SHAPE, **options})
    m.add_sequence("a")
    m.add_sequence("b")
    settle(m, {"a": 6, "b": 3})
    return m


def no_kv() -> np.ndarray:
    return np.empty((0, HKV, D))


def no_queries() -> np.ndarray:
    return np.empty((0, HQ, D))


def step(m: KVCacheManager, request: dict[str, int], seed: int) -> list[np.ndarray]:
    """One reserve, write and attend of every layer; the attention outputs."""
    rng = np.random.default_rng(seed)
    batch = m.reserve(request)
    outs = []
    for layer in range(L):
        k, v = rng.standard_normal((2, batch.num_tokens, HKV, D))
        m.write(layer, batch, k, v)
        outs.append(m.attend(layer, batch, rng.standard_normal((batch.num_tokens, HQ, D))))
    return outs


@pytest.mark.parametrize("requests", NOTHING)
def test_reserve_of_nothing_returns_the_empty_batch_and_changes_nothing(requests: Any) -> None:
    m = running_manager()
    before = manager_state(m)
    batch = m.reserve(requests)
    assert isinstance(batch, Batch)
    assert (batch.num_seqs, batch.num_tokens) == (0, 0)
    assert batch.seq_ids == batch.num_new_tokens == batch.first_positions == batch.reservation_ids == ()
    assert batch.query_start.dtype == np.int64 and batch.query_start.tolist() == [0]
    assert batch.slot_mapping.dtype == np.int64 and batch.slot_mapping.shape == (0,)
    assert not batch.query_start.flags.writeable and not batch.slot_mapping.flags.writeable
    assert manager_state(m) == before
    m.check_invariants()


@pytest.mark.parametrize("requests", NOTHING)
def test_the_query_and_the_command_agree_on_nothing(requests: Any) -> None:
    # The scheduler loop with no running sequence: asked, answered True, done.
    m = running_manager()
    before = manager_state(m)
    plan = m.plan(requests)
    assert m.can_reserve(requests) is plan.fits is True
    assert (plan.num_new_blocks, plan.num_copy_on_write, plan.num_released_blocks) == (0, 0, 0)
    assert plan.num_free_blocks == m.pool.num_free_blocks and plan.steps == ()
    m.reserve(requests)
    assert manager_state(m) == before


def test_plan_of_nothing_still_counts_the_admissions() -> None:
    # block_size 4, 3 free blocks: a 9-token prompt takes 3 (fits), a 13-token one 4 (does not).
    m = make_manager(3, enable_prefix_caching=True)
    small, large = m.lookup(list(range(9))), m.lookup(list(range(13)))
    assert (small.num_new_blocks, large.num_new_blocks) == (3, 4)
    assert m.can_reserve({}, admit=[small]) is True
    assert m.plan({}, admit=[small]).num_new_blocks == 3
    assert m.can_reserve({}, admit=[large]) is False
    assert m.can_reserve([], admit=[large]) is False


@pytest.mark.parametrize("method", ["loop", "padded"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trusted", [False, True])
def test_the_empty_batch_is_written_and_attended_in_every_layer(
    method: str, dtype: Any, trusted: bool
) -> None:
    m = running_manager(dtype=dtype, trusted_inputs=trusted)
    expected_dtype = step(m, {"a": 1, "b": 1}, 0)[0].dtype  # what a real step's attend returns
    before = manager_state(m)
    batch = m.reserve({})
    for layer in range(L):
        m.write(layer, batch, no_kv().astype(dtype), no_kv().astype(dtype))
        out = m.attend(layer, batch, no_queries().astype(dtype), method=method)
        assert out.shape == (0, HQ, D) and out.dtype == expected_dtype
        assert m.attend(layer, batch, no_queries(), method=method, scale=0.5).shape == (0, HQ, D)
    assert manager_state(m) == before
    m.check_invariants()


def test_the_empty_batch_is_attended_over_a_quantized_pool() -> None:
    m = running_manager(key_dtype="int8", value_dtype="int8")
    expected_dtype = step(m, {"a": 1, "b": 1}, 0)[0].dtype
    before = manager_state(m)
    batch = m.reserve({})
    for layer in range(L):
        m.write(layer, batch, no_kv(), no_kv())
        for method in ("loop", "padded"):
            out = m.attend(layer, batch, no_queries(), method=method)
            assert out.shape == (0, HQ, D) and out.dtype == expected_dtype
    assert manager_state(m) == before


def test_an_empty_step_between_real_steps_changes_no_output() -> None:
    # Two identical managers; one runs an empty step between every real step.
    plain, padded = running_manager(), running_manager()
    for seed in range(3):
        empty = padded.reserve({})
        for layer in range(L):
            padded.write(layer, empty, no_kv(), no_kv())
            padded.attend(layer, empty, no_queries())
        for out, same in zip(step(plain, {"a": 1, "b": 2}, seed), step(padded, {"a": 1, "b": 2}, seed)):
            assert np.array_equal(out, same)
        assert manager_state(plain) == manager_state(padded)


def test_an_empty_step_leaves_a_pending_batch_pending() -> None:
    # b's batch is written in layer 0 only; an empty step in between does not disturb it.
    m = running_manager()
    pending = m.reserve({"b": 2})
    m.write(0, pending, np.ones((2, HKV, D)), np.ones((2, HKV, D)))
    empty = m.reserve({})
    for layer in range(L):
        m.write(layer, empty, no_kv(), no_kv())
    m.write(1, pending, np.ones((2, HKV, D)), np.ones((2, HKV, D)))
    assert m.attend(1, pending, np.ones((2, HQ, D))).shape == (2, HQ, D)
    m.check_invariants()


BAD_INPUTS = [
    # (what, call, error, message fragment)
    ("keys of one token", lambda m, b: m.write(0, b, np.ones((1, HKV, D)), np.ones((1, HKV, D))),
     ShapeError, r"keys must have shape .* = \(0, 2, 3\), got \(1, 2, 3\)"),
    ("values of one token", lambda m, b: m.write(0, b, no_kv(), np.ones((1, HKV, D))),
     ShapeError, r"values must have shape .* = \(0, 2, 3\), got \(1, 2, 3\)"),
    ("empty keys of the wrong heads", lambda m, b: m.write(0, b, np.empty((0, HQ, D)), no_kv()),
     ShapeError, r"keys must have shape .* = \(0, 2, 3\), got \(0, 4, 3\)"),
    ("queries of one token", lambda m, b: m.attend(0, b, np.ones((1, HQ, D))),
     ShapeError, r"queries must have shape .* = \(0, 4, 3\), got \(1, 4, 3\)"),
    ("empty queries of kv heads", lambda m, b: m.attend(0, b, np.empty((0, HKV, D)), method="padded"),
     ShapeError, r"queries must have shape .* = \(0, 4, 3\), got \(0, 2, 3\)"),
    ("a flat empty list", lambda m, b: m.attend(0, b, []), ShapeError, "must have 3 dimensions"),
    ("None", lambda m, b: m.write(0, b, None, no_kv()), InputTypeError, "keys must be a list or numpy array"),
    ("empty bools", lambda m, b: m.attend(0, b, np.empty((0, HQ, D), bool)), InputTypeError, "bools"),
    ("a bad layer to write", lambda m, b: m.write(L, b, no_kv(), no_kv()), LayerIndexError, str(L)),
    ("a bad layer to attend", lambda m, b: m.attend(-1, b, no_queries()), LayerIndexError, "-1"),
    ("an unknown method", lambda m, b: m.attend(0, b, no_queries(), method="flash"), ConfigError, "'flash'"),
]


@pytest.mark.parametrize(
    ("call", "error", "fragment"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_the_empty_batch_refuses_what_it_has_no_slot_for(
    call: Any, error: type[Exception], fragment: str
) -> None:
    m = running_manager()
    batch = m.reserve({})
    before = manager_state(m)
    with pytest.raises(error, match=fragment) as raised:
        call(m, batch)
    assert isinstance(raised.value, PagedKVError)
    assert manager_state(m) == before
    m.check_invariants()


def test_a_batch_of_no_sequence_but_some_tokens_is_refused() -> None:
    m = running_manager()
    by_hand = Batch((), (2,), (), np.array([0, 2]), np.array([0, 1]), ())
    before = manager_state(m)
    with pytest.raises(SequenceStateError, match=r"holds no sequence but \(2,\) new tokens"):
        m.write(0, by_hand, np.ones((2, HKV, D)), np.ones((2, HKV, D)))
    with pytest.raises(SequenceStateError, match="holds no sequence"):
        m.attend(0, by_hand, np.ones((2, HQ, D)))
    assert manager_state(m) == before


def test_the_empty_step_records_no_kv_event() -> None:
    m = make_manager(8, enable_prefix_caching=True, kv_events=True)
    m.add_sequence("a", list(range(6)))
    batch = m.reserve({"a": list(range(6))})
    m.write(0, batch, np.ones((6, 1, 1)), np.ones((6, 1, 1)))
    assert m.drain_kv_events()  # a's full block was stored
    before = manager_state(m)
    empty = m.reserve({})
    m.write(0, empty, np.empty((0, 1, 1)), np.empty((0, 1, 1)))
    assert m.attend(0, empty, np.empty((0, 1, 1))).shape == (0, 1, 1)
    assert m.drain_kv_events() == []
    assert manager_state(m) == before


def test_the_interop_exports_of_the_empty_batch_are_valid_empty_arrays() -> None:
    m = running_manager()
    batch = m.reserve({})
    csr = flashinfer_csr(m, batch.seq_ids)
    assert csr.kv_indptr.tolist() == [0]
    for array in (csr.kv_indices, csr.kv_last_page_len, csr.kv_first_page_offset):
        assert array.shape == (0,)
    for array in (csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, csr.kv_first_page_offset):
        assert array.dtype == np.int32
    slots = slot_mapping(m.block_table("a").block_ids, [], m.pool.block_size)
    assert slots.dtype == np.int64 and slots.shape == (0,)
    assert np.array_equal(slots, batch.slot_mapping)
