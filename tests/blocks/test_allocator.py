"""Tests for ``pagedkv.blocks.allocator``: block ids, ref counts and the free queue.

Free-queue states are drawn head first: ``free: [2, 3]`` means block 2 is
handed out next.
"""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv.blocks.allocator
import pagedkv.counts
import pagedkv.errors
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import (
    BlockStateError,
    ConfigError,
    DoubleFreeError,
    InputTypeError,
    PagedKVError,
    PoolExhaustedError,
    UnknownBlockError,
)
from pagedkv.memory.pool import KVPool


def state(alloc: BlockAllocator) -> tuple[list[int], list[int]]:
    """Everything observable: the free queue in order and every ref count."""
    return alloc.free_block_ids(), [alloc.ref_count(i) for i in range(alloc.num_blocks)]


# ------------------------------------------------------------ hand-built cases


def test_new_allocator_has_every_block_free_in_id_order() -> None:
    alloc = BlockAllocator(4)
    # free: [0, 1, 2, 3]   ref counts: 0 0 0 0
    assert alloc.num_blocks == 4
    assert alloc.num_free_blocks == 4
    assert alloc.num_used_blocks == 0
    assert state(alloc) == ([0, 1, 2, 3], [0, 0, 0, 0])
    alloc.check_invariants()


def test_allocate_pops_the_head_and_free_appends_to_the_tail() -> None:
    alloc = BlockAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    # used: 0 1        free: [2, 3]
    assert state(alloc) == ([2, 3], [1, 1, 0, 0])
    alloc.free([0])
    # used: 1          free: [2, 3, 0]   (0 rejoins at the tail: FIFO)
    assert state(alloc) == ([2, 3, 0], [0, 1, 0, 0])
    assert alloc.allocate_one() == 2
    assert alloc.allocate(2) == [3, 0]
    # used: 0 1 2 3    free: []
    assert state(alloc) == ([], [1, 1, 1, 1])
    assert alloc.num_free_blocks == 0
    assert alloc.num_used_blocks == 4
    alloc.check_invariants()


def test_allocate_zero_gives_nothing_and_changes_nothing() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(1)
    before = state(alloc)
    assert alloc.allocate(0) == []
    assert state(alloc) == before


def test_shared_block_returns_to_the_queue_only_when_its_last_reference_drops() -> None:
    alloc = BlockAllocator(3)
    [block_id] = alloc.allocate(1)
    alloc.share([block_id, block_id])
    # block 0: ref_count 3 (three block tables hold it)   free: [1, 2]
    assert alloc.ref_count(block_id) == 3
    assert alloc.num_free_blocks == 2
    alloc.free([block_id])
    alloc.free_one(block_id)
    assert alloc.ref_count(block_id) == 1
    assert alloc.free_block_ids() == [1, 2]
    alloc.free([block_id])
    # block 0: ref_count 0   free: [1, 2, 0]
    assert state(alloc) == ([1, 2, 0], [0, 0, 0])
    alloc.check_invariants()


def test_free_one_of_an_unshared_block_appends_it_to_the_tail_of_the_queue() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    # used: 0 1 2      free: [3]
    alloc.free_one(1)
    # used: 0 2        free: [3, 1]      (1 rejoins at the tail, behind 3)
    assert alloc.free_block_ids() == [3, 1]
    alloc.free_one(0)
    # used: 2          free: [3, 1, 0]
    assert state(alloc) == ([3, 1, 0], [0, 0, 1, 0])
    assert alloc.allocate(3) == [3, 1, 0]  # handed out oldest free first
    alloc.check_invariants()


def test_free_with_a_repeated_id_drops_one_reference_per_appearance() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(4)
    alloc.share([3])
    # block 3: ref_count 2
    alloc.free([3, 3])
    assert state(alloc) == ([3], [1, 1, 1, 0])
    alloc.check_invariants()


def test_queries_never_mutate() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(1)
    before = state(alloc)
    assert alloc.can_allocate(2) is True
    assert alloc.can_allocate(3) is False
    assert alloc.can_allocate(0) is True
    assert alloc.can_allocate(-1) is False
    assert alloc.next_free_block_id() == 1
    assert alloc.ref_count(0) == 1
    assert state(alloc) == before


def test_next_free_block_id_is_what_allocate_hands_out() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(2)
    alloc.free([0])
    # free: [2, 0]
    assert alloc.next_free_block_id() == 2
    assert alloc.allocate_one() == 2
    assert alloc.next_free_block_id() == 0


def test_free_block_ids_is_a_copy() -> None:
    alloc = BlockAllocator(2)
    ids = alloc.free_block_ids()
    ids.clear()
    assert alloc.free_block_ids() == [0, 1]


def test_grow_keeps_existing_ids_and_appends_new_ones_to_the_queue() -> None:
    alloc = BlockAllocator(2)
    alloc.allocate(2)
    alloc.free([1])
    # before: used 0, free [1]
    alloc.grow(3)
    # after:  used 0, free [1, 2, 3, 4]
    assert alloc.num_blocks == 5
    assert state(alloc) == ([1, 2, 3, 4], [1, 0, 0, 0, 0])
    alloc.check_invariants()


