"""Regression tests named after the bugs in ``../shared/ANCHORS.md`` that apply to the serving core.

Each test reproduces the shape of the original report against
``KVCacheManager`` and asserts pagedkv's rule. Those for prefix caching (stale
hashes, cache hits after preemption, a prompt served whole from cache) live
with the prefix-cache tests.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.managers import make_manager, settle

from pagedkv import (
    DuplicateSequenceError,
    KVCacheManager,
    PoolExhaustedError,
    SequenceState,
    SequenceStateError,
    UnknownSequenceError,
)
from pagedkv.integrations.interop import flashinfer_csr
from pagedkv.testing.oracle import attend, within_tolerance


def free_queue_is_sane(m: KVCacheManager) -> None:
    free = m.pool.allocator.free_block_ids()
    assert len(free) == len(set(free)) == m.pool.num_free_blocks
    m.check_invariants()


# ------------------------------------------------------------- double free


def test_double_free_vllm_42571_second_free_is_refused_and_free_count_holds() -> None:
    # vLLM #42571 / sglang-jax PR #982: freeing twice inflated the free count.
    m = make_manager()
    m.add_sequence("a")
    settle(m, {"a": 6})
    m.free("a")
    assert m.pool.num_free_blocks == 8
    with pytest.raises(UnknownSequenceError, match="no sequence 'a'"):
        m.free("a")
    assert m.pool.num_free_blocks == 8
    free_queue_is_sane(m)


def test_double_free_vllm_42571_forks_and_preemption_release_each_block_once() -> None:
    # a and its two forks share blocks [0, 1]; every release path drops one
    # reference per table, never more: the queue never holds an id twice.
    m = make_manager(host_blocks=8)
    m.add_sequence("a")
    settle(m, {"a": 6})
    m.fork("a", "b")
    m.fork("a", "c")
    assert Counter(m.pool.allocator.ref_count(i) for i in (0, 1)) == Counter({3: 2})
    m.preempt("b")  # recompute: drops b's references
    free_queue_is_sane(m)
    m.free("b")  # b holds nothing now; freeing it returns nothing
    free_queue_is_sane(m)
    m.preempt("c", "swap")
    free_queue_is_sane(m)
    m.free("c")  # frees host blocks, not device blocks
    assert m.host_pool is not None and m.host_pool.num_free_blocks == 8
    assert m.pool.num_free_blocks == 6
    m.free("a")
    assert m.pool.num_free_blocks == 8
    free_queue_is_sane(m)


# ---------------------------------------------------- shared pages counted once


def test_shared_blocks_counted_once_sglang_35270_when_both_forks_evict_them() -> None:
    # SGLang #35270: shared pages counted twice as evictable.
    # block_size 4, max_size 3: a has 10 tokens, forked into b
    #   logical 1 [x x x t7] (shared)  logical 2 [t8 t9 . .] (shared, partial)
    # reserve({"a": 1, "b": 1}): token 10 sees 8..10, so both drop logical 1;
    # it is one block, released once. a copies the shared partial block, b
    # then owns it alone: 1 new block.
    m = make_manager(max_size=3)
    m.add_sequence("a")
    for _ in range(10):
        settle(m, {"a": 1})
    m.fork("a", "b")
    assert m.block_table("a").block_ids == m.block_table("b").block_ids
    free_before = m.pool.num_free_blocks
    plan = m.plan({"a": 1, "b": 1})
    assert (plan.num_released_blocks, plan.num_new_blocks, plan.num_copy_on_write) == (1, 1, 1)
    # one fork alone frees nothing: the other still holds the block
    assert m.plan({"a": 1}).num_released_blocks == 0
    settle(m, {"a": 1, "b": 1})
    assert m.pool.num_free_blocks == free_before + 1 - 1
    free_queue_is_sane(m)


def test_shared_blocks_counted_once_sglang_35270_fits_exactly_not_more() -> None:
    # The same state with no free block left but the one the pair releases:
    # it fits with exactly one block to spare for the copy; double counting
    # would also accept a request that needs two.
    m = make_manager(num_blocks=3, max_size=3)
    m.add_sequence("a")
    for _ in range(10):
        settle(m, {"a": 1})
    m.fork("a", "b")
    m.add_sequence("pad")
    settle(m, {"pad": 1})
    assert m.pool.num_free_blocks == 0
    assert m.plan({"a": 1, "b": 1}).fits
    assert not m.plan({"a": 1, "b": 3}).fits  # b's copy stays in place, then needs a block
    with pytest.raises(PoolExhaustedError, match="need 2 blocks, 1 free of 3"):
        m.reserve({"a": 1, "b": 3})
    settle(m, {"a": 1, "b": 1})
    free_queue_is_sane(m)


# ----------------------------------------------- identical requests, one step


def test_identical_requests_in_one_step_nano_vllm_219_get_their_own_blocks() -> None:
    # nano-vllm #219: identical prompts in one step got duplicate blocks.
    m = make_manager(num_blocks=16)
    for s in "abc":
        m.add_sequence(s)
    batch = m.reserve({"a": 5, "b": 5, "c": 5})
    slots = batch.slot_mapping.tolist()
    assert len(set(slots)) == len(slots) == 15
    tables = [m.block_table(s).block_ids for s in "abc"]
    assert len({b for t in tables for b in t}) == 6
    m.add_sequence("d")
    with pytest.raises(DuplicateSequenceError, match="appears twice"):
        m.reserve([("d", 1), ("d", 1)])
    m.check_invariants()


# --------------------------------------------------- preemption mid-prefill


def test_preemption_mid_prefill_nano_vllm_211_recompute_is_clean() -> None:
    # nano-vllm PR #211/#233: preempting a request mid-prefill broke indices.
    # a reserves a 7-token chunk, layer 0 writes it, layer 1 has not: recompute
    # preemption drops everything; after resume a fresh prefill is correct.
    m = make_manager(num_blocks=4, num_layers=2)
    m.add_sequence("a")
    batch = m.reserve({"a": 7})
    m.write(0, batch, np.ones((7, 1, 1)), np.ones((7, 1, 1)))
    m.preempt("a")
    assert m.pool.num_free_blocks == 4
    m.check_invariants()
    with pytest.raises(SequenceStateError, match="no longer reserved"):
        m.write(1, batch, np.ones((7, 1, 1)), np.ones((7, 1, 1)))
    m.resume("a")
    rng = np.random.default_rng(0)
    k, v, q = (rng.standard_normal((5, 1, 1)) for _ in range(3))
    batch = m.reserve({"a": 5})
    for layer in range(2):
        m.write(layer, batch, k, v)
        out = m.attend(layer, batch, q)
        for t in range(5):
            expected, peak = attend(q[t].tolist(), k[: t + 1].tolist(), v[: t + 1].tolist())
            assert within_tolerance(out[t].tolist(), expected, peak)
    m.check_invariants()


def test_preemption_mid_prefill_nano_vllm_233_swap_is_refused_until_settled() -> None:
    m = make_manager(num_blocks=4, num_layers=2, host_blocks=4)
    m.add_sequence("a")
    batch = m.reserve({"a": 7})
    m.write(0, batch, np.ones((7, 1, 1)), np.ones((7, 1, 1)))
    free = m.pool.allocator.free_block_ids()
    with pytest.raises(SequenceStateError, match=r"cannot swap out sequence 'a': layers \[1\]"):
        m.preempt("a", "swap")
    assert m.pool.allocator.free_block_ids() == free
    assert m.state("a") is SequenceState.RUNNING
    m.write(1, batch, np.ones((7, 1, 1)), np.ones((7, 1, 1)))
    m.preempt("a", "swap")
    m.resume("a")
    assert m.num_tokens("a") == 7
    m.check_invariants()


# ------------------------------------------------------------ window off-by-one


def _mean_position_attended(m: KVCacheManager, n: int) -> float:
    """Zero keys make the weights uniform; value = position, so the output is the mean position seen."""
    m.add_sequence("a")
    out = np.zeros(1)
    for position in range(n):
        batch = m.reserve({"a": 1})
        m.write(0, batch, np.zeros((1, 1, 1)), np.full((1, 1, 1), float(position)))
        out = m.attend(0, batch, np.ones((1, 1, 1)))
    return float(out.flat[0])


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 13])
@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_window_off_by_one_vllm_3385_attends_exactly_min_n_w_plus_sinks(
    window: int, n: int, sinks: int
) -> None:
    # vLLM #3385, HF #29623, mlx-lm PR #390, nano-vllm PR #65: max_size=W means
    # exactly min(n, W) window tokens, the new one included, plus the sinks.
    m = make_manager(num_blocks=16, max_size=window, num_sink_tokens=sinks)
    got = _mean_position_attended(m, n)
    last = n - 1
    seen = list(range(min(sinks, n))) + list(range(max(sinks, last - window + 1), n))
    assert len(seen) == min(sinks, n) + min(max(n - sinks, 0), window)
    assert got == pytest.approx(sum(seen) / len(seen), abs=1e-12)


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_window_off_by_one_chunked_prefill_masks_the_same_way(window: int) -> None:
    # one chunk of 9 tokens: token p sees max(0, p - W + 1) .. p
    m = make_manager(num_blocks=8, max_size=window)
    m.add_sequence("a")
    batch = m.reserve({"a": 9})
    values = np.arange(9, dtype=float).reshape(9, 1, 1)
    m.write(0, batch, np.zeros((9, 1, 1)), values)
    out = m.attend(0, batch, np.ones((9, 1, 1)))
    for p in range(9):
        seen = range(max(0, p - window + 1), p + 1)
        assert out[p, 0, 0] == pytest.approx(sum(seen) / len(seen), abs=1e-12)


# ------------------------------------------------ resumed, preempted at once


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_resumed_request_vllm_25538_is_not_preempted_again_when_plan_fits(mode: str) -> None:
    # vLLM #25538: resumed requests were preempted again at once. Here resume
    # then reserve must succeed whenever plan says it fits, even with no block
    # to spare.
    m = make_manager(num_blocks=4, host_blocks=4)
    for s in "ab":
        m.add_sequence(s)
    settle(m, {"a": 7, "b": 4})  # a [..][...] b [....]: 3 blocks, 1 free
    m.preempt("a", mode)
    settle(m, {"b": 4})  # b takes one of a's old blocks: 1 free
    m.resume("a")
    request = {"a": 1} if mode == "swap" else {"a": 8}
    plan = m.plan(request)
    assert plan.fits
    settle(m, request)  # no PoolExhaustedError, no preemption needed
    assert m.state("a") is SequenceState.RUNNING
    assert m.pool.num_free_blocks == 0
    assert m.metrics().num_preemptions == 1
    m.check_invariants()


def test_resume_after_swap_vllm_25538_fails_cleanly_when_it_cannot_fit() -> None:
    # the restore either fits whole or changes nothing (llama.cpp #27068: a
    # failed restore left corrupted K/V in the live cache)
    m = make_manager(num_blocks=3, host_blocks=3)
    for s in "ab":
        m.add_sequence(s)
    settle(m, {"a": 6})
    m.preempt("a", "swap")
    settle(m, {"b": 9})  # 3 blocks: none left
    host_free = m.host_pool.allocator.free_block_ids() if m.host_pool else None
    with pytest.raises(PoolExhaustedError, match="need 2 blocks, 0 free of 3"):
        m.resume("a")
    assert m.state("a") is SequenceState.SWAPPED
    assert m.host_pool is not None and m.host_pool.allocator.free_block_ids() == host_free
    m.free("b")
    m.resume("a")
    assert m.num_tokens("a") == 6
    m.check_invariants()


def test_restore_of_an_empty_sequence_llama_cpp_14434() -> None:
    # llama.cpp #14434: restoring an empty slot crashed
    m = make_manager(host_blocks=8)
    m.add_sequence("a")
    m.preempt("a", "swap")
    assert m.resume("a") == 0
    settle(m, {"a": 3})
    m.check_invariants()


# ------------------------------------------------------- last_page_len bound


@given(
    block_size=st.integers(1, 8),
    window=st.none() | st.integers(1, 10),
    sizes=st.lists(st.integers(1, 11), min_size=1, max_size=12),
)
def test_last_page_len_never_exceeds_page_size_flashinfer_320(
    block_size: int, window: int | None, sizes: list[int]
) -> None:
    # 160 blocks: the longest draw (block_size 1, twelve steps of 11 + 3) needs 156.
    m = make_manager(num_blocks=160, block_size=block_size, max_size=window)
    m.add_sequence("a")
    m.add_sequence("b")
    for i, size in enumerate(sizes):
        settle(m, {"a": size, "b": 1 + i % 3})
        csr = flashinfer_csr(m, ["a", "b"])
        assert np.all(csr.kv_last_page_len >= 1)
        assert np.all(csr.kv_last_page_len <= block_size)
        assert csr.kv_last_page_len.dtype == np.int32


# ------------------------------------------------------- usage metric confusion


def test_usage_metric_confusion_vllm_57336_reports_blocks_and_tokens_apart() -> None:
    # vLLM #57336 read 66.7% block usage as memory use while tokens filled far
    # less. 6 blocks of 4 slots:
    #   a  [a0 a1 a2 a3] [a4 . . .]          2 blocks, 5 slots
    #   b  [b0 . . .]                        1 block,  1 slot
    #   c  fork of a (shares both blocks)    0 blocks, 0 slots, 5 tokens
    #   d  [d0 d1 . .]                       1 block,  2 slots
    # block usage 4/6 = 66.7%; live slots 8 of 24 = 33.3%; of the used
    # blocks' 16 slots 8 are empty: fragmentation 50%; live tokens 13.
    m = make_manager(num_blocks=6)
    for s in "abd":
        m.add_sequence(s)
    settle(m, {"a": 5, "b": 1, "d": 2})
    m.fork("a", "c")
    x = m.metrics()
    assert x.block_usage == pytest.approx(4 / 6)
    assert x.token_occupancy == pytest.approx(8 / 24)
    assert x.internal_fragmentation == pytest.approx(0.5)
    assert (x.num_used_blocks, x.num_live_slots, x.num_live_tokens) == (4, 8, 13)
