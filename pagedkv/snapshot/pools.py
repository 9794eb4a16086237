"""One saved pool: its configuration, allocator state and pages, validated before anything is built.

A :class:`PoolPlan` reads one entry of the state's ``pools`` and the page
tensors it names; it allocates nothing until ``build``. The allocator state
is checked as it is saved, compactly (used ids, free runs, cached ids: the
JSON's own size, never a Python object per free block), and becomes an
``AllocatorState`` only at ``SavedAllocator.state``, right before the
allocator takes it through its own ``_restore_state``. The built object's
``check_invariants`` then runs every class's own rules.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.allocator import AllocatorState
from pagedkv.memory.pool import KVPool
from pagedkv.memory.quantization import StorageFormat, bytes_per_token, storage_format
from pagedkv.snapshot.format import Tensors, page_parts, tensor_name
from pagedkv.snapshot.schema import DTYPES, STORAGE, Reader, fail, pair, shown

__all__ = ["BYTES_PER_BLOCK", "PoolPlan", "SavedAllocator", "check_keys", "check_pools"]

#: Bytes counted against ``max_bytes`` for every block of a pool loaded, on
#: top of its pages: what building the allocator and proving the result cost
#: at the peak (the constructor's lists, the restored state, the copies
#: ``_restore_state`` keeps, and the sets ``check_invariants`` builds). Measured
#: with tracemalloc (CPython 3.11, 40 k to 6 M free blocks): 104 to 136 bytes a
#: block, depending on where CPython's set resizing falls; the test
#: ``tests/snapshot/test_snapshot_hostile.py`` fails should a load ever peak above it.
BYTES_PER_BLOCK = 160


@dataclass(frozen=True, slots=True)
class SavedAllocator:
    """A pool's saved allocator state, checked, and as compact as the JSON it came from.

    Attributes:
        num_blocks: the pool's blocks.
        used: ref count of each used block.
        free_runs: the plain free queue, in order, as ``(first_id, length)`` runs.
        cached_free: the cached free queue, next to evict first.
        cached: every block marked cached, ascending.
    """

    num_blocks: int
    used: dict[int, int]
    free_runs: list[tuple[int, int]]
    cached_free: list[int]
    cached: list[int]

    def state(self, unkeyed: set[int] | frozenset[int] = frozenset()) -> AllocatorState:
        """The ``AllocatorState`` (a Python int per block from here on), ``unkeyed`` blocks not cached.

        An unkeyed cached free block joins the plain free queue's tail, in
        eviction order, so blocks are still handed out in the saved order::

            saved     plain [4 5]  cached free [2 7]   -> allocates 4 5 2 7
            unkeyed   plain [4 5 2 7]                  -> allocates 4 5 2 7
        """
        ref_counts = [0] * self.num_blocks
        for block_id, count in self.used.items():
            ref_counts[block_id] = count
        free = list(chain.from_iterable(range(first, first + length) for first, length in self.free_runs))
        free += [block_id for block_id in self.cached_free if block_id in unkeyed]
        return AllocatorState(ref_counts, free, [b for b in self.cached_free if b not in unkeyed],
                              [b for b in self.cached if b not in unkeyed])


class PoolPlan:
    """One pool's configuration, allocator state and pages, validated; nothing allocated until ``build``.

    Args:
        reader: the pool's entry of ``state.pools``.
        tensors: every tensor of the file.
        role: ``"device"`` or ``"host"``, the prefix of its tensors' names.
        needs_allocator: whether the entry must carry an allocator state.
    """

    def __init__(self, reader: Reader, tensors: Tensors, role: str, needs_allocator: bool) -> None:
        config = reader.child("config")
        self.role, self.tensors = role, tensors
        self.num_blocks: int = config.integer("num_blocks", 1)
        self.block_size: int = config.integer("block_size", 1)
        self.num_kv_heads: int = config.integer("num_kv_heads", 1)
        self.head_dim: int = config.integer("head_dim", 1)
        self.num_layers: int = config.integer("num_layers", 1)
        self.dtype = np.dtype(config.choice("dtype", DTYPES))
        self.key_dtype: str | None = config.choice("key_dtype", STORAGE)
        self.value_dtype: str | None = config.choice("value_dtype", STORAGE)
        per_token = bytes_per_token(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                    key_dtype=self.key_dtype, value_dtype=self.value_dtype,
                                    num_layers=self.num_layers)
        self.bytes_per_block: int = self.block_size * per_token + BYTES_PER_BLOCK
        self.saved_ids = reader.ints("saved_ids", 0, self.num_blocks - 1)
        if any(a >= b for a, b in pairwise(self.saved_ids)):
            fail(f"{reader.where}.saved_ids must be strictly increasing")
        self.allocator_reader = reader.child("allocator") if needs_allocator else None
        self.key_format: StorageFormat | None = None
        self.value_format: StorageFormat | None = None

    def bytes_for(self, num_blocks: int) -> int:
        """What loading a pool of ``num_blocks`` of this shape takes at the peak: pages and bookkeeping."""
        return num_blocks * self.bytes_per_block

    def same_shape(self) -> tuple[Any, ...]:
        """``(block_size, num_kv_heads, head_dim, num_layers, dtype, key_dtype, value_dtype)``."""
        return (self.block_size, self.num_kv_heads, self.head_dim, self.num_layers, self.dtype,
                self.key_dtype, self.value_dtype)

    def names(self) -> set[str]:
        """The names of the tensors this pool's pages must be saved as."""
        parts = page_parts(self.key_dtype is not None, self.value_dtype is not None)
        return {tensor_name(self.role, part, layer) for layer in range(self.num_layers) for part in parts}

    def check_pages(self) -> None:
        """Every tensor has the configured dtype and shape, and finite, in-range contents."""
        self.key_format = storage_format(self.key_dtype, self.head_dim) if self.key_dtype else None
        self.value_format = storage_format(self.value_dtype, self.head_dim) if self.value_dtype else None
        shape = (self.num_kv_heads, len(self.saved_ids), self.block_size, self.head_dim)
        for layer in range(self.num_layers):
            for side, storage in (("key", self.key_format), ("value", self.value_format)):
                name = tensor_name(self.role, f"{side}s", layer)
                codes = self._tensor(name, shape, storage)
                if storage is None:
                    if not np.isfinite(codes).all():
                        fail(f"tensor {name} holds NaN or infinity")
                    continue
                if storage.name == "float8_e4m3" and np.any((codes & 0x7F) == 0x7F):
                    fail(f"tensor {name} holds NaN fp8 codes")  # e4m3fn's only non-finite codes
                if storage.name == "float16" and not np.isfinite(codes).all():
                    fail(f"tensor {name} holds NaN or infinity")
                if storage.name == "bfloat16" and np.any((codes & 0x7F80) == 0x7F80):
                    fail(f"tensor {name} holds NaN or infinite bfloat16 codes")  # exponent all ones
                if storage.name == "int8" and np.any(codes == -128):
                    fail(f"tensor {name} holds the code -128, outside -127..127")
                scales_name = tensor_name(self.role, f"{side}_scales", layer)
                scales = self._tensor(scales_name, (*shape[:3], storage.num_groups))
                if not np.isfinite(scales).all() or np.any(scales < 0):
                    fail(f"tensor {scales_name} holds negative or non-finite scales")

    def _tensor(self, name: str, shape: tuple[int, ...], storage: StorageFormat | None = None) -> Any:
        array = self.tensors[name]
        # fp8 and bfloat16 codes travel as unsigned ints of their size: safetensors' numpy API has neither.
        code = None if storage is None else storage.code_dtype
        expected = self.dtype if code is None else code if code.kind != "V" else np.dtype(f"u{code.itemsize}")
        if array.dtype != expected:
            fail(f"tensor {name} has dtype {array.dtype}; the configuration says {expected}")
        if array.shape != shape:
            fail(f"tensor {name} has shape {array.shape}; the configuration says {shape}")
        return array

    def saved_allocator(self, held: Counter[int]) -> SavedAllocator:
        """The saved allocator state, checked: ref counts equal ``held`` (tables per block), and used,
        plain free and cached free blocks cover every block exactly once, cached marks on used or
        cached free blocks only. Costs the JSON's size, nothing per free block."""
        assert self.allocator_reader is not None
        reader, top = self.allocator_reader, self.num_blocks - 1
        used: dict[int, int] = {}
        for entry in reader.get("used", list):
            block_id, count = pair(entry, f"{reader.where}.used", "[block_id, ref_count]")
            if block_id > top or count < 1 or block_id in used:
                fail(f"{reader.where}.used holds a bad or repeated pair {shown(entry)}")
            used[block_id] = count
        if used != held:
            bad = min(b for b in used.keys() | held.keys() if used.get(b, 0) != held[b])
            fail(f"{self.role} block {bad} has ref count {used.get(bad, 0)} but {held[bad]} block tables "
                 "hold it (inconsistent ref counts)")
        runs: list[tuple[int, int]] = []
        for run in reader.get("free_runs", list):
            first, length = pair(run, f"{reader.where}.free_runs", "[first_id, length]")
            if length < 1 or first + length > self.num_blocks:
                fail(f"{reader.where}.free_runs holds {shown(run)}: outside the pool, or empty")
            runs.append((first, length))
        cached_free = reader.ints("cached_free", 0, top)
        # Every block exactly once: the used ids, the free runs and the cached free ids, as
        # intervals sorted by their first id, must tile 0 .. num_blocks - 1 without gap or overlap.
        position = 0
        for first, length in sorted(chain(((b, 1) for b in used), runs, ((b, 1) for b in cached_free))):
            if first != position:
                fail(f"{self.role} block {min(first, position)} is "
                     + ("counted twice (in used, free_runs or cached_free)" if first < position
                        else "neither used nor free"))
            position = first + length
        if position != self.num_blocks:
            fail(f"{self.role} block {position} is neither used nor free")
        cached = reader.ints("cached", 0, top)
        marked = set(cached)
        if len(marked) != len(cached):
            fail(f"{reader.where}.cached lists a block twice")
        if not marked.issuperset(cached_free) or not marked <= used.keys() | set(cached_free):
            fail(f"{reader.where}: the cached free blocks are not all cached, or a plain free block is "
                 "cached (inconsistent cached marks)")
        return SavedAllocator(self.num_blocks, used, runs, cached_free, sorted(cached))

    def saved_index(self, block_ids: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """Index of each block's pages in the saved tensors (-1: not saved); no array per pool block."""
        saved = np.array(self.saved_ids, np.intp)
        index = np.searchsorted(saved, block_ids)
        found = index < len(saved)
        found[found] = saved[index[found]] == block_ids[found]
        result: npt.NDArray[np.intp] = np.where(found, index, -1)
        return result

    def slot_key_max(self, layer: int) -> npt.NDArray[np.floating]:
        """Largest |key| (as attention reads it) of each saved slot, ``(num_saved * block_size,)``."""
        # (num_kv_heads, num_saved, block_size, head_dim)
        codes = self.tensors[tensor_name(self.role, "keys", layer)]
        if self.key_format is None:
            per_slot = np.maximum(codes.max(axis=(0, 3)), -codes.min(axis=(0, 3)))
        else:
            scales = self.tensors[tensor_name(self.role, "key_scales", layer)]
            codes = codes.view(self.key_format.code_dtype)  # the travel dtype back to the codes'
            per_slot = self.key_format.group_max_abs(codes, scales, self.dtype).max(axis=(0, 3))
        result: npt.NDArray[np.floating] = per_slot.reshape(-1)
        return result

    def build(self, growable: bool) -> KVPool:
        """A new, empty pool of this configuration."""
        return KVPool(self.num_blocks, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, num_layers=self.num_layers, dtype=self.dtype, growable=growable,
                      key_dtype=self.key_dtype, value_dtype=self.value_dtype)

    def write_pages(self, pool: KVPool, block_ids: list[int]) -> None:
        """Copy the saved pages (in ``saved_ids`` order) into ``block_ids`` of ``pool``."""
        ids: slice | npt.NDArray[np.intp] = np.array(block_ids, np.intp)
        if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
            ids = slice(block_ids[0], block_ids[0] + len(block_ids))  # one run: a plain copy
        for layer in range(self.num_layers):
            for part in page_parts(self.key_format is not None, self.value_format is not None):
                store = getattr(pool, part)(layer)  # a view of the pool's storage
                store[:, ids] = self.tensors[tensor_name(self.role, part, layer)].view(store.dtype)


def check_keys(saved: SavedAllocator, key_groups: list[list[tuple[int, bytes]]] | None, what: str) -> None:
    """The prefix keys (None: the pool runs no prefix cache) sit exactly on the cached blocks.

    ``key_groups`` holds each prefix cache's ``(block_id, key)`` pairs: one
    list for a manager, one a KV-cache group for a hybrid manager. The prefix
    caches' own invariants, on the saved state: within a cache one key a block
    and one block a key; a block keyed by one cache at most (groups may key
    the same prefix, each on its own blocks); a block keyed iff it is marked
    cached.
    """
    if key_groups is None:
        if saved.cached:
            fail(f"the snapshot's {what} pool runs no prefix cache, but blocks are marked cached")
        return
    keyed: set[int] = set()
    for keys in key_groups:
        mine = {block_id for block_id, _ in keys}
        if len(mine) != len(keys) or len({key for _, key in keys}) != len(keys):
            fail("the snapshot's prefix cache is inconsistent: a block or a key appears twice")
        if keyed & mine:
            fail(f"the snapshot's prefix caches are inconsistent: block {min(keyed & mine)} is keyed by two "
                 "groups")
        keyed |= mine
    if keyed != set(saved.cached):
        bad = min(keyed ^ set(saved.cached))
        fail(f"the snapshot's prefix cache is inconsistent: block {bad} is "
             + ("keyed but not marked cached" if bad in keyed else "marked cached but has no key"))


def check_pools(plans: list[PoolPlan], tensors: Tensors, limit: tuple[int, int],
                num_built: list[int] | None = None) -> None:
    """The pools fit in the bytes ``limit`` leaves them, and the tensors are exactly those they name.

    Args:
        plans: the saved pools.
        tensors: every tensor of the file.
        limit: ``(max_bytes, bytes the file itself took)``.
        num_built: the blocks each plan's built pool will have (default: as saved).
    """
    max_bytes, num_file_bytes = limit
    sizes = [plan.num_blocks for plan in plans] if num_built is None else num_built
    needed = num_file_bytes + sum(plan.bytes_for(num_blocks) for plan, num_blocks in zip(plans, sizes))
    if needed > max_bytes:
        shown_sizes = "".join(f", {plan.role} pool: {n:,} blocks" for plan, n in zip(plans, sizes))
        fail(f"loading the snapshot needs {needed:,} bytes (the file: {num_file_bytes:,}{shown_sizes}, "
             f"their pages and {BYTES_PER_BLOCK} bytes of bookkeeping a block), more than the "
             f"{max_bytes:,} bytes max_bytes= allows; pass a larger max_bytes= to allow more")
    expected = set().union(*(plan.names() for plan in plans))
    if set(tensors) != expected:
        fail(f"the tensors do not match the configuration: missing {sorted(expected - set(tensors))}, "
             f"unexpected {sorted(set(tensors) - expected)}")
