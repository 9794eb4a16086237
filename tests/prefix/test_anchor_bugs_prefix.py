"""Regression tests named after the prefix-caching bugs in ``../shared/ANCHORS.md``.

Each test rebuilds the shape of the original report against ``KVCacheManager``
with prefix caching on and asserts pagedkv's rule. block_size 2 unless a test
says otherwise; states are drawn as in ``tests/prefix/test_prefix_cache.py``::

    b0 |1 2|  block id 0 holding tokens 1 and 2      cached free [1, 0]: evicted 1 first
"""

from __future__ import annotations

import numpy as np
import pytest
from support.prefix import Runner, from_scratch, key_chain, make, prefix_of

from pagedkv import SequenceState, SequenceStateError

# ---------------------------------------------------- stale key on a reused block


def test_stale_key_vllm_44237_an_evicted_block_reused_for_other_content_loses_its_key() -> None:
    # vLLM PR #44237: a block reused for new content kept its old hash, so the map grew without
    # bound and a lookup could return the wrong contents.
    runner = Runner(make(num_blocks=3))
    manager = runner.manager
    runner.admit("a", [1, 2, 3])
    manager.free("a")
    # free [1, 2]   cached free [0]: b0 |1 2| keeps its key
    old_key = key_chain([1, 2])[0]
    assert prefix_of(manager).block_for(old_key) == 0
    runner.admit("b", [5, 6, 7, 8, 9])  # takes 1, 2, then evicts b0 for |9 .|... and rewrites it
    assert 0 in manager.block_table("b").block_ids
    assert prefix_of(manager).block_for(old_key) is None
    assert prefix_of(manager).key_of(0) != old_key
    assert manager.metrics().num_prefix_evictions == 1
    manager.free("b")
    assert runner.add("c", [1, 2, 3]) == 0  # the lookup misses: nothing stale is served
    runner.feed({"c": [1, 2, 3]})
    assert prefix_of(manager).num_cached_blocks <= manager.pool.num_blocks


def test_stale_key_vllm_44237_the_map_never_outgrows_the_pool_under_churn() -> None:
    runner = Runner(make(num_blocks=4))
    for i in range(50):
        prompt = [i % 7, i % 5, i % 3, i % 2, 1]
        runner.admit(f"s{i}", prompt)
        runner.manager.free(f"s{i}")
        assert prefix_of(runner.manager).num_cached_blocks <= 4
    runner.manager.check_invariants()


# ------------------------------------------------------- a prompt fully cached


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fully_cached_prompt_nano_vllm_144_leaves_one_token_to_compute(block_size: int) -> None:
    # nano-vllm #144: a prompt whose every block was cached left zero tokens to compute and
    # crashed. vLLM always recomputes the last token; so does pagedkv.
    prompt = [3, 1, 4, 1, 5, 9, 2, 6][: 2 * block_size]  # exactly two full blocks
    runner = Runner(make(num_blocks=16, block_size=block_size))
    runner.admit("a", prompt)
    assert prefix_of(runner.manager).num_cached_blocks == 2
    num_hit = runner.add("b", prompt)
    assert num_hit == block_size  # the second block is recomputed for its last token
    out = runner.feed({"b": prompt[num_hit:]})
    expected = from_scratch(prompt, [num_hit, len(prompt) - num_hit], block_size=block_size)
    assert all(np.array_equal(x, y) for x, y in zip(out, expected))


def test_fully_cached_one_token_prompt_nano_vllm_144_hits_nothing() -> None:
    runner = Runner(make(block_size=1))
    runner.admit("a", [7])
    assert runner.add("b", [7]) == 0
    runner.feed({"b": [7]})


# --------------------------------------------- identical prompts in one step


def test_identical_prompts_in_one_step_nano_vllm_219_keep_the_map_consistent() -> None:
    # nano-vllm #219: two identical prompts admitted in the same step got duplicate blocks and
    # a hash map pointing at the wrong one.
    runner = Runner(make(num_blocks=8))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5]
    assert runner.add("a", prompt) == runner.add("b", prompt) == 0  # nothing cached yet
    runner.feed({"a": prompt, "b": prompt})
    # a: b0 b1 b2   b: b3 b4 b5   each key once, on a's block (first wins); b's stay unkeyed
    prefix = prefix_of(manager)
    keys = key_chain(prompt)
    assert [prefix.block_for(key) for key in keys] == manager.block_table("a").block_ids[:2]
    assert all(prefix.key_of(block_id) is None for block_id in manager.block_table("b").block_ids)
    assert prefix.num_cached_blocks == 2
    manager.free("a")
    manager.free("b")
    # pool clean: every block free, only a's two full blocks cached
    m = manager.metrics()
    assert (m.num_free_blocks, m.num_cached_free_blocks, m.num_cached_blocks) == (8, 2, 2)
    manager.check_invariants()
    # a third identical prompt later hits
    assert runner.add("c", prompt) == 4
    runner.feed({"c": prompt[4:]})


