"""Issue 27, defect 8 and the bad-input leftovers: copies that are copies, typed errors that change nothing.

Defect 8: ``KVCache.keys()`` / ``values()`` are documented as copies but
returned views of the pool's storage (a run of blocks) or of its gather
scratch, so a returned array changed under its reader::

    shared pool:  a.keys() -> view of the pool's scratch; b.keys() overwrites it
    private pool: c.keys() -> view of blocks 0..1; c's next attends re-lay them

Leftovers: each bad input raises a ``PagedKVError`` naming the value, and
the cache, pool, manager or file system is exactly as before.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.managers import make_manager, manager_state, pool_state, settle

from pagedkv import (
    DuplicateSequenceError,
    InputTypeError,
    KVCache,
    KVPool,
    ReadOnlyArrayError,
    SequenceStateError,
    SnapshotError,
)
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.prefix.cache import PrefixCache
from pagedkv.prefix.keys import encode_extra_keys
from pagedkv.snapshot import save

# ------------------------------------------------- defect 8: keys()/values() copies


def _step(cache: KVCache, i: int, head_dim: int) -> None:
    row = np.full(head_dim, float(i))
    cache.attend(row, row + 0.5, row - 0.5)


def _private(max_size: int | None, block_size: int, head_dim: int) -> KVCache:
    return KVCache(max_size=max_size, block_size=block_size)


# (max_size, block_size, head_dim): an unbounded private pool, a windowed one that
# re-lays its blocks (block_size 2), and a window whose blocks page views can map.
PRIVATE_SHAPES = [(None, 2, 2), (3, 2, 2), (5, 16, 32)]


@pytest.mark.parametrize(("max_size", "block_size", "head_dim"), PRIVATE_SHAPES)
@pytest.mark.parametrize("side", ["keys", "values"])
def test_a_private_caches_entries_do_not_change_as_it_keeps_attending(
    max_size: int | None, block_size: int, head_dim: int, side: str
) -> None:
    cache = _private(max_size, block_size, head_dim)
    for i in range(3):
        _step(cache, i, head_dim)
    entries = getattr(cache, side)()
    before = entries.copy()
    for i in range(3, 40):  # past the window: evictions, re-lays, a grown pool
        _step(cache, i, head_dim)
    np.testing.assert_array_equal(entries, before)


@pytest.mark.parametrize(("max_size", "block_size", "head_dim"), PRIVATE_SHAPES)
@pytest.mark.parametrize("side", ["keys", "values"])
def test_editing_a_private_caches_entries_leaves_the_cache_as_it_was(
    max_size: int | None, block_size: int, head_dim: int, side: str
) -> None:
    cache = _private(max_size, block_size, head_dim)
    for i in range(4):
        _step(cache, i, head_dim)
    expected = getattr(cache, side)().copy()
    pages = pool_state(cache.pool)
    getattr(cache, side)()[...] = 1000.0
    np.testing.assert_array_equal(getattr(cache, side)(), expected)
    assert pool_state(cache.pool) == pages


@pytest.mark.parametrize("max_size", [None, 3])
@pytest.mark.parametrize("side", ["keys", "values"])
def test_a_caches_entries_do_not_change_when_another_cache_on_its_pool_reads_or_attends(
    max_size: int | None, side: str
) -> None:
    pool = KVPool(32, block_size=2, head_dim=2)
    first, second = KVCache(max_size, pool=pool), KVCache(max_size, pool=pool)
    for i in range(5):  # interleaved: neither table is one run of ids, so reads gather
        _step(first, i, 2)
        _step(second, 100 + i, 2)
    entries = getattr(first, side)()
    before = entries.copy()
    # Checked after each call: first's own next gather would refill the same
    # scratch with the same values and hide the overwrite.
    getattr(second, side)()
    np.testing.assert_array_equal(entries, before)
    _step(second, 200, 2)
    np.testing.assert_array_equal(entries, before)
    _step(first, 5, 2)
    np.testing.assert_array_equal(entries, before)
    getattr(first, side)()[...] = -1.0
    last = 5.0 + (0.5 if side == "keys" else -0.5)  # _step(first, 5, 2)'s key or value
    np.testing.assert_array_equal(getattr(first, side)()[-1], np.full(2, last))


def test_an_empty_caches_entries_are_new_empty_arrays() -> None:
    cache = KVCache(block_size=2)
    assert cache.keys().shape == (0, 0) and cache.values().shape == (0, 0)


# ------------------------------------------------------------- leftovers: the pool


def test_a_pool_without_head_dim_is_a_typed_error() -> None:
    with pytest.raises(InputTypeError, match=r"needs head_dim .*got None"):
        KVPool(8)


@pytest.mark.parametrize("growable", ["yes", 1, None])
def test_a_pool_refuses_a_growable_that_is_not_a_bool(growable: Any) -> None:
    with pytest.raises(InputTypeError, match=f"growable must be True or False, got {growable!r}"):
        KVPool(8, head_dim=2, growable=growable)


# ------------------------------------------------------ leftovers: extra keys


@pytest.mark.parametrize(("extra_keys", "fragment"), [
    ({"salt": "a", 1: "b"}, "got 1"),
    ({"salt": "a", b"adapter": "b"}, "got b'adapter'"),
    ({"salt": "a", None: "b"}, "got None"),
])
def test_extra_keys_of_mixed_kind_types_are_a_typed_error_and_admit_nothing(
    extra_keys: Any, fragment: str
) -> None:
    with pytest.raises(InputTypeError, match=f"kind must be a str.*{fragment}"):
        encode_extra_keys(extra_keys)
    manager = make_manager(8, enable_prefix_caching=True)
    before = manager_state(manager)
    with pytest.raises(InputTypeError, match=fragment):
        manager.add_sequence("s", [1, 2, 3], extra_keys=extra_keys)
    assert manager_state(manager) == before
    assert list(manager.seq_ids) == []


def test_extra_keys_that_are_not_a_mapping_are_a_typed_error() -> None:
    with pytest.raises(InputTypeError, match=r"extra_keys must be a dict .*\('salt', 'a'\)"):
        encode_extra_keys([("salt", "a")])  # type: ignore[arg-type]


# ---------------------------------------------------- leftovers: the prefix cache


@pytest.mark.parametrize("keys", [None, 7, b"key", "key"])
def test_longest_prefix_of_no_list_is_a_typed_error(keys: Any) -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    cache.register(allocator.allocate_one(), b"k")
    fragment = "keys must be a list of block keys.*got " + re.escape(repr(keys))
    with pytest.raises(InputTypeError, match=fragment):
        cache.longest_prefix(keys)
    assert cache.longest_prefix([b"k", b"other"]) == [0]
    assert cache.longest_prefix((b"k",)) == [0]


@pytest.mark.parametrize("key", ["k", 7, None, bytearray(b"k")])
def test_registering_a_block_under_a_key_that_is_not_bytes_is_a_typed_error(key: Any) -> None:
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator)
    block_id = allocator.allocate_one()
    with pytest.raises(InputTypeError, match=re.escape(f"block key must be bytes, got {key!r}")):
        cache.register(block_id, key)
    assert cache.num_cached_blocks == 0 and cache.key_of(block_id) is None
    assert not allocator.is_cached(block_id)
    cache.check_invariants()
    assert cache.register(block_id, b"k")


# ------------------------------------------------------- leftovers: snapshots


@pytest.mark.parametrize("sign", [1, -1])
def test_saving_a_sequence_id_too_long_for_json_is_a_snapshot_error_and_writes_nothing(
    tmp_path: Path, sign: int
) -> None:
    limit = sys.get_int_max_str_digits()
    if not limit:
        pytest.skip("this interpreter has no int-to-str digit limit")
    seq_id = sign * 10 ** (limit + 700)
    manager = make_manager(8)
    manager.add_sequence(seq_id)
    settle(manager, {seq_id: 3})
    before = manager_state(manager)
    fragment = rf"sequence id -?0x[0-9a-f]+\.\.\. \(\d+ bits\) has more than {limit}"
    with pytest.raises(SnapshotError, match=fragment):
        save(manager, tmp_path / "manager.snap")
    assert list(tmp_path.iterdir()) == []
    assert manager_state(manager) == before


# ---------------------------------------------------------- leftovers: a Batch


def _edits() -> list[Any]:
    def set_item(array: Any) -> None:
        array[0] = 0

    def add_in_place(array: Any) -> None:
        array += 1

    def fill(array: Any) -> None:
        array.fill(3)

    def ufunc_out(array: Any) -> None:
        np.multiply(array, 2, out=array)

    return [set_item, add_in_place, fill, ufunc_out]


@pytest.mark.parametrize("edit", _edits(), ids=lambda edit: edit.__name__)
@pytest.mark.parametrize("field", ["slot_mapping", "query_start"])
def test_editing_a_batchs_array_in_place_is_a_typed_error_and_changes_nothing(edit: Any, field: str) -> None:
    manager = make_manager(8)
    for seq_id in ("a", "b"):
        manager.add_sequence(seq_id)
    batch = manager.reserve({"a": 3, "b": 2})
    array = getattr(batch, field)
    before_array, before = array.copy(), manager_state(manager)
    with pytest.raises(ReadOnlyArrayError, match=r"read-only.*got "):
        edit(array)
    np.testing.assert_array_equal(getattr(batch, field), before_array)
    assert manager_state(manager) == before
    kv = np.ones((5, 1, 1))
    manager.write(0, batch, kv, kv)  # the batch is still the one reserve() returned
    manager.check_invariants()


def test_arithmetic_on_a_batchs_arrays_gives_plain_writable_arrays() -> None:
    manager = make_manager(8)
    manager.add_sequence("a")
    batch = manager.reserve({"a": 3})
    shifted = batch.slot_mapping + 1
    assert type(shifted) is np.ndarray and shifted.flags.writeable
    shifted[0] = 0
    copied = np.array(batch.slot_mapping)
    copied[0] = 0
    assert batch.slot_mapping.tolist() == [0, 1, 2]


# ------------------------------------------------ newcomers: preempted ids and {}


def _preempted() -> Any:
    manager = make_manager(8)
    manager.add_sequence("p")
    settle(manager, {"p": 2})
    manager.preempt("p")
    return manager


def test_adding_a_preempted_id_says_resume_is_next() -> None:
    manager = _preempted()
    before = manager_state(manager)
    with pytest.raises(DuplicateSequenceError, match=r"'p' already exists \(preempted: resume\('p'\)"):
        manager.add_sequence("p")
    assert manager_state(manager) == before


def test_adding_a_running_id_gives_no_resume_hint() -> None:
    manager = make_manager(8)
    manager.add_sequence("r")
    with pytest.raises(DuplicateSequenceError) as raised:
        manager.add_sequence("r")
    assert "resume" not in str(raised.value)


def test_reserving_for_a_preempted_id_names_resume() -> None:
    manager = _preempted()
    before = manager_state(manager)
    for call in (manager.reserve, manager.can_reserve, manager.plan):
        with pytest.raises(SequenceStateError, match=r"'p': it is preempted; call resume\('p'\) first"):
            call({"p": 1})
        assert manager_state(manager) == before


def test_can_reserve_of_nothing_answers_true_and_changes_nothing() -> None:
    manager = make_manager(8)
    manager.add_sequence("a")
    settle(manager, {"a": 3})
    before = manager_state(manager)
    assert manager.can_reserve({}) is True
    plan = manager.plan({})
    assert plan.fits and plan.num_new_blocks == 0
    assert manager_state(manager) == before
    # The command agrees: an empty step, nothing changed (see tests/manager/test_empty_step.py).
    assert manager.reserve({}).num_seqs == 0
    assert manager_state(manager) == before
