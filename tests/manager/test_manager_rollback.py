"""``truncate`` (speculative decoding's rollback), ``window_start`` and a per-call ``scale``.

The oracle is a plain list of every kept token's (k, v): ``truncate`` slices
it, and each output is compared with ``reference.attend_window`` over the
tokens that list says a query sees (bit for bit for a single-token decode).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.managers import make_manager, manager_state, settle
from support.prefix import make

from pagedkv import KVCacheManager, KVPool
from pagedkv.errors import ConfigError, InputTypeError, NonFiniteError, SequenceStateError
from pagedkv.reference import attend_window

H, D = 2, 2  # kv heads, head_dim


def _token(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(-8, 9, size=(3, H, D)).astype(np.float64) / 4.0  # q, k, v: exact in float64


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 5)),
        st.tuples(st.just("truncate"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, max_size=st.sampled_from([None, 3, 6]), sinks=st.sampled_from([0, 1]),
       block_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_truncate_then_continue_matches_the_kept_tokens(
    ops: list[tuple[str, int]], max_size: int | None, sinks: int, block_size: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(
        KVPool(64, block_size=block_size, num_layers=2, num_kv_heads=H, head_dim=D, dtype=np.float64),
        max_size=max_size,
        num_sink_tokens=sinks,
    )
    manager.add_sequence("s")
    kept: list[np.ndarray] = []  # (k, v) of every token the sequence holds, evicted ones included
    for op, n in ops:
        table = manager.block_table("s")
        if op == "truncate":
            target = min(n, table.num_tokens)
            # Token ``target`` would attend from ``first_needed``: every such token must be held.
            first_needed = sinks if max_size is None else max(sinks, target + 1 - max_size)
            if first_needed < table.window_start and target < table.num_tokens:
                before = manager_state(manager)
                with pytest.raises(SequenceStateError, match="left the window"):
                    manager.truncate("s", target)
                assert manager_state(manager) == before
                continue
            manager.truncate("s", target)
            del kept[target:]
            assert manager.num_tokens("s") == target
        else:
            tokens = [_token(rng) for _ in range(n)]
            batch = manager.reserve({"s": n})
            queries = np.stack([t[0] for t in tokens])
            keys, values = np.stack([t[1] for t in tokens]), np.stack([t[2] for t in tokens])
            for layer in range(2):
                manager.write(layer, batch, keys, values)
                out = manager.attend(layer, batch, queries)
                kept_now = kept + [t[1:] for t in tokens]
                for i, position in enumerate(range(len(kept), len(kept) + n)):
                    start = 0 if max_size is None else max(0, position + 1 - max_size)
                    visible = [j for j in range(position + 1) if j < sinks or j >= max(start, sinks)]
                    expected = attend_window(
                        queries[i], [kept_now[j][0] for j in visible], [kept_now[j][1] for j in visible]
                    )
                    if n == 1:  # a decode is bit-exact; a chunk's kernel rounds in its own order
                        np.testing.assert_array_equal(out[i], expected)
                    else:
                        np.testing.assert_allclose(out[i], expected, rtol=1e-12, atol=1e-12)
            kept.extend(t[1:] for t in tokens)
        manager.check_invariants()
        # Blocks held are exactly those the kept, unevicted tokens need.
        assert manager.pool.num_used_blocks == manager.block_table("s").num_blocks


def test_truncate_gives_blocks_back_and_to_zero_empties() -> None:
    manager = make_manager(8)
    manager.add_sequence("a")
    settle(manager, {"a": 10})  # blocks of 4: three blocks
    assert manager.pool.num_used_blocks == 3
    manager.truncate("a", 5)
    assert manager.pool.num_used_blocks == 2 and manager.num_tokens("a") == 5
    manager.truncate("a", 0)
    assert manager.pool.num_used_blocks == 0 and manager.num_tokens("a") == 0
    settle(manager, {"a": 2})  # the sequence goes on from empty
    manager.check_invariants()


def test_truncate_makes_the_outstanding_batch_stale() -> None:
    manager = make_manager(8)
    manager.add_sequence("a")
    settle(manager, {"a": 3})
    batch = settle(manager, {"a": 2})
    manager.truncate("a", 3)
    kv = np.ones((2, 1, 1))
    with pytest.raises(SequenceStateError):
        manager.write(0, batch, kv, kv)


def _refused(manager: KVCacheManager, error: type[Exception], match: str, *args: Any) -> None:
    before = manager_state(manager)
    with pytest.raises(error, match=match):
        manager.truncate(*args)
    assert manager_state(manager) == before


def test_truncate_errors_change_nothing() -> None:
    manager = make_manager(8, num_layers=2, max_size=4)
    manager.add_sequence("a")
    settle(manager, {"a": 8})
    settle(manager, {"a": 1})  # window 4 for token 8: tokens 0..4 left it, and block 0 with them
    _refused(manager, ConfigError, "holds 9 tokens; cannot keep 10", "a", 10)
    _refused(manager, InputTypeError, "num_tokens", "a", 2.5)
    _refused(manager, ConfigError, "num_tokens", "a", -1)
    _refused(manager, SequenceStateError, r"tokens 3\.\.4 already left the window", "a", 6)
    _refused(manager, SequenceStateError, r"tokens 4\.\.4 already left the window", "a", 7)
    manager.truncate("a", 8)  # token 8 attends to 5..8: all held
    batch = manager.reserve({"a": 3})
    kv = np.ones((3, 1, 1))
    manager.write(0, batch, kv, kv)  # layer 1 has not written tokens 8..10
    _refused(manager, SequenceStateError, r"layers \[1\] have not written", "a", 10)
    manager.write(1, batch, kv, kv)
    manager.preempt("a")
    _refused(manager, SequenceStateError, "preempted, not running", "a", 0)
    _refused(manager, LookupError, "b", "b", 0)


def test_truncate_keeps_a_token_count_equal_to_the_length_as_a_no_op() -> None:
    manager = make_manager(8)
    manager.add_sequence("a")
    settle(manager, {"a": 3})
    before = manager_state(manager)
    manager.truncate("a", 3)
    assert manager_state(manager) == before


def test_truncate_retracts_the_keys_of_blocks_no_longer_full() -> None:
    manager = make(8)  # prefix caching, blocks of 2
    prompt = [5, 6, 7, 8, 9, 10, 11]
    manager.add_sequence("a", prompt)
    batch = manager.reserve({"a": prompt})
    kv = np.ones((7, 1, 2))
    manager.write(0, batch, kv, kv)  # blocks [5 6] [7 8] [9 10] are full and keyed
    cache = manager.prefix_cache
    assert cache is not None and cache.num_cached_blocks == 3
    manager.truncate("a", 3)  # [7 8] is now partial, [9 10] dropped
    assert cache.num_cached_blocks == 1
    assert cache.key_of(manager.block_table("a").block_ids[1]) is None
    manager.check_invariants()
    manager.add_sequence("b", [5, 6, 7, 8, 9])
    assert manager.block_table("b").num_tokens == 2  # only [5 6] is still cached


def test_truncate_of_a_shared_block_keeps_its_key_and_copies_on_write() -> None:
    manager = make(8)
    manager.add_sequence("a", [1, 2, 3, 4])
    batch = manager.reserve({"a": [1, 2, 3, 4]})
    kv = np.ones((4, 1, 2))
    manager.write(0, batch, kv, kv)
    manager.fork("a", "b")
    shared = manager.block_table("a").block_ids[1]
    manager.truncate("a", 3)
    cache = manager.prefix_cache
    assert cache is not None and cache.key_of(shared) is not None  # b still holds it, full
    batch = manager.reserve({"a": [9]})
    assert manager.block_table("a").block_ids[1] != shared  # copy-on-write
    manager.write(0, batch, np.zeros((1, 1, 2)), np.zeros((1, 1, 2)))
    assert manager.block_table("b").block_ids[1] == shared
    manager.check_invariants()


@pytest.mark.parametrize("max_size, sinks", [(None, 0), (None, 2), (3, 0), (5, 1), (2, 3)])
def test_window_start_predicts_reserve(max_size: int | None, sinks: int) -> None:
    manager = make_manager(32, block_size=2, max_size=max_size, num_sink_tokens=sinks)
    manager.add_sequence("a")
    for n in [1, 3, 2, 1, 4, 1]:
        now = manager.window_start("a")
        assert now == manager.block_table("a").window_start
        predicted = manager.window_start("a", n)
        settle(manager, {"a": n})
        assert manager.block_table("a").window_start == predicted
        assert manager.window_start("a", 1) == manager.window_start("a", 7)


def test_window_start_errors() -> None:
    manager = make_manager(4)
    manager.add_sequence("a")
    with pytest.raises(InputTypeError, match="num_new_tokens"):
        manager.window_start("a", "2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_new_tokens"):
        manager.window_start("a", -1)
    with pytest.raises(LookupError):
        manager.window_start("zz")


def test_a_per_call_scale_equals_a_manager_built_with_it() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 1, 1)) for _ in range(3))
    outputs = []
    for manager_scale, call_scale in [(0.37, None), (1.0, 0.37), (5.0, 0.37)]:
        manager = make_manager(4, scale=manager_scale)
        manager.add_sequence("a")
        batch = manager.reserve({"a": 3})
        manager.write(0, batch, k, v)
        outputs.append(manager.attend(0, batch, q, scale=call_scale))
        assert manager.scale == manager_scale  # the call does not change the manager
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs[0], outputs[2])


@pytest.mark.parametrize("scale, error", [("2", InputTypeError), (True, InputTypeError),
                                          (float("nan"), NonFiniteError), (float("inf"), NonFiniteError)])
def test_a_bad_per_call_scale_is_refused(scale: Any, error: type[Exception]) -> None:
    manager = make_manager(4)
    manager.add_sequence("a")
    batch = settle(manager, {"a": 2})
    before = manager_state(manager)
    with pytest.raises(error, match="scale"):
        manager.attend(0, batch, np.ones((2, 1, 1)), scale=scale)
    assert manager_state(manager) == before
