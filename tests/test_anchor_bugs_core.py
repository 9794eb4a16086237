"""Regression tests named after bugs the anchor projects shipped (see ANCHORS.md).

Only the bugs that apply to the core (allocator, block table, ``KVCache``) are
here; prefix caching, preemption and snapshots have their own files.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import ceil_div

from pagedkv import KVCache, KVPool, reference
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import DoubleFreeError, NonFiniteError, UnknownBlockError


def attended_count(out: float, num_tokens: int) -> int:
    """How many tokens an output averaged, for zero keys and value ``i`` at index ``i``.

    Zero keys give equal weights, so the output is the mean of the window's
    indices, ``(start + n - 1) / 2``; the window is ``n - start`` long.
    """
    start = round(2 * out - (num_tokens - 1))
    return num_tokens - start


# ----------------------------------------- window off-by-one (vLLM #3385, ...)

WINDOWS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17]


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
@pytest.mark.parametrize("max_size", WINDOWS)
def test_window_off_by_one_vllm_3385_hf_29623_each_output_sees_min_n_w_tokens(
    max_size: int, block_size: int
) -> None:
    # Around the wrap-around (n = W - 1, W, W + 1) and across many block
    # boundaries: three windows' worth plus two blocks.
    pool = KVPool(ceil_div(max_size, block_size) + 1, block_size=block_size, head_dim=1)
    cache = KVCache(max_size, pool=pool)
    for n in range(1, 3 * max_size + 2 * block_size + 1):
        out = cache.attend([1.0], [0.0], [float(n - 1)])[0]
        assert attended_count(out, n) == min(n, max_size), f"after {n} tokens"
        assert len(cache) == min(n, max_size)
        assert cache.values()[:, 0].tolist() == [float(i) for i in range(max(0, n - max_size), n)]


def test_window_off_by_one_hf_pr_47708_at_wrap_around_the_new_token_counts() -> None:
    # max_size 4, block_size 4: at n = 4 the window is exactly one full block;
    # at n = 5 index 0 must already be gone (evict before scoring, new token included).
    cache = KVCache(max_size=4, block_size=4)
    outputs = [cache.attend([0.0], [0.0], [1e3 if i == 0 else 1.0])[0] for i in range(6)]
    assert outputs[3] == pytest.approx((1e3 + 3) / 4, rel=1e-14)
    assert outputs[4] == 1.0
    assert outputs[5] == 1.0


# ------------------------------------ double free (vLLM #42571, sglang-jax #982)


def test_double_free_vllm_42571_does_not_inflate_the_free_count() -> None:
    alloc = BlockAllocator(4)
    block_ids = alloc.allocate(2)
    alloc.free(block_ids)
    assert alloc.num_free_blocks == 4
    with pytest.raises(DoubleFreeError):
        alloc.free([block_ids[0]])
    with pytest.raises(DoubleFreeError):
        alloc.free_one(block_ids[1])
    assert alloc.num_free_blocks == 4
    # Were a block queued twice, it would be handed out twice.
    handed_out = alloc.allocate(4)
    assert sorted(handed_out) == [0, 1, 2, 3]
    alloc.check_invariants()


def test_double_free_sglang_jax_982_inside_one_call_does_not_inflate_the_free_count() -> None:
    alloc = BlockAllocator(3)
    [block_id] = alloc.allocate(1)
    with pytest.raises(DoubleFreeError, match="freed 2 times"):
        alloc.free([block_id, block_id])
    assert (alloc.num_free_blocks, alloc.ref_count(block_id)) == (2, 1)


def test_freeing_an_unknown_id_is_refused_and_changes_nothing() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(2)
    for bad in (3, -1, 100):
        with pytest.raises(UnknownBlockError, match=f"block id {bad}"):
            alloc.free([0, bad])
    assert (alloc.num_free_blocks, alloc.ref_count(0), alloc.ref_count(1)) == (1, 1, 1)


# -------------------------------- shared pages counted twice (SGLang #35270)


def test_shared_block_counted_once_sglang_35270() -> None:
    alloc = BlockAllocator(3)
    [block_id] = alloc.allocate(1)
    alloc.share([block_id])  # two block tables hold it
    alloc.free([block_id])
    assert alloc.num_free_blocks == 2  # still held by the other table: not free
    alloc.free([block_id])
    assert alloc.num_free_blocks == 3
    assert alloc.free_block_ids().count(block_id) == 1


# -------------------------------------------- the block bound and flat memory


@pytest.mark.parametrize(
    ("max_size", "block_size"), [(1, 1), (1, 4), (3, 4), (4, 4), (6, 4), (8, 4), (5, 2), (9, 4), (16, 16)]
)
def test_a_window_holds_at_most_ceil_w_over_block_size_plus_one_blocks_over_500_tokens(
    max_size: int, block_size: int
) -> None:
    bound = ceil_div(max_size, block_size) + 1
    pool = KVPool(bound, block_size=block_size, head_dim=1)  # no more than the bound allows
    cache = KVCache(max_size, pool=pool)
    most = 0
    for n in range(1, 501):
        cache.attend([1.0], [0.0], [float(n)])
        start = max(0, n - max_size)
        # exactly the distinct logical blocks of the window
        assert cache.num_blocks == (n - 1) // block_size - start // block_size + 1
        assert pool.num_free_blocks == bound - cache.num_blocks
        most = max(most, cache.num_blocks)
    assert most <= bound
    # A window of W tokens starting at the last slot of a block spans
    # ceil((W - 1) / block_size) + 1 blocks, and no window spans more; that is
    # the stated bound except when W % block_size == 1 (then one less).
    assert most == ceil_div(max_size - 1, block_size) + 1


@pytest.mark.parametrize(("max_size", "block_size"), [(1, 1), (7, 2), (33, 4), (64, 16)])
def test_memory_stays_flat_for_a_windowed_private_cache(max_size: int, block_size: int) -> None:
    cache = KVCache(max_size, block_size=block_size)
    sizes = []
    for n in range(1, 2001):
        cache.attend([1.0, 0.0], [0.5, 0.5], [float(n), 1.0])
        if n % 250 == 0:
            assert cache.pool is not None
            sizes.append(cache.pool.num_blocks)
    # The private pool stops growing once it has room for the window.
    assert sizes[-1] == sizes[1]
    assert sizes[-1] <= 2 * (ceil_div(max_size, block_size) + 1) + 1


def test_private_pool_growth_keeps_block_ids_valid_and_outputs_bit_exact() -> None:
    rng = np.random.default_rng(7)
    cache = KVCache(block_size=2)
    history_keys, history_values = [], []
    sizes = set()
    for step in range(300):
        q, k, v = rng.standard_normal((3, 2, 3))  # (num_heads, head_dim) each
        history_keys.append(k)
        history_values.append(v)
        out = cache.attend(q, k, v)
        assert np.array_equal(out, reference.attend_window(q, history_keys, history_values))
        assert cache.pool is not None
        sizes.add(cache.pool.num_blocks)
        ids = cache.block_ids
        assert len(set(ids)) == len(ids)
        assert all(0 <= block_id < cache.pool.num_blocks for block_id in ids)
        if step % 50 == 0:
            cache.check_invariants()
    assert len(sizes) > 3  # it really grew, several times
    # Every entry survived every growth.
    assert np.array_equal(cache.keys(), np.stack(history_keys))
    assert np.array_equal(cache.values(), np.stack(history_values))


def test_windowed_cache_on_a_shared_pool_returns_to_the_same_free_count() -> None:
    pool = KVPool(8, block_size=4, head_dim=1)
    cache = KVCache(max_size=6, pool=pool)
    free_counts = []
    for n in range(1, 401):
        cache.attend([1.0], [0.0], [1.0])
        if n >= 12:
            free_counts.append(pool.num_free_blocks)
    # Steady state: 2 or 3 blocks held, never more (no leak as the window slides).
    assert set(free_counts) == {5, 6}


# ----------------------------------- last_page_len > page_size (FlashInfer #320)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_last_block_offset_never_reaches_block_size_flashinfer_320(block_size: int) -> None:
    cache = KVCache(max_size=5, block_size=block_size)
    for n in range(1, 40):
        cache.attend([1.0], [1.0], [1.0])
        table = cache.block_table
        for index in range(max(0, n - 5), n):
            block_id, offset = divmod(table.slot(index), block_size)
            assert offset == index % block_size
            assert block_id in cache.block_ids


# ---------------- a failed operation leaves K/V untouched (llama.cpp #27068)


def test_a_refused_attend_leaves_the_cached_keys_and_values_untouched_llama_cpp_27068() -> None:
    pool = KVPool(4, block_size=2, head_dim=2)
    cache = KVCache(max_size=3, pool=pool)
    for i in range(4):
        cache.attend([1.0, 0.0], [float(i), 1.0], [1.0, float(i)])
    keys, values = cache.keys(), cache.values()
    storage = pool.keys(0).copy()
    with pytest.raises(NonFiniteError):
        cache.attend([1.0, 0.0], [2.0, 2.0], [np.nan, 0.0])
    assert np.array_equal(cache.keys(), keys)
    assert np.array_equal(cache.values(), values)
    assert np.array_equal(pool.keys(0), storage)  # not even a free slot was written