def test_identical_prompts_in_one_step_nano_vllm_219_after_a_common_hit() -> None:
    runner = Runner(make(num_blocks=12))
    manager = runner.manager
    runner.admit("warm", [1, 2])
    manager.free("warm")
    prompt = [1, 2, 3, 4, 5]
    assert runner.add("a", prompt) == runner.add("b", prompt) == 2  # both share the cached b0
    runner.feed({"a": prompt[2:], "b": prompt[2:]})
    assert manager.pool.allocator.ref_count(manager.block_table("a").block_ids[0]) == 2
    assert prefix_of(manager).num_cached_blocks == 2  # b0 and a's |3 4|, not b's copy
    manager.check_invariants()


# ------------------------------------------- shared blocks counted twice as evictable


def test_shared_blocks_sglang_35270_are_counted_once_with_forks_and_cached_blocks() -> None:
    # SGLang #35270: pages shared by several requests were counted once per request as
    # evictable, so the free count overstated what could be reclaimed.
    runner = Runner(make(num_blocks=10))
    manager = runner.manager
    runner.admit("a", [1, 2, 3, 4, 5])  # a: b0 b1 b2
    manager.fork("a", "f1")
    manager.fork("a", "f2")
    assert runner.add("b", [1, 2, 3, 4, 6]) == 4  # b: b0 b1 + its own
    runner.history["b"] = [1, 2, 3, 4]
    runner.feed({"b": [6]})
    allocator = manager.pool.allocator
    assert [allocator.ref_count(i) for i in (0, 1, 2, 3)] == [4, 4, 3, 1]
    assert manager.pool.num_free_blocks == 6 and allocator.num_cached_free_blocks == 0
    for seq_id, num_free, num_cached_free in (("a", 6, 0), ("f1", 6, 0), ("f2", 7, 0), ("b", 10, 2)):
        manager.free(seq_id)
        m = manager.metrics()
        assert (m.num_free_blocks, m.num_cached_free_blocks) == (num_free, num_cached_free), seq_id
        assert m.num_free_blocks + m.num_used_blocks == m.num_blocks
        manager.check_invariants()
    # every block can be handed out exactly once
    assert len(set(allocator.allocate(10))) == 10


# ------------------------------------------------ partial blocks kept in the LRU


def test_partial_blocks_vllm_42656_never_wait_in_the_cached_lru() -> None:
    # vLLM #42656: partial (unhashed) blocks went into the LRU and pushed real entries out.
    runner = Runner(make(num_blocks=6))
    manager = runner.manager
    runner.admit("a", [1, 2, 3])  # b0 |1 2| keyed, b1 |3 .| partial
    runner.admit("b", [4])  # b2 |4 .| partial
    manager.free("a")
    manager.free("b")
    allocator = manager.pool.allocator
    assert allocator.cached_free_block_ids() == [0]
    assert set(allocator.free_block_ids()) == {1, 2, 3, 4, 5}
    runner.admit("c", [9] * 9)  # five blocks: every plain one first, the cached b0 survives
    assert prefix_of(manager).block_for(key_chain([1, 2])[0]) == 0
    assert manager.metrics().num_prefix_evictions == 0


# ------------------------------------------------------------------- salts


def test_salts_vllm_44701_an_adapter_named_like_a_salt_does_not_collide() -> None:
    # vLLM #44701: a LoRA name equal to a cache salt hashed the same, so the adapter's request
    # reused the tenant's blocks. Extra keys are tagged with their kind.
    runner = Runner(make(num_blocks=12))
    prompt = [1, 2, 3, 4, 5]
    runner.admit("tenant", prompt, extra_keys={"salt": "x"})
    assert runner.add("adapter", prompt, extra_keys={"adapter": "x"}) == 0
    assert runner.add("other-type", prompt, extra_keys={"salt": b"x"}) == 0
    assert key_chain(prompt, extra_keys={"salt": "x"}) != key_chain(prompt, extra_keys={"adapter": "x"})
    assert runner.add("same", prompt, extra_keys={"salt": "x"}) == 4


def test_salts_different_salts_never_share_a_block_even_for_identical_prompts() -> None:
    runner = Runner(make(num_blocks=12))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5]
    runner.admit("a", prompt, extra_keys={"salt": "tenant-a"})
    runner.admit("b", prompt, extra_keys={"salt": "tenant-b"})
    runner.admit("none", prompt)
    tables = [set(manager.block_table(s).block_ids) for s in ("a", "b", "none")]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    assert manager.metrics().num_prefix_hits == 0
    assert prefix_of(manager).num_cached_blocks == 6  # two keyed blocks per tenant


# ------------------------------------------ recomputation after preemption


def test_recompute_after_preemption_vllm_25780_is_not_counted_as_a_hit() -> None:
    # vLLM #25780: a preempted request's recomputation found its own blocks and counted them
    # as prefix-cache hits, inflating the hit rate.
    runner = Runner(make(num_blocks=8))
    manager = runner.manager
    runner.admit("a", [1, 2, 3, 4, 5])
    runner.history["a"] = [1, 2, 3, 4, 5]
    runner.feed({"a": [6]})
    before = manager.metrics()
    manager.preempt("a")
    assert manager.resume("a") == 4  # (6 - 1) // 2 blocks of its own history
    after = manager.metrics()
    assert (after.num_prefix_queries, after.num_prefix_hits) == (before.num_prefix_queries, 0)
    assert after.prefix_hit_rate == 0.0
    assert after.num_resumed_reuse_tokens == 4


