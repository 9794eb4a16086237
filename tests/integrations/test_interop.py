"""Tests for ``pagedkv.integrations.interop``: FlashInfer's CSR arrays and vLLM's slot mapping.

CSR layouts are drawn per sequence; ``kv_indices[indptr[i]:indptr[i+1]]`` are
sequence ``i``'s pages, its last page holds ``kv_last_page_len[i]`` tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.managers import ceil_div, make_manager, settle

from pagedkv import SequenceStateError, UnknownSequenceError
from pagedkv.integrations.interop import PagedCSR, flashinfer_csr, slot_mapping

# -------------------------------------------------------------- FlashInfer CSR


def test_csr_by_hand() -> None:
    # block_size 4; the free queue hands out 0, 1, 2, ... in order
    #   a: 6 tokens   [0: a0..a3] [1: a4 a5 . .]        last page 2
    #   b: 3 tokens   [2: b0 b1 b2 .]                   last page 3
    #   c: 8 tokens   [3: c0..c3] [4: c4..c7]           last page 4 (full, never 0)
    m = make_manager(16)
    for s in "abc":
        m.add_sequence(s)
    settle(m, {"a": 6, "b": 3, "c": 8})
    csr = flashinfer_csr(m, ["a", "b", "c"])
    assert isinstance(csr, PagedCSR)
    assert csr.kv_indptr.tolist() == [0, 2, 3, 5]
    assert csr.kv_indices.tolist() == [0, 1, 2, 3, 4]
    assert csr.kv_last_page_len.tolist() == [2, 3, 4]
    assert csr.kv_first_page_offset.tolist() == [0, 0, 0]
    for array in (csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, csr.kv_first_page_offset):
        assert array.dtype == np.int32
    # order follows the ids given, and a subset is fine
    csr = flashinfer_csr(m, ["c", "a"])
    assert csr.kv_indptr.tolist() == [0, 2, 4]
    assert csr.kv_indices.tolist() == [3, 4, 0, 1]
    assert csr.kv_last_page_len.tolist() == [4, 2]


def test_csr_after_copy_on_write_shows_each_sequences_own_pages() -> None:
    # a [0: a0..a3] [1: a4 a5]   fork -> b; b appends: b copies block 1 to 2
    m = make_manager(16)
    m.add_sequence("a")
    settle(m, {"a": 6})
    m.fork("a", "b")
    settle(m, {"b": 1})
    csr = flashinfer_csr(m, ["a", "b"])
    assert csr.kv_indices.tolist() == [0, 1, 0, 2]
    assert csr.kv_last_page_len.tolist() == [2, 3]


def test_csr_windowed_first_page_offset() -> None:
    # block_size 4, max_size 3, 10 tokens; token 9 sees 7..9:
    #   logical   0          1              2
    #   held      (freed)    [x  x  x  t7]  [t8 t9 .  .]
    #   first_page_offset = 7 - 4 = 3, last_page_len = 2
    m = make_manager(16, max_size=3)
    m.add_sequence("a")
    for _ in range(10):
        settle(m, {"a": 1})
    csr = flashinfer_csr(m, ["a"])
    assert csr.kv_indptr.tolist() == [0, 2]
    assert csr.kv_indices.tolist() == m.block_table("a").block_ids
    assert len(csr.kv_indices) == 2
    assert csr.kv_first_page_offset.tolist() == [3]
    assert csr.kv_last_page_len.tolist() == [2]
    # pages hold offset .. (pages - 1) * bs + last_page_len: exactly the window
    pages = int(csr.kv_indptr[1])
    assert (pages - 1) * 4 + int(csr.kv_last_page_len[0]) - int(csr.kv_first_page_offset[0]) == 3


def test_csr_refuses_sequences_it_cannot_export() -> None:
    m = make_manager(8, host_blocks=8)
    for s in "abcd":
        m.add_sequence(s)
    settle(m, {"a": 2, "b": 2, "c": 1})
    m.preempt("a")
    m.preempt("b", "swap")
    before = m.pool.allocator.free_block_ids()
    with pytest.raises(SequenceStateError, match="'a' is preempted, not running"):
        flashinfer_csr(m, ["c", "a"])
    with pytest.raises(SequenceStateError, match="'b' is swapped"):
        flashinfer_csr(m, ["b"])
    with pytest.raises(SequenceStateError, match="'d' holds no tokens"):
        flashinfer_csr(m, ["d"])
    with pytest.raises(UnknownSequenceError, match="no sequence 'zz'"):
        flashinfer_csr(m, ["zz"])
    assert m.pool.allocator.free_block_ids() == before


@given(
    block_size=st.integers(1, 6),
    window=st.none() | st.integers(1, 9),
    steps=st.lists(
        st.tuples(st.sampled_from(["reserve", "fork", "free"]), st.integers(0, 3), st.integers(1, 7)),
        min_size=1,
        max_size=25,
    ),
)
def test_csr_last_page_len_is_always_between_1_and_block_size(
    block_size: int, window: int | None, steps: list[tuple[str, int, int]]
) -> None:
    # FlashInfer #320: a last_page_len above page_size was accepted silently.
    m = make_manager(num_blocks=64, block_size=block_size, max_size=window)
    live: list[str] = []
    for number, (op, pick, size) in enumerate(steps):
        if op == "reserve" or not live:
            if not live or pick == 0:
                live.append(f"s{number}")
                m.add_sequence(live[-1])
            target = live[pick % len(live)]
            if m.can_reserve({target: size}):
                settle(m, {target: size})
        elif op == "fork":
            child = f"s{number}"
            m.fork(live[pick % len(live)], child)
            live.append(child)
        else:
            m.free(live.pop(pick % len(live)))
        exported = [s for s in live if m.num_tokens(s) > 0]
        if not exported:
            continue
        csr = flashinfer_csr(m, exported)
        assert csr.kv_indptr[0] == 0
        assert np.all(np.diff(csr.kv_indptr) >= 1)
        for i, s in enumerate(exported):
            table = m.block_table(s)
            pages = csr.kv_indices[csr.kv_indptr[i] : csr.kv_indptr[i + 1]].tolist()
            assert pages == table.block_ids
            last = int(csr.kv_last_page_len[i])
            assert 1 <= last <= block_size
            assert last == m.num_tokens(s) - (m.num_tokens(s) - 1) // block_size * block_size
            offset = int(csr.kv_first_page_offset[i])
            assert 0 <= offset < block_size
            # the pages hold exactly the tokens the sequence still holds
            assert (len(pages) - 1) * block_size + last - offset == table.num_live_tokens
        m.check_invariants()


# ------------------------------------------------------------- slot mapping


def test_slot_mapping_by_hand() -> None:
    # block_size 4: a gets [0, 1], b gets [2]; then a appends 3 more:
    #   a: a6 a7 -> block 1 offsets 2, 3 (slots 6, 7); a8 -> new block 3 offset 0 (slot 12)
    m = make_manager(16)
    m.add_sequence("a")
    m.add_sequence("b")
    batch = m.reserve({"a": 6, "b": 3})
    assert batch.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert batch.slot_mapping.dtype == np.int64
    assert batch.query_start.tolist() == [0, 6, 9]
    assert batch.first_positions == (0, 0)
    k = np.zeros((9, 1, 1))
    m.write(0, batch, k, k)
    batch = m.reserve({"a": 3})
    assert batch.slot_mapping.tolist() == [6, 7, 12]
    assert batch.first_positions == (6,)
    assert slot_mapping([0, 1, 3], [6, 7, 8], 4).tolist() == [6, 7, 12]
    assert slot_mapping([3, 7], [0, 5], 4).dtype == np.int64


@given(
    block_size=st.integers(1, 5),
    window=st.none() | st.integers(1, 6),
    sinks=st.integers(0, 2),
    sizes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=12),
    heads=st.integers(1, 2),
)
def test_batch_slot_mapping_matches_the_tables_and_writes_land_there(
    block_size: int, window: int | None, sinks: int, sizes: list[tuple[int, int]], heads: int
) -> None:
    m = make_manager(
        96,
        block_size=block_size,
        head_dim=2,
        num_kv_heads=heads,
        num_layers=2,
        max_size=window,
        num_sink_tokens=sinks,
    )
    pool = m.pool
    names = ["a", "b", "c"]
    for s in names:
        m.add_sequence(s)
    rng = np.random.default_rng(len(sizes))
    for pick, size in sizes:
        request = {names[pick]: size, names[(pick + 1) % 3]: 1}
        batch = m.reserve(request)
        # independent: slot = block_id * block_size + offset from each table
        expected = []
        for s, first, n in zip(batch.seq_ids, batch.first_positions, batch.num_new_tokens):
            table = m.block_table(s)
            num_sink_blocks = ceil_div(sinks, block_size)
            for position in range(first, first + n):
                logical = position // block_size
                index = (
                    logical
                    if logical < num_sink_blocks
                    else (logical - table.first_block_index + min(num_sink_blocks, table.num_blocks))
                )
                expected.append(table.block_ids[index] * block_size + position % block_size)
        assert batch.slot_mapping.tolist() == expected
        assert len(set(expected)) == len(expected)
        for layer in range(2):
            k = rng.standard_normal((batch.num_tokens, heads, 2))
            v = rng.standard_normal((batch.num_tokens, heads, 2))
            m.write(layer, batch, k, v)
            for t, slot in enumerate(batch.slot_mapping.tolist()):
                block_id, offset = divmod(slot, block_size)
                np.testing.assert_array_equal(pool.keys(layer)[:, block_id, offset], k[t])
                np.testing.assert_array_equal(pool.values(layer)[:, block_id, offset], v[t])
        m.check_invariants()


def test_interop_slot_mapping_function_matches_a_table_without_eviction() -> None:
    m = make_manager(16, block_size=3)
    m.add_sequence("a")
    m.reserve({"a": 5})
    m.add_sequence("b")
    batch = m.reserve({"b": 2})
    table = m.block_table("b")
    assert slot_mapping(table.block_ids, [0, 1], 3).tolist() == batch.slot_mapping.tolist()
    assert slot_mapping([2, 0], [0, 1, 2, 3, 5], 3).tolist() == [6, 7, 8, 0, 2]
