"""Tests for ``pagedkv.manager.manager.KVCacheManager``: the serving core, hand-built cases first.

Block layouts are drawn with logical blocks left to right; ``[a0 a1 . .]`` is
a block of four slots holding tokens 0 and 1 of sequence ``a``. Every attend
output is checked against the naive oracle (``pagedkv.testing.oracle``) over
the sequence's own token history, and decode outputs (one new token, method
``"loop"``) bit for bit against ``pagedkv.reference.attend_window``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
import pytest
import support.managers
from hypothesis import given
from hypothesis import strategies as st
from support.managers import ceil_div
from support.windows import visible

from pagedkv import KVCacheManager, KVPool, PoolExhaustedError, SequenceState, SequenceStateError
from pagedkv.reference import attend_window
from pagedkv.testing.oracle import FLOAT32_EPS, FLOAT64_EPS, attend, within_tolerance

DTYPES = [np.float64, np.float32]

# ----------------------------------------------------------------- helpers


#: What most tests here run on: 32 blocks of 4, 2 layers, 4 query heads over 2 kv heads, head_dim 3.
make_manager = functools.partial(
    support.managers.make_manager,
    num_blocks=32,
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    num_q_heads=4,
    head_dim=3,
)


Arrays = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per layer: (k, v, q)


class Driver:
    """A manager plus every sequence's per-layer (k, v) history; checks each output.

    ``step`` reserves, then per layer writes and attends, and compares every
    output token with the oracle over that sequence's own visible history.
    """

    def __init__(self, manager: KVCacheManager, seed: int = 0) -> None:
        self.m = manager
        self.rng = np.random.default_rng(seed)
        self.hist: dict[Hashable, list[list[tuple[np.ndarray, np.ndarray]]]] = {}
        pool = manager.pool
        self.eps = FLOAT32_EPS if pool.dtype == np.float32 else FLOAT64_EPS

    @property
    def num_layers(self) -> int:
        return self.m.pool.num_layers

    def add(self, *seq_ids: Hashable) -> None:
        for seq_id in seq_ids:
            self.m.add_sequence(seq_id)
            self.hist[seq_id] = [[] for _ in range(self.num_layers)]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        self.m.fork(parent, child)
        self.hist[child] = [list(h) for h in self.hist[parent]]

    def forget(self, seq_id: Hashable) -> None:
        """After a recompute preemption the sequence starts again from nothing."""
        self.hist[seq_id] = [[] for _ in range(self.num_layers)]

    def arrays(self, num_tokens: int, rng: np.random.Generator | None = None) -> Arrays:
        rng = self.rng if rng is None else rng
        pool = self.m.pool
        kv = (num_tokens, pool.num_kv_heads, pool.head_dim)
        out = []
        for _ in range(self.num_layers):
            k = rng.standard_normal(kv).astype(pool.dtype)
            v = rng.standard_normal(kv).astype(pool.dtype)
            q = rng.standard_normal((num_tokens, self.m.num_q_heads, pool.head_dim)).astype(pool.dtype)
            out.append((k, v, q))
        return out

    def step(
        self,
        requests: Mapping[Hashable, int],
        *,
        method: str = "loop",
        arrays: Arrays | None = None,
    ) -> list[np.ndarray]:
        batch = self.m.reserve(requests)
        if arrays is None:
            arrays = self.arrays(batch.num_tokens)
        outs = []
        for layer, (k, v, q) in enumerate(arrays):
            self.m.write(layer, batch, k, v)
            out = self.m.attend(layer, batch, q, method=method)
            starts = batch.query_start
            for seq_id, lo, hi in zip(batch.seq_ids, starts[:-1], starts[1:]):
                self.hist[seq_id][layer].extend(zip(k[lo:hi], v[lo:hi]))
                self.check(seq_id, layer, q[lo:hi], out[lo:hi], method)
            outs.append(out)
        self.m.check_invariants()
        return outs

    def check(self, seq_id: Hashable, layer: int, q: np.ndarray, out: np.ndarray, method: str) -> None:
        hist = self.hist[seq_id][layer]
        window = self.m.layer_max_sizes[layer]
        first = len(hist) - len(q)
        for t in range(len(q)):
            position = first + t
            seen = visible(position, self.m.num_sink_tokens, window)
            keys = [hist[j][0] for j in seen]
            values = [hist[j][1] for j in seen]
            expected, peak = attend(
                q[t].tolist(), [x.tolist() for x in keys], [x.tolist() for x in values], self.m.scale
            )
            assert within_tolerance(out[t].tolist(), expected, peak, self.eps), (
                f"oracle mismatch: seq {seq_id!r} layer {layer} position {position}: {out[t]} vs {expected}"
            )
            if len(q) == 1 and method == "loop":
                exact = attend_window(q[t], keys, values, scale=self.m.scale, dtype=self.m.pool.dtype)
                assert np.array_equal(exact, out[t]), (seq_id, layer, position, out[t], exact)


def held(manager: KVCacheManager) -> Counter[int]:
    """How many running tables hold each block id."""
    return Counter(
        block_id
        for seq_id in manager.seq_ids
        if manager.state(seq_id) is SequenceState.RUNNING
        for block_id in manager.block_table(seq_id).block_ids
    )


def refs(manager: KVCacheManager) -> list[int]:
    allocator = manager.pool.allocator
    return [allocator.ref_count(i) for i in range(allocator.num_blocks)]


# ------------------------------------------------------ chunked prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "sinks"), [(None, 0), (3, 0), (5, 2), (1, 0), (2, 1)], ids=lambda x: str(x)
)
@pytest.mark.parametrize("chunks", [(11,), (3, 5, 3), (4, 4, 3), (1, 9, 1), (2, 2, 2, 2, 2, 1)], ids=str)
def test_chunked_prefill_equals_one_token_at_a_time(
    chunks: tuple[int, ...], window: int | None, sinks: int, dtype: Any
) -> None:
    # block_size 4, 11 prompt tokens, chunk (3, 5, 3):
    #   chunk 1   [p0 p1 p2 . ]
    #   chunk 2   [p0 p1 p2 p3] [p4 p5 p6 p7]
    #   chunk 3   [p0 p1 p2 p3] [p4 p5 p6 p7] [p8 p9 p10 .]
    # each prompt token attends causally (window and sinks applied) exactly as
    # if fed alone; the three decode steps after it are bit-exact.
    kw = dict(max_size=window, num_sink_tokens=sinks, dtype=dtype)
    chunked, single = Driver(make_manager(**kw)), Driver(make_manager(**kw))
    chunked.add("a")
    single.add("a")
    prompt = chunked.arrays(sum(chunks), np.random.default_rng(7))
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    start = 0
    for size in chunks:
        part = [
            (k[start : start + size], v[start : start + size], q[start : start + size]) for k, v, q in prompt
        ]
        outs_chunked = chunked.step({"a": size}, arrays=part)
        for t in range(size):
            token = [(k[t : t + 1], v[t : t + 1], q[t : t + 1]) for k, v, q in part]
            outs_single = single.step({"a": 1}, arrays=token)
            # both are within the oracle tolerance (Driver.check); so of each other
            for layer in range(2):
                np.testing.assert_allclose(
                    outs_chunked[layer][t], outs_single[layer][0], rtol=rtol, atol=rtol
                )
        start += size
    assert chunked.m.num_tokens("a") == single.m.num_tokens("a") == sum(chunks)
    decode_rng_a, decode_rng_b = np.random.default_rng(99), np.random.default_rng(99)
    for _ in range(3):
        outs_a = chunked.step({"a": 1}, arrays=chunked.arrays(1, decode_rng_a))
        outs_b = single.step({"a": 1}, arrays=single.arrays(1, decode_rng_b))
        for a, b in zip(outs_a, outs_b):
            assert np.array_equal(a, b)


@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    block_size=st.integers(1, 5),
    window=st.none() | st.integers(1, 8),
    sinks=st.integers(0, 3),
)
def test_chunked_prefill_of_any_sizes_matches_the_oracle(
    chunks: list[int], block_size: int, window: int | None, sinks: int
) -> None:
    driver = Driver(
        make_manager(num_blocks=64, block_size=block_size, max_size=window, num_sink_tokens=sinks),
        seed=len(chunks),
    )
    driver.add("a")
    for size in [*chunks, 1, 1]:
        driver.step({"a": size})  # checks every token against the oracle


# ------------------------------------------------- all-or-nothing reserve


def test_reservation_takes_exactly_the_planned_blocks_or_nothing() -> None:
    # block_size 4, 4 blocks:
    #   a  [a0 a1 a2 a3] [a4 a5 . .]      2 blocks
    #   b  [b0 b1 b2 . ]                  1 block
    #   free: 1 block
    driver = Driver(make_manager(num_blocks=4))
    m = driver.m
    driver.add("a", "b")
    driver.step({"a": 6, "b": 3})
    assert m.pool.num_free_blocks == 1
    # {"a": 2, "b": 2}: a fills its last block (0 new), b needs 1 -> fits exactly
    plan = m.plan({"a": 2, "b": 2})
    assert (plan.fits, plan.num_new_blocks, plan.num_free_blocks, plan.num_released_blocks) == (True, 1, 1, 0)
    # {"a": 3, "b": 2}: a needs 1, b needs 1 -> 2 > 1 free: refused whole
    plan = m.plan({"a": 3, "b": 2})
    assert (plan.fits, plan.num_new_blocks) == (False, 2)
    assert not m.can_reserve({"a": 3, "b": 2})
    before = (
        m.pool.allocator.free_block_ids(),
        refs(m),
        m.block_table("a").block_ids,
        m.block_table("b").block_ids,
    )
    with pytest.raises(PoolExhaustedError, match="need 2 blocks, 1 free of 4"):
        m.reserve({"a": 3, "b": 2})
    after = (
        m.pool.allocator.free_block_ids(),
        refs(m),
        m.block_table("a").block_ids,
        m.block_table("b").block_ids,
    )
    assert after == before
    assert (m.num_tokens("a"), m.num_tokens("b")) == (6, 3)
    m.check_invariants()
    driver.step({"a": 2, "b": 2})  # the fitting one works, outputs checked
    assert m.pool.num_free_blocks == 0


def test_reserve_uses_blocks_a_later_sequence_releases() -> None:
    # block_size 2, window 3, 4 blocks, none free:
    #   a  [a0 a1]                      next token a2 needs a new block, frees none
    #   b  [b0 b1] [b2 b3] [b4 . ]      next token b5 sees b3..b5: block 0 goes back
    # reserve({"a": 1, "b": 1}) must evict b's block before a allocates (the
    # plan counts it); interleaving per sequence raised PoolExhaustedError.
    driver = Driver(make_manager(num_blocks=4, block_size=2, max_size=3))
    m = driver.m
    driver.add("z", "a", "b")
    driver.step({"a": 2})
    driver.step({"b": 5})
    plan = m.plan({"a": 1, "b": 1})
    assert (plan.fits, plan.num_new_blocks, plan.num_released_blocks, plan.num_free_blocks) == (True, 1, 1, 0)
    driver.step({"a": 1, "b": 1})
    assert m.pool.num_free_blocks == 0
    assert len(m.block_table("b").block_ids) == 2


@st.composite
def manager_states(draw: st.DrawFn) -> tuple[Driver, dict[str, int]]:
    """A manager after a few random steps and forks, and a request to plan."""
    window = draw(st.none() | st.integers(1, 6))
    sinks = draw(st.integers(0, 2))
    block_size = draw(st.integers(1, 4))
    driver = Driver(
        make_manager(
            num_blocks=draw(st.integers(4, 24)),
            block_size=block_size,
            max_size=window,
            num_sink_tokens=sinks,
            num_layers=1,
            head_dim=1,
            num_kv_heads=1,
            num_q_heads=1,
        )
    )
    driver.add("s0")
    names = ["s0"]
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.booleans()):
            parent = draw(st.sampled_from(names))
            child = f"s{len(names)}"
            driver.fork(parent, child)
            names.append(child)
        else:
            chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
            request = {s: draw(st.integers(1, 4)) for s in chosen}
            if driver.m.can_reserve(request):
                driver.step(request)
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    return driver, {s: draw(st.integers(1, 6)) for s in chosen}


@given(manager_states())
def test_plan_predicts_exactly_what_reserve_takes_and_releases(state: tuple[Driver, dict[str, int]]) -> None:
    driver, request = state
    m = driver.m
    plan = m.plan(request)
    held_before, free_before = held(m), m.pool.num_free_blocks
    assert plan.num_free_blocks == free_before
    if not plan.fits:
        with pytest.raises(PoolExhaustedError):
            m.reserve(request)
        assert held(m) == held_before and m.pool.num_free_blocks == free_before
        return
    driver.step(request)
    held_after = held(m)
    taken = set(held_after) - set(held_before)  # ids no table held before
    released = set(held_before) - set(held_after)  # ids no table holds any more
    # A block released by this reservation can be taken again by it (when the
    # pool has nothing else free); it then shows in neither set.
    reused = plan.num_released_blocks - len(released)
    assert 0 <= reused <= plan.num_new_blocks
    assert len(taken) + reused == plan.num_new_blocks
    assert m.pool.num_free_blocks == free_before + len(released) - len(taken)
    assert free_before + plan.num_released_blocks - m.pool.num_free_blocks == plan.num_new_blocks


# --------------------------------------------------------------- windows


def test_blocks_wholly_outside_the_window_are_freed_at_reserve() -> None:
    # block_size 2, max_size 4, 8 tokens written; reserving token 8:
    #   logical    0     1     2     3     4
    #   before   [0 1] [2 3] [4 5] [6 7]
    #   token 8 sees 5..8 -> blocks 0 and 1 lie wholly before 5: back at once
    #   after           .     .  [4 5] [6 7] [8 .]   (4 is evicted but shares a block with 5)
    driver = Driver(make_manager(num_blocks=8, block_size=2, max_size=4))
    m = driver.m
    driver.add("a")
    driver.step({"a": 8})
    old = m.block_table("a").block_ids
    assert old == [0, 1, 2, 3]
    plan = m.plan({"a": 1})
    assert (plan.num_released_blocks, plan.num_new_blocks) == (2, 1)
    driver.step({"a": 1})
    table = m.block_table("a")
    assert table.block_ids == [2, 3, 4]
    assert table.window_start == 5
    # freed ids went to the tail of the free queue, newest first (as free() and
    # vLLM free), before the new block was taken
    assert m.pool.allocator.free_block_ids() == [5, 6, 7, 1, 0]
    for _ in range(6):
        driver.step({"a": 1})
        assert m.block_table("a").num_blocks <= 3  # ceil((W - 1) / bs) + 1


def test_per_layer_windows_free_by_the_largest_and_attend_by_their_own() -> None:
    # layer 0 window 2, layer 1 window 5: blocks are freed by 5 (layer 1 still
    # needs them); each layer attends to its own window (checked by the oracle).
    driver = Driver(make_manager(num_blocks=16, block_size=2, layer_max_sizes=(2, 5)))
    m = driver.m
    assert m.max_size == 5
    driver.add("a")
    driver.step({"a": 3})
    for _ in range(12):
        driver.step({"a": 1})
        n = m.num_tokens("a")
        assert m.block_table("a").window_start == max(0, n - 5)
    # an unbounded layer keeps every block
    unbounded = Driver(make_manager(num_blocks=16, block_size=2, layer_max_sizes=(3, None)))
    assert unbounded.m.max_size is None
    unbounded.add("a")
    for size in (4, 1, 3, 1):
        unbounded.step({"a": size})
    assert unbounded.m.block_table("a").num_blocks == 5


def _positions_attended(manager: KVCacheManager, driver_seq: str, layer: int, n: int) -> float:
    """Feed ``n`` tokens with zero keys and value = position; return the last output (the mean)."""
    pool = manager.pool
    manager.add_sequence(driver_seq)
    out = None
    for position in range(n):
        batch = manager.reserve({driver_seq: 1})
        for lay in range(pool.num_layers):
            k = np.zeros((1, pool.num_kv_heads, pool.head_dim))
            v = np.full((1, pool.num_kv_heads, pool.head_dim), float(position))
            manager.write(lay, batch, k, v)
            got = manager.attend(lay, batch, np.ones((1, manager.num_q_heads, pool.head_dim)))
            if lay == layer:
                out = got
    assert out is not None
    assert np.all(out == out.flat[0])
    return float(out.flat[0])


@pytest.mark.parametrize(("window", "sinks"), [(1, 0), (3, 0), (3, 2), (4, 1), (2, 3)])
def test_windowed_sequence_with_sinks_attends_exactly_sinks_plus_window(window: int, sinks: int) -> None:
    # zero keys -> uniform weights, so the output is the mean of the attended
    # positions: sinks 0..S-1 plus the W newest, 20 tokens in:
    #   S = 2, W = 3, p = 19:   [0 1] 2 ... 16 [17 18 19]   -> mean (0+1+17+18+19)/5
    m = make_manager(num_blocks=16, block_size=2, max_size=window, num_sink_tokens=sinks)
    n = 20
    got = _positions_attended(m, "a", 0, n)
    seen = list(range(sinks)) + list(range(max(sinks, n - window), n))
    assert got == pytest.approx(sum(seen) / len(seen), abs=1e-12)
    table = m.block_table("a")
    # the sink block(s) are kept forever, window blocks slide
    num_sink_blocks = ceil_div(sinks, 2)
    assert table.num_blocks <= num_sink_blocks + ceil_div(window - 1, 2) + 1
    assert table.block_ids[:num_sink_blocks] == list(range(num_sink_blocks))


def test_sink_blocks_are_never_freed() -> None:
    # block_size 2, 3 sinks, window 1: logical blocks 0 and 1 hold the sinks
    #   [s0 s1] [s2 x] . . . . [x 39]
    driver = Driver(make_manager(num_blocks=6, block_size=2, max_size=1, num_sink_tokens=3))
    m = driver.m
    driver.add("a")
    driver.step({"a": 2})
    sinks = m.block_table("a").block_ids[:1]
    for _ in range(38):
        driver.step({"a": 1})
    table = m.block_table("a")
    assert table.block_ids[:2][0] == sinks[0]
    assert table.num_blocks == 3
    assert m.metrics().num_live_tokens == 3 + 1


# ------------------------------------------------------------------ forks


def test_eight_way_fork_costs_no_blocks_until_divergence() -> None:
    # block_size 4, a has 6 tokens:   a [a0 a1 a2 a3] [a4 a5 . .]   ids 0, 1
    # fork 7 children: every table is [0, 1], ref counts 8 and 8, no block taken
    driver = Driver(make_manager(num_blocks=20))
    m = driver.m
    driver.add("a")
    driver.step({"a": 6})
    free_before = m.pool.num_free_blocks
    children = [f"c{i}" for i in range(7)]
    for child in children:
        driver.fork("a", child)
    assert m.pool.num_free_blocks == free_before
    assert m.pool.allocator.ref_count(0) == m.pool.allocator.ref_count(1) == 8
    assert all(m.block_table(c).block_ids == [0, 1] for c in children)
    assert m.metrics().num_forks == 7
    m.check_invariants()
    # all eight append one token: 7 copy the shared partial block, the last
    # one to go owns block 1 alone and appends in place
    everyone = {"a": 1, **dict.fromkeys(children, 1)}
    plan = m.plan(everyone)
    assert (plan.num_new_blocks, plan.num_copy_on_write) == (7, 7)
    driver.step(everyone)  # each sees only its own token 6 (oracle per sequence)
    assert m.pool.num_free_blocks == free_before - 7
    assert m.pool.allocator.ref_count(0) == 8
    assert m.pool.allocator.ref_count(1) == 1
    assert m.metrics().num_copy_on_write == 7
    for _ in range(3):
        driver.step(everyone)


def test_first_append_to_a_shared_partial_block_copies_it() -> None:
    # a [a0 a1 a2 a3] [a4 a5 . .]  -- fork -> b shares both blocks
    # b appends b6: block 1 is shared and partial -> copied to block 2 first
    #   a [0: a0..a3] [1: a4 a5 .  . ]
    #   b [0: a0..a3] [2: a4 a5 b6 . ]
    # then a appends a6 into block 1 in place (no longer shared)
    driver = Driver(make_manager(num_blocks=8))
    m = driver.m
    driver.add("a")
    driver.step({"a": 6})
    driver.fork("a", "b")
    plan = m.plan({"b": 1})
    assert (plan.num_copy_on_write, plan.num_new_blocks) == (1, 1)
    driver.step({"b": 1})
    assert m.block_table("a").block_ids == [0, 1]
    assert m.block_table("b").block_ids == [0, 2]
    np.testing.assert_array_equal(m.pool.keys(1)[:, 2, :2], m.pool.keys(1)[:, 1, :2])
    assert m.plan({"a": 1}).num_copy_on_write == 0
    driver.step({"a": 1})
    # neither sees the other's later tokens (checked per sequence by the oracle)
    for _ in range(4):
        driver.step({"a": 1, "b": 1})
    assert m.metrics().num_copy_on_write == 1


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    driver = Driver(make_manager(num_blocks=8))
    m = driver.m
    driver.add("a")
    driver.step({"a": 8})  # [a0..a3] [a4..a7]: both full
    driver.fork("a", "b")
    plan = m.plan({"a": 1, "b": 1})
    assert (plan.num_copy_on_write, plan.num_new_blocks) == (0, 2)
    driver.step({"a": 1, "b": 1})
    assert m.block_table("a").block_ids[:2] == m.block_table("b").block_ids[:2] == [0, 1]


def test_freeing_the_parent_leaves_children_intact() -> None:
    driver = Driver(make_manager(num_blocks=8, max_size=6))
    m = driver.m
    driver.add("a")
    driver.step({"a": 5})
    driver.fork("a", "b")
    driver.fork("a", "c")
    driver.step({"a": 1, "b": 2})
    m.free("a")
    del driver.hist["a"]
    m.check_invariants()
    for _ in range(6):
        driver.step({"b": 1, "c": 1})
    m.free("b")
    m.free("c")
    assert m.pool.num_free_blocks == 8
    m.check_invariants()


# ------------------------------------------------------- free and preempt


def test_free_returns_blocks_tail_first() -> None:
    # block_size 2, a takes 5 tokens:  [0: a0 a1] [1: a2 a3] [2: a4 .]
    # free queue before: [3 4 5 6 7]   after free(a): [3 4 5 6 7 2 1 0]
    driver = Driver(make_manager(num_blocks=8, block_size=2))
    m = driver.m
    driver.add("a", "b")
    driver.step({"a": 5})
    assert m.block_table("a").block_ids == [0, 1, 2]
    assert m.pool.allocator.free_block_ids() == [3, 4, 5, 6, 7]
    m.free("a")
    assert m.pool.allocator.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert "a" not in m and m.seq_ids == ["b"]
    # a recompute preemption returns them tail first too
    driver.step({"b": 3})  # takes 3, 4
    m.preempt("b")
    assert m.pool.allocator.free_block_ids()[-2:] == [4, 3]
    m.check_invariants()


@pytest.mark.parametrize("dtype", DTYPES)
def test_preempt_recompute_then_refeed_gives_outputs_of_never_preempted(dtype: Any) -> None:
    # twin managers get the same tokens; one preempts "a" (recompute), resumes
    # it empty, and the caller re-feeds a's tokens as one chunk. Decode steps
    # after that are bit-identical to the twin's.
    kw = dict(num_blocks=10, max_size=7, num_sink_tokens=1, dtype=dtype)
    twin, driver = Driver(make_manager(**kw)), Driver(make_manager(**kw))
    for d in (twin, driver):
        d.add("a", "b")
    rng_twin, rng = np.random.default_rng(3), np.random.default_rng(3)
    for size in (5, 1, 1, 3, 1):
        twin.step({"a": size, "b": 1}, arrays=twin.arrays(size + 1, rng_twin))
        driver.step({"a": size, "b": 1}, arrays=driver.arrays(size + 1, rng))
    history = driver.hist["a"]
    m = driver.m
    m.preempt("a")
    assert m.state("a") is SequenceState.PREEMPTED
    assert m.block_table("a").num_blocks == 0 and m.num_tokens("a") == 0
    m.check_invariants()
    assert m.resume("a") == 0
    driver.forget("a")
    n = len(history[0])
    refeed = [
        (np.array([k for k, _ in layer]), np.array([v for _, v in layer]), driver.arrays(n)[0][2])
        for layer in history
    ]
    driver.step({"a": n}, arrays=refeed)
    for _ in range(5):
        arrays_twin, arrays = twin.arrays(2, rng_twin), driver.arrays(2, rng)
        outs_twin = twin.step({"a": 1, "b": 1}, arrays=arrays_twin)
        outs = driver.step({"a": 1, "b": 1}, arrays=arrays)
        for a, b in zip(outs_twin, outs):
            assert np.array_equal(a, b)
    assert m.metrics().num_preemptions == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (5, 2)])
def test_swap_restores_into_other_blocks_with_identical_outputs(
    dtype: Any, window: int | None, sinks: int
) -> None:
    # "a" is swapped out, "b" takes the blocks it freed, "a" comes back into
    # whatever blocks are free then; every later output equals, bit for bit,
    # a twin manager that never swapped.
    kw = dict(num_blocks=12, host_blocks=6, max_size=window, num_sink_tokens=sinks, dtype=dtype)
    twin, driver = Driver(make_manager(**kw)), Driver(make_manager(**kw))
    for d in (twin, driver):
        d.add("a", "b")
    rng_twin, rng = np.random.default_rng(5), np.random.default_rng(5)

    def both(request: dict[str, int], *, compare: bool = True) -> None:
        n = sum(request.values())
        outs_twin = twin.step(request, arrays=twin.arrays(n, rng_twin))
        outs = driver.step(request, arrays=driver.arrays(n, rng))
        if compare:
            for a, b in zip(outs_twin, outs):
                assert np.array_equal(a, b)

    both({"a": 6, "b": 2})
    both({"a": 1, "b": 1})
    m = driver.m
    before = m.block_table("a").block_ids
    m.preempt("a", "swap")
    assert m.state("a") is SequenceState.SWAPPED
    assert m.metrics().num_host_used_blocks == len(before)
    m.check_invariants()
    # b grows into the freed blocks on the swapped side only
    driver.step({"b": 9}, arrays=driver.arrays(9, np.random.default_rng(1)))
    twin.step({"b": 9}, arrays=twin.arrays(9, np.random.default_rng(1)))
    assert m.resume("a") == m.num_tokens("a") == 7
    after = m.block_table("a").block_ids
    assert after != before
    assert m.metrics().num_host_used_blocks == 0
    m.check_invariants()
    for _ in range(4):
        both({"a": 1, "b": 1})
    metrics = m.metrics()
    assert (metrics.num_swaps_out, metrics.num_swaps_in, metrics.num_preemptions) == (1, 1, 1)


def test_swap_in_from_host_blocks_out_of_id_order_gives_identical_outputs() -> None:
    # A host pool of 4 blocks (block_size 4). x swaps out to host [0, 1] and y
    # to host [2]; freeing x gives its host blocks back tail first:
    #   host free [3, 1, 0]
    # so z (10 tokens, 3 blocks) swaps out to host [3, 1, 0], its logical
    # blocks in decreasing host ids. Swapping in must bring each back to its own
    # logical block: every later output equals, bit for bit, a twin manager
    # that never swapped.
    twin, driver = Driver(make_manager(num_blocks=12)), Driver(make_manager(num_blocks=12, host_blocks=4))
    for d in (twin, driver):
        d.add("x", "y", "z")
    rng_twin, rng = np.random.default_rng(8), np.random.default_rng(8)

    def both(request: dict[str, int]) -> None:
        n = sum(request.values())
        outs_twin = twin.step(request, arrays=twin.arrays(n, rng_twin))
        outs = driver.step(request, arrays=driver.arrays(n, rng))
        for a, b in zip(outs_twin, outs):
            assert np.array_equal(a, b)

    both({"x": 8, "y": 4, "z": 10})
    m = driver.m
    assert m.host_pool is not None
    m.preempt("x", "swap")
    m.preempt("y", "swap")
    m.free("x")
    twin.m.free("x")
    assert m.host_pool.allocator.free_block_ids() == [3, 1, 0]
    m.preempt("z", "swap")
    assert m.block_table("z").block_ids == [3, 1, 0]  # host ids, out of order
    assert m.resume("z") == 10
    m.check_invariants()
    for _ in range(3):
        both({"z": 1})
    assert m.metrics().num_swaps_in == 1


# ------------------------------------------------------ padded vs loop, GQA


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (4, 0), (6, 2)])
@pytest.mark.parametrize(("num_kv_heads", "num_q_heads"), [(1, 1), (2, 4), (2, 2), (1, 3)])
def test_padded_equals_loop_within_tolerance(
    dtype: Any, window: int | None, sinks: int, num_kv_heads: int, num_q_heads: int
) -> None:
    kw = dict(
        num_blocks=40,
        max_size=window,
        num_sink_tokens=sinks,
        dtype=dtype,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_q_heads,
    )
    loop, padded = Driver(make_manager(**kw)), Driver(make_manager(**kw))
    names = ["a", "b", "c", "d"]
    for d in (loop, padded):
        d.add(*names)
    rng_loop, rng_padded = np.random.default_rng(11), np.random.default_rng(11)
    prompt = {"a": 1, "b": 3, "c": 9, "d": 5}
    loop.step(prompt, arrays=loop.arrays(18, rng_loop))
    padded.step(prompt, arrays=padded.arrays(18, rng_padded))
    for _ in range(6):
        request = dict.fromkeys(names, 1)
        outs_loop = loop.step(request, arrays=loop.arrays(4, rng_loop))
        outs_padded = padded.step(request, method="padded", arrays=padded.arrays(4, rng_padded))
        for a, b in zip(outs_loop, outs_padded):
            assert a.shape == b.shape == (4, num_q_heads, 3)
            np.testing.assert_allclose(b, a, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
    # a batch with a chunk falls back to the loop kernel and is still right
    padded.step({"a": 3, "b": 1}, method="padded")


def test_gqa_query_heads_read_their_kv_head() -> None:
    # 2 kv heads, 4 query heads: heads 0, 1 read kv head 0; heads 2, 3 kv head 1.
    # keys zero -> uniform weights; values: kv head 0 holds 1.0, kv head 1 holds 2.0
    m = make_manager(num_blocks=4, num_kv_heads=2, num_q_heads=4, head_dim=2, num_layers=1)
    m.add_sequence("a")
    batch = m.reserve({"a": 3})
    k = np.zeros((3, 2, 2))
    v = np.stack([np.ones((3, 2)), 2 * np.ones((3, 2))], axis=1)
    m.write(0, batch, k, v)
    out = m.attend(0, batch, np.ones((3, 4, 2)))
    assert out.shape == (3, 4, 2)
    np.testing.assert_array_equal(out[:, :2], 1.0)
    np.testing.assert_array_equal(out[:, 2:], 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_keep_the_pool_dtype(dtype: Any) -> None:
    driver = Driver(make_manager(dtype=dtype, scale=0.5))
    driver.add("a", "b")
    outs = driver.step({"a": 4, "b": 1})
    assert all(out.dtype == np.dtype(dtype) for out in outs)
    outs = driver.step({"a": 1, "b": 1}, method="padded")
    assert all(out.dtype == np.dtype(dtype) for out in outs)


def test_many_sequences_in_one_batch_each_see_only_their_own_tokens() -> None:
    driver = Driver(make_manager(num_blocks=64, block_size=3, max_size=5, num_sink_tokens=1), seed=4)
    names = [f"s{i}" for i in range(6)]
    driver.add(*names)
    driver.step({s: i + 1 for i, s in enumerate(names)})
    for step in range(5):
        driver.step({s: 1 + (i + step) % 3 for i, s in enumerate(names)})
    driver.m.check_invariants()


def test_check_truncate_refuses_what_truncate_refuses_and_changes_nothing() -> None:
    manager = KVCacheManager(KVPool(8, block_size=2, head_dim=1), max_size=2)
    manager.add_sequence("a")
    for n in (6, 1):
        batch = manager.reserve({"a": n})
        manager.write(0, batch, np.ones((n, 1, 1)), np.ones((n, 1, 1)))
    def state() -> tuple[int, list[int], int]:
        return manager.num_tokens("a"), manager.block_table("a").block_ids, manager.pool.num_free_blocks

    before = state()
    for call in (manager.check_truncate, manager.truncate):
        with pytest.raises(SequenceStateError, match="already left the"):
            call("a", 2)  # token 2 would attend to token 1, long evicted
    assert state() == before
    manager.check_truncate("a", 6)  # token 6 sees 5..6: still held
    assert manager.num_tokens("a") == 7