def test_recompute_after_preemption_vllm_25780_with_nothing_cached_reuses_nothing() -> None:
    runner = Runner(make(num_blocks=3))
    manager = runner.manager
    runner.admit("a", [1, 2, 3])
    manager.preempt("a")
    runner.admit("flood", [7] * 6)  # evicts a's cached b0
    manager.free("flood")
    runner.admit("b", [8, 8, 8, 8, 8, 8])  # and every other block is rewritten
    manager.free("b")
    assert manager.resume("a") == 0
    assert manager.metrics().num_resumed_reuse_tokens == 0


# ------------------------------------------------- preemption plus a cache hit


def test_preemption_plus_cache_hit_nano_vllm_211_233_no_index_error() -> None:
    # nano-vllm PR #211 / #233: a request preempted after a cache hit was resumed with a block
    # table and a "cached tokens" count that disagreed, and indexing past the table crashed.
    runner = Runner(make(num_blocks=6))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5]
    runner.admit("warm", prompt)
    assert runner.admit("a", prompt) == 4
    manager.preempt("a")  # a held 2 shared blocks and 1 own
    manager.free("warm")
    runner.admit("flood", [9, 9, 9])  # takes plain blocks, a's cached ones survive
    num_reused = manager.resume("a")
    assert num_reused == 4
    runner.history["a"] = prompt[:num_reused]
    runner.feed({"a": prompt[num_reused:]})
    out = runner.feed({"a": [6]})  # decode after the resume
    expected = from_scratch([*prompt, 6], [4, 1, 1])
    assert all(np.array_equal(x, y) for x, y in zip(out, expected))
    manager.preempt("a")  # preempted again right after: still consistent
    manager.check_invariants()
    assert manager.resume("a") == 4


def test_preemption_plus_cache_hit_with_swap_restores_every_token() -> None:
    runner = Runner(make(num_blocks=6, host=True))
    manager = runner.manager
    prompt = [1, 2, 3, 4, 5]
    runner.admit("warm", prompt)
    assert runner.admit("a", prompt) == 4
    manager.preempt("a", "swap")
    assert manager.state("a") is SequenceState.SWAPPED
    manager.free("warm")
    assert manager.resume("a") == 5
    runner.history["a"] = list(prompt)
    out = runner.feed({"a": [6]})
    expected = from_scratch([*prompt, 6], [4, 1, 1])
    assert all(np.array_equal(x, y) for x, y in zip(out, expected))


def test_cache_hit_shorter_than_the_sink_blocks_keeps_the_table_consistent() -> None:
    # Found by tests/test_stateful_prefix.py: with 5 sink tokens (3 sink blocks) a hit of
    # 2 blocks built a table whose window part started inside the sinks, and the next
    # reservation indexed past the table (IndexError), the shape of nano-vllm #211 / #233.
    runner = Runner(make(num_blocks=16, num_sink_tokens=5))
    manager = runner.manager
    runner.admit("a", [1, 2, 3, 4, 5])
    assert runner.add("b", [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    manager.check_invariants()
    out = runner.feed({"b": [5, 6, 7, 8]})
    expected = from_scratch([1, 2, 3, 4, 5, 6, 7, 8], [4, 4], num_sink_tokens=5)
    assert all(np.array_equal(x, y) for x, y in zip(out, expected))


# ---------------------------------------------------------------- reset


def test_reset_is_refused_while_a_block_is_in_use_and_works_when_none_is() -> None:
    runner = Runner(make(num_blocks=8))
    manager = runner.manager
    runner.admit("a", [1, 2, 3])
    manager.preempt("a")
    runner.admit("b", [1, 2, 3])
    before = (manager.metrics(), manager.pool.allocator.cached_free_block_ids())
    with pytest.raises(SequenceStateError, match="in use"):
        manager.reset_prefix_cache()
    assert (manager.metrics(), manager.pool.allocator.cached_free_block_ids()) == before
    manager.free("b")
    manager.reset_prefix_cache()  # a is preempted: it holds nothing
    assert manager.metrics().num_cached_blocks == 0
    assert manager.resume("a") == 0  # its blocks' keys are gone
    manager.check_invariants()


# ----------------------------------------------------------- predictable hashes


def test_predictable_hashes_ghsa_rm76_4mrf_v9r8_default_keys_are_sha256_not_python_hash() -> None:
    # GHSA-rm76-4mrf-v9r8 / vLLM #11829: Python's hash() of a tuple is predictable (and None hashed
    # to a constant), so a crafted prompt could collide with another tenant's block. The default
    # key is SHA-256 of an unambiguous byte encoding, the same in every process.
    keys = key_chain([1, 2], extra_keys={"salt": "s"})
    assert len(keys[0]) == 32
    assert keys == key_chain([1, 2], extra_keys={"salt": "s"})
    assert keys[0] != key_chain([1, 2])[0]
