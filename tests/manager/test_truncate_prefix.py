"""Truncating into a shared, keyed block: the key must keep naming the block's contents (issue 27).

The rule under test (docs/prefix_caching.md, "Truncation and stale keys"): a
keyed block is never written. A sequence whose table holds a keyed block only
partly (a truncate cut into it while another sequence still held it full)
copies it before its next append, whatever the block's ref count by then, so
the key stays true of the block it names.

k/v of a token are a function of its whole prefix (``support.prefix.kv_of``),
so a block rewritten under an old key shows up in any later hit's outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import manager_state
from support.prefix import Runner, from_scratch, key_chain, make, prefix_of

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import PoolExhaustedError


def _shared_then_truncated(num_blocks: int = 8) -> tuple[Runner, int]:
    """``a`` and ``b`` share the keyed block ``[3 4]``; ``a`` is cut into it; ``b`` leaves.

    blocks of 2::

        a  [1 2] [3 4]       prefilled, both blocks full and keyed
        b  [1 2] [3 4] [5]   admitted with a hit on both: ref counts 2, 2
        a  [1 2] [3 .]       truncate to 3: the key of [3 4] stays (b holds it full)
        b  freed             [3 4] now has ref count 1, keyed, and a holds it partly

    Returns the runner and the id of the keyed block ``a`` holds partly.
    """
    runner = Runner(make(num_blocks))
    runner.admit("a", [1, 2, 3, 4])
    assert runner.admit("b", [1, 2, 3, 4, 5]) == 4
    manager = runner.manager
    shared = manager.block_table("a").block_ids[1]
    manager.truncate("a", 3)
    del runner.history["a"][3:]
    assert prefix_of(manager).key_of(shared) == key_chain([1, 2, 3, 4])[1]  # still true: b holds it full
    manager.free("b")
    assert manager.pool.allocator.ref_count(shared) == 1
    manager.check_invariants()
    return runner, shared


def test_an_append_after_the_other_holder_left_copies_the_keyed_block() -> None:
    runner, shared = _shared_then_truncated()
    manager = runner.manager
    runner.feed({"a": [9]})  # a's [3 9] goes to a copy; [3 4] keeps its contents and its key
    assert manager.block_table("a").block_ids[1] != shared
    assert prefix_of(manager).key_of(shared) == key_chain([1, 2, 3, 4])[1]
    assert manager.pool.allocator.ref_count(shared) == 0  # waits in the cached free queue
    assert manager.metrics().num_copy_on_write == 1


def test_a_later_hit_on_the_original_prompt_reads_the_original_contents() -> None:
    runner, shared = _shared_then_truncated()
    runner.feed({"a": [9]})
    runner.feed({"a": [10]})  # a's copy fills: [3 9] keyed under its own key
    assert runner.add("c", [1, 2, 3, 4, 5]) == 4  # the hit is on [3 4]'s original block
    assert runner.manager.block_table("c").block_ids[1] == shared
    (out,) = runner.feed({"c": [5]})
    (expected,) = from_scratch([1, 2, 3, 4, 5], [4, 1])
    np.testing.assert_array_equal(out, expected)
    (out,) = runner.feed({"a": [11]})  # and a reads its own tokens, not the original ones
    (expected,) = from_scratch([1, 2, 3, 9, 10, 11], [5, 1])
    np.testing.assert_array_equal(out, expected)


def test_every_key_still_names_its_block_after_the_rewrite() -> None:
    runner, _ = _shared_then_truncated()
    runner.feed({"a": [9, 10]})
    manager = runner.manager
    keys = key_chain([1, 2, 3, 9, 10])
    table = manager.block_table("a")
    cache = prefix_of(manager)
    assert [cache.key_of(block_id) for block_id in table.block_ids[:2]] == keys[:2]
    assert cache.block_for(key_chain([1, 2, 3, 4])[1]) not in table.block_ids


def test_a_copy_the_pool_has_no_room_for_is_refused_with_nothing_changed() -> None:
    runner, _ = _shared_then_truncated(num_blocks=3)
    manager = runner.manager
    runner.admit("d", [7, 8])  # takes the last free block: none left for a's copy
    assert manager.pool.num_free_blocks == 0
    assert not manager.can_reserve({"a": [9]})
    assert manager.plan({"a": [9]}).num_copy_on_write == 1
    before = manager_state(manager)
    with pytest.raises(PoolExhaustedError, match="need 1 block, 0 free of 3"):
        manager.reserve({"a": [9]})
    assert manager_state(manager) == before


def _appends_in_place(self: BlockAllocator, block_id: int, num_dropped: int = 0) -> bool:
    """The copy rule before issue 27: copy a partly filled last block only when shared."""
    return self.ref_count(block_id) - num_dropped > 1


def test_check_invariants_refuses_a_keyed_block_held_partly_with_no_copy_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = Runner(make(8))
    runner.admit("a", [1, 2, 3, 4])
    runner.admit("b", [1, 2, 3, 4, 5])
    manager = runner.manager
    manager.truncate("a", 3)
    monkeypatch.setattr(BlockAllocator, "must_copy_before_append", _appends_in_place)
    manager.check_invariants()  # b still holds the block: a would copy it
    manager.free("b")
    with pytest.raises(AssertionError, match="holds keyed block 1 partly and would append into it"):
        manager.check_invariants()


def test_check_invariants_refuses_a_key_left_on_a_rewritten_block(monkeypatch: pytest.MonkeyPatch) -> None:
    runner, shared = _shared_then_truncated()
    monkeypatch.setattr(BlockAllocator, "must_copy_before_append", _appends_in_place)
    manager = runner.manager
    batch = manager.reserve({"a": [9, 10]})  # written into the keyed block, in place
    assert manager.block_table("a").block_ids[1] == shared
    kv = np.zeros((2, 1, 2))
    manager.write(0, batch, kv, kv)  # block 1 fills: its old key stays, a's new key is refused
    monkeypatch.undo()  # the right copy rule again: only the stale key is wrong now
    with pytest.raises(AssertionError, match="keyed for other contents than the sequence wrote"):
        manager.check_invariants()