def test_check_invariants_catches_a_block_both_used_and_free() -> None:
    # The checker must be able to fail, or every invariant test is a tautology.
    alloc = BlockAllocator(3)
    alloc.allocate(1)
    alloc._queue.append(0)  # corrupt: block 0 is used (ref_count 1) and queued as free
    with pytest.raises(AssertionError, match="block 0"):
        alloc.check_invariants()


def test_check_invariants_catches_a_block_queued_twice() -> None:
    alloc = BlockAllocator(3)
    alloc._queue.append(2)
    with pytest.raises(AssertionError, match="twice"):
        alloc.check_invariants()


def test_allocator_deals_in_ints_only_and_never_imports_numpy() -> None:
    tree = ast.parse(inspect.getsource(pagedkv.blocks.allocator))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "numpy" not in imported
    assert imported <= {"__future__", "collections", "dataclasses", "pagedkv", "typing"}
    # ... nor do the pagedkv modules it imports (its errors and count checks).
    for module in (pagedkv.counts, pagedkv.errors):
        source = inspect.getsource(module)
        assert "import numpy" not in source and "from numpy" not in source, module.__name__


# ------------------------------------------------------------------ bad input


def _used_two_of_four() -> BlockAllocator:
    # used: 0 1   free: [2, 3]   ref counts: 1 1 0 0
    alloc = BlockAllocator(4)
    alloc.allocate(2)
    return alloc


# (id, call, error, builtin, message fragment naming the value)
BAD_CALLS: list[tuple[str, Callable[[BlockAllocator], Any], type[PagedKVError], type, str]] = [
    ("double free", lambda a: a.free([2]), DoubleFreeError, RuntimeError, "block 2"),
    ("double free, fast path", lambda a: a.free_one(3), DoubleFreeError, RuntimeError, "block 3"),
    ("free [1, 1] at ref_count 1", lambda a: a.free([1, 1]), DoubleFreeError, RuntimeError,
     "ref count 1 but was freed 2 times"),
    ("used then free id", lambda a: a.free([0, 2]), DoubleFreeError, RuntimeError, "block 2"),
    ("unknown id", lambda a: a.free([4]), UnknownBlockError, LookupError, "block id 4"),
    ("unknown id after a valid one", lambda a: a.free([0, 9]), UnknownBlockError, LookupError,
     "block id 9"),
    ("negative id", lambda a: a.free([-1]), UnknownBlockError, LookupError, "block id -1"),
    ("unknown id, fast path", lambda a: a.free_one(7), UnknownBlockError, LookupError, "block id 7"),
    ("id not an int", lambda a: a.free(["0"]), UnknownBlockError, LookupError, "'0'"),
    ("id a bool", lambda a: a.free([True]), UnknownBlockError, LookupError, "True"),
    ("ref_count of unknown id", lambda a: a.ref_count(4), UnknownBlockError, LookupError,
     "block id 4"),
    ("share a free block", lambda a: a.share([3]), BlockStateError, RuntimeError, "block 3"),
    ("share used then free", lambda a: a.share([0, 3]), BlockStateError, RuntimeError, "block 3"),
    ("share unknown id", lambda a: a.share([0, 8]), UnknownBlockError, LookupError, "block id 8"),
    ("exhausted allocate", lambda a: a.allocate(3), PoolExhaustedError, MemoryError,
     "need 3 blocks, 2 free of 4"),
    ("negative allocate", lambda a: a.allocate(-1), ConfigError, ValueError, "-1"),
    ("float allocate", lambda a: a.allocate(1.0), InputTypeError, TypeError, "1.0"),
    ("grow by zero", lambda a: a.grow(0), ConfigError, ValueError, "got 0"),
]


@pytest.mark.parametrize(
    ("call", "error", "builtin", "fragment"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_CALLS],
)
def test_bad_call_raises_and_changes_nothing(
    call: Callable[[BlockAllocator], Any], error: type, builtin: type, fragment: str
) -> None:
    alloc = _used_two_of_four()
    before = state(alloc)
    with pytest.raises(error, match=fragment) as info:
        call(alloc)
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, PagedKVError)
    assert state(alloc) == before
    assert alloc.num_free_blocks == 2
    alloc.check_invariants()


def test_exhausted_allocate_error_carries_the_numbers_and_a_hint() -> None:
    alloc = _used_two_of_four()
    with pytest.raises(PoolExhaustedError) as info:
        alloc.allocate(3)
    assert (info.value.num_needed, info.value.num_free, info.value.num_total) == (3, 2, 4)
    assert "free or close a sequence" in str(info.value)


