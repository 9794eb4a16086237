"""cancel_reservation: taking back a half-written step (design note from the manager tests)."""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import make_manager, manager_state, settle
from support.prefix import Runner, key_chain, make, prefix_of

from pagedkv import KVCacheManager, SequenceStateError, UnknownSequenceError
from pagedkv.reference import attend_window


def _manager(max_size: int | None = None, num_sink_tokens: int = 0) -> KVCacheManager:
    return make_manager(16, block_size=2, num_layers=2, max_size=max_size, num_sink_tokens=num_sink_tokens)


@pytest.mark.parametrize(("max_size", "sinks"), [(None, 0), (3, 0), (3, 1), (1, 0)])
def test_a_half_written_step_is_taken_back_after_a_batch_mate_is_freed(
    max_size: int | None, sinks: int
) -> None:
    # block_size 2. Step 1 writes a: [0 1 | 2 .], b: [0 1]. Step 2 reserves a's
    # tokens 3, 4, 5 (blocks [2 3 | 4 5]) and b's token 2; layer 0 is written,
    # then b is freed: a cannot finish step 2 with the stale batch.
    m = _manager(max_size, sinks)
    m.add_sequence("a")
    m.add_sequence("b")
    settle(m, {"a": 3, "b": 2})
    free_after_step_1 = m.pool.num_free_blocks + 1  # b's block comes back too
    batch = m.reserve({"a": 3, "b": 1})
    m.write(0, batch, np.ones((4, 1, 1)), np.ones((4, 1, 1)))
    m.free("b")
    with pytest.raises(SequenceStateError, match="cancel_reservation"):
        m.write(1, batch, np.ones((4, 1, 1)), np.ones((4, 1, 1)))
    m.cancel_reservation("a")
    m.check_invariants()
    assert m.num_tokens("a") == 3
    assert m.pool.num_free_blocks >= free_after_step_1 - 1
    # a continues as if step 2 never happened: the next token attends to a's window.
    step = settle(m, {"a": 1}, 2.0)
    out = m.attend(1, step, np.ones((1, 1, 1)))
    history = [1.0, 1.0, 1.0, 2.0]
    visible = history if max_size is None else history[:sinks] + history[max(sinks, 4 - max_size) :]
    expected = attend_window([[1.0]], [[[x]] for x in visible], [[[x]] for x in visible])
    assert np.array_equal(out[0], expected)
    m.free("a")
    assert m.pool.num_free_blocks == 16


def test_cancel_without_unwritten_tokens_changes_nothing() -> None:
    m = _manager()
    m.add_sequence("a")
    settle(m, {"a": 3})
    before = (m.block_table("a").block_ids, m.num_tokens("a"), m.pool.num_free_blocks)
    m.cancel_reservation("a")
    assert (m.block_table("a").block_ids, m.num_tokens("a"), m.pool.num_free_blocks) == before


def test_cancel_refuses_unknown_and_preempted_sequences_and_changes_nothing() -> None:
    m = _manager()
    m.add_sequence("a")
    settle(m, {"a": 3})
    m.preempt("a")
    free = m.pool.num_free_blocks
    with pytest.raises(UnknownSequenceError, match="'zz'"):
        m.cancel_reservation("zz")
    with pytest.raises(SequenceStateError, match="preempted"):
        m.cancel_reservation("a")
    assert m.pool.num_free_blocks == free
    m.check_invariants()


def test_cancel_with_prefix_caching_keys_nothing_it_took_back() -> None:
    # block_size 2, two layers, prefix caching on. a wrote |1 2|3 .| in both
    # layers: b0 is keyed (k0), b1 partial.
    #   a: b0 |1 2| b1 |3 .|         keys: k0 -> b0       free [2 .. 7]
    # a reserves 4 5 6 (b1 |3 4|, b2 |5 6| full), layer 0 writes them, then
    # the step is cancelled: a is back to its 3 tokens, b2 is free again (at
    # the tail), and neither |3 4| nor |5 6| has a key, for layer 1 never
    # wrote them.
    runner = Runner(make(num_layers=2))
    manager = runner.manager
    runner.admit("a", [1, 2, 3])
    before = manager_state(manager, pages=False)
    runner.feed({"a": [4, 5, 6]}, layers=[0])
    manager.cancel_reservation("a")
    runner.history["a"] = [1, 2, 3]
    manager.check_invariants()
    #   a: b0 |1 2| b1 |3 .|         keys: k0 -> b0       free [3 .. 7, 2]
    after = manager_state(manager, pages=False)
    (free, *device), (free_before, *device_before) = after[0], before[0]
    assert (free, free_before) == ([3, 4, 5, 6, 7, 2], [2, 3, 4, 5, 6, 7])
    assert device == device_before  # cached free queue, ref counts
    assert after[1:] == before[1:]  # host pool, tables, keys, metrics
    assert [prefix_of(manager).block_for(key) for key in key_chain([1, 2, 3, 4, 5, 6])] == [0, None, None]
    # a carries on with other tokens: |3 7| is written in both layers and keyed.
    runner.feed({"a": [7, 8]})
    assert prefix_of(manager).block_for(key_chain([1, 2, 3, 7])[1]) == manager.block_table("a").block_ids[1]
    # The prompt that was cancelled hits only what every layer wrote: |1 2|.
    assert runner.admit("b", [1, 2, 3, 4, 5, 6, 9]) == 2
    assert manager.block_table("b").block_ids[0] == 0
