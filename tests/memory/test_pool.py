"""Tests for ``pagedkv.memory.pool``: the shared block pool's storage, gather and invariants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.blocks.table import BlockTable, ReadPlan
from pagedkv.errors import ConfigError, InputTypeError, PagedKVError
from pagedkv.memory.pool import KVPool


def fill(pool: KVPool, table: BlockTable, num_tokens: int, start: float = 0.0) -> None:
    """Append ``num_tokens`` tokens whose key is ``start + index`` in every element."""
    base = table.num_tokens
    new_ids = pool.allocator.allocate(table.num_new_blocks(num_tokens))
    table.append(num_tokens, new_ids)
    shape = (pool.num_kv_heads, pool.head_dim)
    for index in range(base, base + num_tokens):
        block_id, offset = divmod(table.slot(index), pool.block_size)
        value = np.full(shape, start + index)
        pool.write_one(0, block_id, offset, value, -value)


def test_storage_layout_and_sizes() -> None:
    pool = KVPool(5, block_size=4, num_kv_heads=2, head_dim=3, dtype=np.float32)
    assert pool.keys(0).shape == (2, 5, 4, 3)  # (num_kv_heads, num_blocks, block_size, head_dim)
    assert pool.values(0).shape == (2, 5, 4, 3)
    assert pool.keys(0).dtype == np.float32
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (5, 5, 0)
    assert pool.bytes_per_block == 2 * 2 * 4 * 3 * 4
    assert pool.growable is False
    pool.check_invariants()


def test_every_layer_has_its_own_storage_indexed_by_the_same_ids() -> None:
    pool = KVPool(2, block_size=1, head_dim=1, num_layers=3)
    pool.write_one(2, 1, 0, np.array([[5.0]]), np.array([[6.0]]))
    assert pool.keys(2)[0, 1, 0, 0] == 5.0
    assert pool.keys(0)[0, 1, 0, 0] == 0.0
    assert pool.bytes_per_block == 2 * 3 * 8


def test_fixed_pool_can_allocate_only_what_is_free_growable_always() -> None:
    fixed = KVPool(2, block_size=1, head_dim=1)
    growable = KVPool(2, block_size=1, head_dim=1, growable=True)
    assert fixed.can_allocate(2) and not fixed.can_allocate(3)
    assert growable.can_allocate(3)


def test_gather_of_one_run_is_a_view_of_storage() -> None:
    pool = KVPool(4, block_size=2, head_dim=1)
    table = BlockTable(2)
    fill(pool, table, 3)
    # table [b0, b1] is one run: head plane |0 1|2 .|  -> view of 3 tokens
    keys, values = pool.gather(0, table.read_plan())
    assert keys.shape == (1, 3, 1)
    assert keys[0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert values[0, :, 0].tolist() == [-0.0, -1.0, -2.0]
    assert np.shares_memory(keys, pool.keys(0))


def test_gather_of_scattered_blocks_copies_in_logical_order() -> None:
    pool = KVPool(4, block_size=2, num_kv_heads=2, head_dim=2)
    pool.allocator.allocate(2)
    pool.allocator.free([0])  # free: [2, 3, 0]
    table = BlockTable(2)
    fill(pool, table, 6)
    # logical block 0 1 2 -> b2 b3 b0: not one run, so gathered into scratch
    assert table.block_ids == [2, 3, 0]
    keys, values = pool.gather(0, table.read_plan())
    assert keys.shape == (2, 6, 2)
    assert keys[1, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert values[0, :, 1].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
    assert not np.shares_memory(keys, pool.keys(0))


def test_gather_starts_mid_block_after_eviction() -> None:
    pool = KVPool(4, block_size=4, head_dim=1)
    table = BlockTable(4)
    fill(pool, table, 7)
    released = table.evict_to(5)
    # logical index  0 1 2 3 | 4 5 6 .
    # state          (freed)   - x x .     window_start 5
    assert released == [0]
    pool.allocator.free(released)
    keys, _ = pool.gather(0, table.read_plan())
    assert keys[0, :, 0].tolist() == [5.0, 6.0]


def test_gather_of_an_empty_table_is_empty() -> None:
    pool = KVPool(2, block_size=2, num_kv_heads=3, head_dim=2)
    keys, values = pool.gather(0, BlockTable(2).read_plan())
    assert keys.shape == values.shape == (3, 0, 2)


def test_gather_slots_and_write_many() -> None:
    pool = KVPool(3, block_size=2, head_dim=1)
    slots = np.array([5, 0, 3], np.intp)
    keys = np.array([[[1.0]], [[2.0]], [[3.0]]])  # (n, num_kv_heads, head_dim)
    pool.write(0, slots, keys, 10 * keys)
    got_keys, got_values = pool.gather(0, ReadPlan(len(slots), slots=slots))
    assert got_keys[0, :, 0].tolist() == [1.0, 2.0, 3.0]
    assert got_values[0, :, 0].tolist() == [10.0, 20.0, 30.0]
    assert pool.keys(0)[0, 2, 1, 0] == 1.0  # slot 5 = block 2, offset 1


def test_copy_blocks_copies_keys_and_values() -> None:
    pool = KVPool(3, block_size=2, head_dim=1)
    pool.write_one(0, 0, 1, np.array([[7.0]]), np.array([[8.0]]))
    pool.copy_blocks([0], [2])
    assert pool.keys(0)[0, 2, 1, 0] == 7.0
    assert pool.values(0)[0, 2, 1, 0] == 8.0


def test_grow_keeps_contents_and_ids_and_adds_free_blocks() -> None:
    pool = KVPool(2, block_size=2, head_dim=1, growable=True)
    table = BlockTable(2)
    fill(pool, table, 4, start=1.0)
    pool.attach(table)  # a table is a BlockHolder; the pool holds it weakly
    pool.grow(3)
    assert pool.num_blocks == 5
    assert pool.keys(0).shape == (1, 5, 2, 1)
    assert pool.allocator.free_block_ids() == [2, 3, 4]
    keys, _ = pool.gather(0, table.read_plan())
    assert keys[0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    pool.check_invariants()


def test_check_invariants_counts_the_block_tables_of_attached_owners() -> None:
    pool = KVPool(3, block_size=1, head_dim=1)
    table = BlockTable(1)
    fill(pool, table, 2)
    pool.attach(table)
    pool.check_invariants()
    pool.allocator.share([0])  # a reference no block table accounts for
    with pytest.raises(AssertionError, match="block 0 has ref count 2 but 1 block tables"):
        pool.check_invariants()
    pool.allocator.free([0])
    pool.detach(table)
    # Detached, the owner's blocks look leaked: ref count 1, held by nobody.
    with pytest.raises(AssertionError, match="ref count 1 but 0 block tables"):
        pool.check_invariants()


# ------------------------------------------------------------------ bad input

BAD_POOLS: list[tuple[str, dict[str, Any], type[PagedKVError], type, str]] = [
    ("no blocks", {"num_blocks": 0}, ConfigError, ValueError, "num_blocks must be an int >= 1, got 0"),
    ("negative blocks", {"num_blocks": -1}, ConfigError, ValueError, "got -1"),
    ("bool blocks", {"num_blocks": True}, InputTypeError, TypeError, "got True"),
    ("block_size 0", {"block_size": 0}, ConfigError, ValueError, "block_size must be an int >= 1"),
    ("float block_size", {"block_size": 2.0}, InputTypeError, TypeError, "got 2.0"),
    ("head_dim 0", {"head_dim": 0}, ConfigError, ValueError, "head_dim must be an int >= 1"),
    ("string head_dim", {"head_dim": "2"}, InputTypeError, TypeError, "got '2'"),
    ("no kv heads", {"num_kv_heads": 0}, ConfigError, ValueError, "num_kv_heads"),
    ("no layers", {"num_layers": 0}, ConfigError, ValueError, "num_layers"),
    ("float16", {"dtype": np.float16}, ConfigError, ValueError, "float16"),
    ("int dtype", {"dtype": np.int64}, ConfigError, ValueError, "int64"),
    ("not a dtype", {"dtype": "nonsense"}, InputTypeError, TypeError, "'nonsense'"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "builtin", "fragment"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_POOLS],
)
def test_bad_pool_config_raises(
    kwargs: dict[str, Any], error: type, builtin: type, fragment: str
) -> None:
    arguments: dict[str, Any] = {"num_blocks": 4, "block_size": 2, "head_dim": 2, **kwargs}
    with pytest.raises(error, match=fragment) as info:
        KVPool(**arguments)
    assert isinstance(info.value, builtin)


def test_a_fixed_pool_refuses_to_grow_and_changes_nothing() -> None:
    pool = KVPool(2, block_size=2, head_dim=1)
    with pytest.raises(ConfigError, match="fixed size of 2 blocks"):
        pool.grow(2)
    assert pool.num_blocks == 2 and pool.num_free_blocks == 2 and pool.keys(0).shape == (1, 2, 2, 1)


@given(
    block_size=st.integers(1, 5),
    offset_seed=st.integers(0, 4),
    num_tokens=st.integers(1, 23),
    order=st.sampled_from(["ascending", "descending", "shuffled"]),
    data=st.data(),
)
def test_a_run_written_by_blocks_lands_where_its_slots_say(
    block_size: int, offset_seed: int, num_tokens: int, order: str, data: st.DataObject
) -> None:
    """``write_run`` against the slot rule written out by hand (``block_id * block_size + offset``)."""
    offset = offset_seed % block_size
    num_blocks = -(-(offset + num_tokens) // block_size)
    pool = KVPool(32, block_size=block_size, num_kv_heads=2, head_dim=2)
    start = data.draw(st.integers(0, 32 - num_blocks))
    ids = list(range(start, start + num_blocks))
    if order == "descending":
        ids.reverse()
    elif order == "shuffled":
        ids = data.draw(st.permutations(range(32)))[:num_blocks]
    keys = np.arange(num_tokens * 4, dtype=np.float64).reshape(num_tokens, 2, 2) + 1.0
    pool.write_run(0, ids, offset, keys, -keys)
    expected_keys = np.zeros((32 * block_size, 2, 2))
    for index in range(num_tokens):  # token index -> its slot, the rule by hand
        logical = offset + index
        expected_keys[ids[logical // block_size] * block_size + logical % block_size] = keys[index]
    np.testing.assert_array_equal(pool.key_pages(0).reshape(32 * block_size, 2, 2), expected_keys)
    np.testing.assert_array_equal(pool.value_pages(0).reshape(32 * block_size, 2, 2), -expected_keys)


def test_a_run_is_not_written_by_blocks_into_codes_and_nothing_changes() -> None:
    pool = KVPool(4, block_size=2, head_dim=2, key_dtype="float16")
    with pytest.raises(ConfigError, match="quantized pool is written by slot"):
        pool.write_run(0, [1], 0, np.ones((2, 1, 2)), np.ones((2, 1, 2)))
    assert not pool.key_pages(0).any() and not pool.value_pages(0).any()