def test_allocate_one_on_an_empty_queue_raises_and_changes_nothing() -> None:
    alloc = BlockAllocator(1)
    alloc.allocate_one()
    with pytest.raises(PoolExhaustedError, match="need 1 block, 0 free of 1"):
        alloc.allocate_one()
    with pytest.raises(PoolExhaustedError):
        alloc.next_free_block_id()
    assert state(alloc) == ([], [1])


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_too_few_blocks_is_a_config_error(num_blocks: int) -> None:
    with pytest.raises(ConfigError, match="num_blocks must be an int >= 1") as info:
        BlockAllocator(num_blocks)
    assert isinstance(info.value, ValueError)
    assert repr(num_blocks) in str(info.value)


@pytest.mark.parametrize("num_blocks", [True, 2.0, "4", None])
def test_num_blocks_of_another_type_is_an_input_type_error_as_in_the_pool(num_blocks: Any) -> None:
    # The same mistake raises the same error, with the same message, at every layer.
    with pytest.raises(InputTypeError, match="num_blocks must be an int >= 1") as allocator_error:
        BlockAllocator(num_blocks)
    with pytest.raises(InputTypeError) as pool_error:
        KVPool(num_blocks, head_dim=1)
    assert str(allocator_error.value) == str(pool_error.value)
    assert repr(num_blocks) in str(allocator_error.value)


# -------------------------------------------------------------- property test

# One operation on the allocator: ("allocate", n), ("free", i) with i an index
# into the currently used ids, or ("share", i).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 4)),
        st.tuples(st.just("free"), st.integers(0, 40)),
        st.tuples(st.just("share"), st.integers(0, 40)),
        st.tuples(st.just("grow"), st.integers(1, 3)),
    ),
    max_size=40,
)


@given(num_blocks=st.integers(1, 6), ops=operations)
def test_allocator_agrees_with_a_dict_of_ref_counts(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    alloc = BlockAllocator(num_blocks)
    model_refs: Counter[int] = Counter()
    model_free = list(range(num_blocks))  # the FIFO queue, head first
    for op, arg in ops:
        used = sorted(model_refs)
        if op == "allocate":
            if arg > len(model_free):
                with pytest.raises(PoolExhaustedError):
                    alloc.allocate(arg)
            else:
                expected, model_free = model_free[:arg], model_free[arg:]
                assert alloc.allocate(arg) == expected
                model_refs.update(expected)
        elif op == "grow":
            model_free += list(range(alloc.num_blocks, alloc.num_blocks + arg))
            alloc.grow(arg)
        elif not used:
            # nothing is used, so block 0 is free: freeing or sharing it is an error
            with pytest.raises(BlockStateError):  # DoubleFreeError when freed
                getattr(alloc, op)([0])
        else:
            block_id = used[arg % len(used)]
            getattr(alloc, op)([block_id])
            if op == "share":
                model_refs[block_id] += 1
            else:
                model_refs[block_id] -= 1
                if model_refs[block_id] == 0:
                    del model_refs[block_id]
                    model_free.append(block_id)
        alloc.check_invariants()
        assert alloc.free_block_ids() == model_free
        assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks
        for block_id in range(alloc.num_blocks):
            assert alloc.ref_count(block_id) == model_refs[block_id]
            assert alloc.is_shared(block_id) == (model_refs[block_id] > 1)


@given(
    num_used=st.integers(0, 8),
    num_cached=st.integers(0, 8),
    order=st.permutations(range(8)),
    num_taken=st.integers(0, 8),
)
def test_allocate_past_the_plain_blocks_is_allocate_one_n_times(
    num_used: int, num_cached: int, order: list[int], num_taken: int
) -> None:
    """Plain free blocks in queue order, then cached ones least recently freed first, each evicted."""

    def build() -> tuple[BlockAllocator, list[tuple[str, list[int] | int]]]:
        allocator = BlockAllocator(8)
        taken = allocator.allocate(8)
        keep = min(num_used, 8)
        freed = [taken[i] for i in order if i >= keep]
        cached = freed[:num_cached]
        for block_id in cached:
            allocator.mark_cached(block_id)
        allocator.free(freed)
        calls: list[tuple[str, list[int] | int]] = []
        allocator.on_evict = lambda block_id: calls.append(("evict", block_id))
        allocator.on_take = lambda block_ids: calls.append(("take", list(block_ids)))
        return allocator, calls

    batched, batched_calls = build()
    one_by_one, one_by_one_calls = build()
    if num_taken > one_by_one.num_free_blocks:
        with pytest.raises(PoolExhaustedError):
            batched.allocate(num_taken)
        assert batched_calls == []
        return
    ids = batched.allocate(num_taken)
    assert ids == [one_by_one.allocate_one() for _ in range(num_taken)]
    evicted = [call for call in one_by_one_calls if call[0] == "evict"]
    assert [call for call in batched_calls if call[0] == "evict"] == evicted
    assert [call for call in batched_calls if call[0] == "take"] == [("take", ids)]
    assert (batched.free_block_ids(), batched.cached_free_block_ids()) == (
        one_by_one.free_block_ids(),
        one_by_one.cached_free_block_ids(),
    )
    assert [batched.ref_count(i) for i in range(8)] == [one_by_one.ref_count(i) for i in range(8)]
    batched.check_invariants()
