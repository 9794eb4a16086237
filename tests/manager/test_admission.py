"""Look before you take: ``lookup`` and ``plan(..., admit=...)`` predict admission and change nothing.

The prefix machine (tests/test_stateful_prefix.py, ``look_then_add``) checks the
prediction after every kind of history; these cases pin the counting rules.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.managers import make_manager, manager_state
from support.prefix import make

from pagedkv.errors import ConfigError, InputTypeError


def _admit(manager, seq_id, prompt):  # type: ignore[no-untyped-def]
    num_hit = manager.add_sequence(seq_id, prompt)
    rest = prompt[num_hit:]
    batch = manager.reserve({seq_id: rest} if manager.prefix_caching else {seq_id: len(rest)})
    kv = np.ones((len(rest), 1, manager.pool.head_dim))
    manager.write(0, batch, kv, kv)


def test_without_prefix_caching_a_prompt_takes_its_blocks() -> None:
    manager = make_manager(4)  # blocks of 4
    plan = manager.lookup([1] * 9)
    assert (plan.num_cached_tokens, plan.num_new_blocks, plan.revived_block_ids) == (0, 3, ())
    assert plan.fits
    assert not manager.lookup([1] * 17).fits


def test_a_hit_on_cached_free_blocks_counts_them_as_taken() -> None:
    manager = make(4)  # blocks of 2
    _admit(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")  # three keyed blocks wait in the cached free queue... two full, keyed
    plan = manager.lookup([1, 2, 3, 4, 9])
    assert plan.num_cached_tokens == 4 and len(plan.revived_block_ids) == 2
    assert plan.num_new_blocks == 1 and plan.num_blocks_taken == 3 and plan.fits
    # Two prompts reviving the same blocks count them once.
    twice = manager.plan({}, admit=[plan, manager.lookup([1, 2, 3, 4, 7])])
    assert twice.num_new_blocks == 2 + 1 + 1 and twice.fits
    assert not manager.can_reserve({}, admit=[plan, manager.lookup([1, 2, 3, 4, 7, 8, 9])])


def test_lookup_then_add_hashes_once_and_agrees() -> None:
    manager = make(8)
    _admit(manager, "a", [1, 2, 3, 4, 5])
    before = manager_state(manager)
    plan = manager.lookup([1, 2, 3, 4, 5, 6])
    assert manager_state(manager) == before
    assert manager.add_sequence("b", [1, 2, 3, 4, 5, 6]) == plan.num_cached_tokens == 4


def test_a_bad_prompt_is_refused_and_changes_nothing() -> None:
    manager = make(4)
    before = manager_state(manager)
    with pytest.raises(InputTypeError, match="token ids must be ints"):
        manager.lookup([1, "x"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="extra key kind"):
        manager.lookup([1, 2], extra_keys={"colour": "red"})
    assert manager_state(manager) == before


def test_plan_with_running_requests_and_an_admission() -> None:
    manager = make(4)
    manager.add_sequence("a")
    plan = manager.lookup([5, 6, 7])  # 2 blocks
    assert manager.plan({"a": [1, 2]}, admit=[plan]).num_new_blocks == 1 + 2
    assert manager.can_reserve({"a": [1, 2, 3, 4]}, admit=[plan])
    assert not manager.can_reserve({"a": [1, 2, 3, 4, 5]}, admit=[plan])
