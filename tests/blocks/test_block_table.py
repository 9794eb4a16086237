"""Tests for ``pagedkv.blocks.table``: logical index -> block and slot bookkeeping.

Diagrams use block_size 4: ``|x x x x|`` a held block with four cached tokens,
``.`` a free slot, ``-`` an evicted token; ``b7`` is block id 7.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.managers import ceil_div

from pagedkv.blocks.table import BlockTable
from pagedkv.errors import BlockTableError


def test_empty_table() -> None:
    table = BlockTable(block_size=4)
    assert table.block_ids == []
    assert table.num_blocks == 0
    assert table.num_tokens == 0
    assert table.num_live_tokens == 0
    assert table.live_ranges() == []
    table.check_invariants()


@pytest.mark.parametrize(
    ("num_tokens_before", "num_appended", "num_new"),
    [
        (0, 1, 1),  # first token of the first block
        (3, 1, 0),  # |x x x .| -> |x x x x|: the block becomes exactly full
        (4, 1, 1),  # |x x x x| -> |x x x x|x . . .|: first token of a new block
        (0, 4, 1),
        (0, 5, 2),
        (2, 7, 2),  # |x x . .| + 7 -> |x x x x|x x x x|x . . .|
        (5, 0, 0),
    ],
)
def test_num_new_blocks_at_block_boundaries(
    num_tokens_before: int, num_appended: int, num_new: int
) -> None:
    table = BlockTable(block_size=4)
    if num_tokens_before:
        table.append(num_tokens_before, list(range(table.num_new_blocks(num_tokens_before))))
    assert table.num_new_blocks(num_appended) == num_new


def test_slot_is_block_id_times_block_size_plus_offset() -> None:
    table = BlockTable(block_size=4)
    table.append(6, [7, 3])
    # logical index  0  1  2  3 | 4  5  .  .
    # block          b7          | b3
    # slot           28 29 30 31 | 12 13
    assert [table.slot(i) for i in range(6)] == [28, 29, 30, 31, 12, 13]
    assert table.last_block_id == 3
    assert table.is_one_run is False
    table.check_invariants()


def test_append_with_the_wrong_number_of_block_ids_is_refused_unchanged() -> None:
    table = BlockTable(block_size=4)
    table.append(3, [0])
    with pytest.raises(ValueError, match="needs 1 new blocks, got 0"):
        table.append(2, [])
    with pytest.raises(ValueError, match="needs 0 new blocks, got 1"):
        table.append(1, [5])
    assert (table.block_ids, table.num_tokens) == ([0], 3)


def test_evict_to_frees_a_block_only_once_every_token_in_it_is_evicted() -> None:
    table = BlockTable(block_size=4)
    table.append(10, [0, 1, 2])
    # logical index  0 1 2 3 | 4 5 6 7 | 8 9 . .
    # table          b0        b1        b2
    assert table.evict_to(3) == []
    # time 1:        - - - x | x x x x | x x . .   b0 still holds index 3
    assert table.block_ids == [0, 1, 2]
    assert table.num_live_tokens == 7
    assert table.evict_to(4) == [0]
    # time 2:        (freed) | x x x x | x x . .
    assert table.block_ids == [1, 2]
    assert table.first_block_index == 1
    assert table.evict_to(9) == [1]
    # time 3:                  (freed) | - x . .
    assert table.block_ids == [2]
    assert table.live_ranges() == [(9, 10)]
    assert table.slot(9) == 2 * 4 + 1
    table.check_invariants()


def test_evict_to_never_moves_the_window_backwards_or_past_the_end() -> None:
    table = BlockTable(block_size=2)
    table.append(5, [0, 1, 2])
    table.evict_to(3)
    assert table.evict_to(1) == []
    assert table.window_start == 3
    # Past the newest token: clamped to num_tokens. Every token is evicted, but
    # the newest block keeps its free slot for index 5, so only b1 goes back.
    # logical index  0 1 | 2 3 | 4 .
    # time 1:        (freed) - x | x .
    # time 2:        (freed) (freed) | - .
    assert table.evict_to(99) == [1]
    assert table.window_start == 5
    assert table.num_live_tokens == 0
    assert table.block_ids == [2]
    table.check_invariants()
    assert table.num_new_blocks(1) == 0
    table.append(1, [])
    assert table.slot(5) == 2 * 2 + 1
    # Once that block is full and evicted too, the table is empty and the next
    # token starts logical block 3 in a fresh block.
    assert table.evict_to(6) == [2]
    assert table.block_ids == []
    assert table.num_new_blocks(1) == 1
    table.append(1, [6])
    assert table.slot(6) == 6 * 2 + 0
    table.check_invariants()


def test_num_blocks_released_by_predicts_evict_to() -> None:
    table = BlockTable(block_size=4)
    table.append(10, [4, 5, 6])
    for window_start in range(12):
        twin = table.copy()
        assert table.num_blocks_released_by(window_start) == len(twin.evict_to(window_start))
    assert table.block_ids == [4, 5, 6]  # queries and the copies left it alone


def test_one_run_tracking_follows_appends_evictions_and_replacements() -> None:
    table = BlockTable(block_size=1)
    table.append(3, [4, 5, 7])
    # b4 b5 b7: one break (5 -> 7)
    assert table.is_one_run is False
    table.evict_to(2)
    # b7 alone is one run
    assert table.block_ids == [7]
    assert table.is_one_run is True
    table.append(1, [8])
    assert table.is_one_run is True
    assert table.replace_last(2) == 8
    assert table.block_ids == [7, 2]
    assert table.is_one_run is False
    assert table.replace_all([0, 1]) == [7, 2]
    assert table.is_one_run is True
    table.check_invariants()


def test_replace_all_refuses_the_wrong_number_of_ids() -> None:
    table = BlockTable(block_size=2)
    table.append(3, [0, 1])
    with pytest.raises(ValueError, match="holds 2 blocks, got 1"):
        table.replace_all([5])
    assert table.block_ids == [0, 1]


def test_clear_returns_every_id_newest_first_and_resets() -> None:
    table = BlockTable(block_size=2)
    table.append(5, [3, 1, 4])
    table.evict_to(2)
    assert table.clear() == [4, 1]
    assert (table.block_ids, table.num_tokens, table.window_start) == ([], 0, 0)
    table.check_invariants()
    table.append(1, [9])
    assert table.slot(0) == 18


def test_copy_is_independent() -> None:
    table = BlockTable(block_size=2)
    table.append(3, [0, 1])
    twin = table.copy()
    twin.append(2, [2])
    twin.evict_to(4)
    assert table.block_ids == [0, 1]
    assert table.num_tokens == 3
    assert twin.block_ids == [2]
    table.check_invariants()
    twin.check_invariants()


def test_sink_tokens_are_never_evicted() -> None:
    table = BlockTable(block_size=2, num_sink_tokens=1)
    table.append(6, [0, 1, 2])
    # logical index  0 1 | 2 3 | 4 5     index 0 is a sink
    # table          b0   | b1  | b2
    assert table.evict_to(4) == [1]
    # index 0 held (sink) | freed | 4 5
    assert table.block_ids == [0, 2]
    assert table.live_ranges() == [(0, 1), (4, 6)]
    assert table.num_live_tokens == 3
    assert table.slot(0) == 0
    assert table.slot(5) == 5
    table.check_invariants()


def test_check_invariants_catches_a_block_held_twice() -> None:
    table = BlockTable(block_size=1)
    table.append(2, [3, 3])
    with pytest.raises(AssertionError, match="appears twice"):
        table.check_invariants()


def test_check_invariants_catches_a_block_wholly_before_the_window() -> None:
    table = BlockTable(block_size=2)
    table.append(4, [0, 1])
    table.window_start = 2  # corrupt: moved without releasing b0
    with pytest.raises(AssertionError, match="wholly before"):
        table.check_invariants()


# -------------------------------------------------------------- property test


@given(
    block_size=st.integers(1, 4),
    steps=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), max_size=25),
)
def test_table_holds_exactly_the_logical_blocks_of_its_window(
    block_size: int, steps: list[tuple[int, int]]
) -> None:
    """Append ``n`` tokens then evict ``e`` more from the front, over and over."""
    table = BlockTable(block_size)
    next_id = 0
    where: dict[int, int] = {}  # logical block -> block id, as the model remembers it
    window_start = 0
    for num_appended, num_evicted in steps:
        new_ids = list(range(next_id, next_id + table.num_new_blocks(num_appended)))
        next_id += len(new_ids)
        first_new_block = ceil_div(table.num_tokens, block_size)
        for j, block_id in enumerate(new_ids):
            where[first_new_block + j] = block_id
        table.append(num_appended, new_ids)
        window_start = min(window_start + num_evicted, table.num_tokens)
        predicted = table.num_blocks_released_by(window_start)
        released = table.evict_to(window_start)
        assert len(released) == predicted
        for block_id in released:
            logical_block = next(j for j, b in where.items() if b == block_id)
            assert (logical_block + 1) * block_size <= window_start
            del where[logical_block]
        table.check_invariants()
        num_tokens = table.num_tokens
        assert table.num_live_tokens == num_tokens - window_start
        # Held: the logical block of window_start up to the one holding the newest
        # token. A block whose tokens are all evicted but which still has free
        # slots for the next tokens stays (it is the newest block).
        held = range(window_start // block_size, ceil_div(num_tokens, block_size))
        assert table.block_ids == [where[j] for j in held]
        assert set(where) == set(held)
        for index in range(window_start, num_tokens):
            block_id = where[index // block_size]
            assert table.slot(index) == block_id * block_size + index % block_size
        num_logical = ceil_div(num_tokens, block_size) + 1
        for lo in range(num_logical + 1):
            for hi in range(lo, num_logical + 1):
                assert table.ids_of_blocks(range(lo, hi)) == [where.get(j) for j in range(lo, hi)]


@given(
    block_size=st.integers(1, 4),
    num_sink_tokens=st.integers(0, 9),
    num_tokens=st.integers(0, 30),
    num_evicted=st.integers(0, 30),
)
def test_ids_of_blocks_are_holds_block_and_block_id_with_sinks(
    block_size: int, num_sink_tokens: int, num_tokens: int, num_evicted: int
) -> None:
    table = BlockTable(block_size, num_sink_tokens)
    table.append(num_tokens, list(range(100, 100 + table.num_new_blocks(num_tokens))))
    table.evict_to(min(num_sink_tokens + num_evicted, num_tokens))
    num_logical = ceil_div(num_tokens, block_size) + 1
    for lo in range(num_logical + 1):
        for hi in range(lo, num_logical + 1):
            expected = [table.block_id(j) if table.holds_block(j) else None for j in range(lo, hi)]
            assert table.ids_of_blocks(range(lo, hi)) == expected


@given(
    block_size=st.integers(1, 5),
    num_sink_tokens=st.integers(0, 9),
    num_tokens=st.integers(1, 40),
    num_evicted=st.integers(0, 40),
    data=st.data(),
)
def test_slot_array_of_any_held_ranges_is_the_scalar_slot_of_each_index(
    block_size: int, num_sink_tokens: int, num_tokens: int, num_evicted: int, data: st.DataObject
) -> None:
    """The vectorized slots (one window range: block by block; anything else: by index) match ``slot``."""
    table = BlockTable(block_size, num_sink_tokens)
    ids = data.draw(st.permutations(range(7, 7 + table.num_new_blocks(num_tokens))))
    table.append(num_tokens, list(ids))
    table.evict_to(min(num_sink_tokens + num_evicted, num_tokens))
    held = [index for start, end in table.live_ranges() for index in range(start, end)]
    if not held:  # every token evicted: nothing to read
        assert table.slot_array(table.live_ranges()).tolist() == []
        return
    lo = data.draw(st.integers(0, len(held) - 1))
    hi = data.draw(st.integers(lo, len(held)))
    window = [index for index in held[lo:hi] if index >= num_sink_tokens]
    one_run = hi > lo and held[hi - 1] - held[lo] == hi - 1 - lo
    for ranges in ([(held[lo], held[hi - 1] + 1)] if one_run else [], table.live_ranges(),
                   [(window[0], window[-1] + 1)] if window else []):
        expected = [table.slot(index) for start, end in ranges for index in range(start, end)]
        assert table.slot_array(ranges).tolist() == expected


def test_blocks_version_grows_with_every_change_of_the_held_blocks() -> None:
    # Page views trust an unchanged version to mean unchanged blocks: every command
    # that changes the held ids or their places must bump it; a token in a held block need not.
    table = BlockTable(block_size=2)
    seen = [table.blocks_version]

    def changed() -> None:
        assert table.blocks_version > seen[-1]
        seen.append(table.blocks_version)

    table.append(3, [4, 5])
    changed()
    table.append(1, [])  # fills block 5: same blocks
    assert table.blocks_version == seen[-1]
    table.append(1, [9])
    changed()
    table.replace_last(7)
    changed()
    table.evict_to(3)
    changed()
    table.replace_all([1, 2])
    changed()
    table.truncate(3)
    changed()
    twin = table.copy()
    assert twin.block_ids == table.block_ids
    table.clear()
    changed()


def test_blocks_version_stays_while_the_window_moves_inside_its_first_block() -> None:
    table = BlockTable(block_size=4)
    table.append(8, [1, 2])
    version = table.blocks_version
    table.evict_to(3)  # tokens 0..2 leave the window; block 1 still holds token 3
    assert table.blocks_version == version and table.block_ids == [1, 2]
    table.evict_to(4)  # block 1 is wholly out: released
    assert table.blocks_version > version and table.block_ids == [2]


@given(
    block_size=st.integers(1, 4),
    num_sink_tokens=st.integers(0, 5),
    counts=st.lists(st.integers(1, 9), max_size=12),
    data=st.data(),
)
def test_any_block_ids_append_the_same_by_runs_tokens_and_one_at_a_time(
    block_size: int, num_sink_tokens: int, counts: list[int], data: st.DataObject
) -> None:
    """``append`` of any ids (runs, gaps, shuffles) and ``append_token`` agree with a plain list."""
    bulk, single = BlockTable(block_size, num_sink_tokens), BlockTable(block_size, num_sink_tokens)
    unused = list(range(200))
    held: list[int] = []  # the model: every id appended, in order (nothing is evicted here)
    for count in counts:
        num_new = bulk.num_new_blocks(count)
        new_ids = data.draw(st.lists(st.sampled_from(unused), min_size=num_new, max_size=num_new,
                                     unique=True))
        for block_id in new_ids:
            unused.remove(block_id)
        bulk.append(count, new_ids)
        pending = list(new_ids)
        for _ in range(count):
            single.append_token(pending.pop(0) if single.num_new_blocks(1) else None)
        held += new_ids
        for table in (bulk, single):
            table.check_invariants()  # counts the breaks between ids from scratch
            assert table.block_ids == held
        num_sink_blocks = ceil_div(num_sink_tokens, block_size)
        window = held[num_sink_blocks:]
        one_run = not num_sink_tokens and all(b + 1 == c for b, c in pairwise(window))
        assert bulk.is_one_run == single.is_one_run == one_run
        assert bulk.num_tokens == single.num_tokens


def test_append_token_refuses_a_block_it_does_not_need_or_a_missing_one_unchanged() -> None:
    table = BlockTable(block_size=2)
    with pytest.raises(BlockTableError, match="needs 1 new blocks, got 0"):
        table.append_token(None)  # |. .|: the first token needs a block
    table.append_token(4)  # |x .| b4
    with pytest.raises(BlockTableError, match="needs 0 new blocks, got 1"):
        table.append_token(5)  # b4 still has room
    assert (table.num_tokens, table.block_ids) == (1, [4])
    table.check_invariants()
