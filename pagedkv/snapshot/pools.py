"""One saved pool: its configuration, allocator state and pages, validated before anything is built.

A :class:`PoolPlan` reads one entry of the state's ``pools`` and the page
tensors it names; it allocates nothing until ``build``. The allocator state
is proven possible on a throwaway ``BlockAllocator`` (ids and counts only,
no pages) through the allocator's and the prefix cache's own
``_restore_state`` hooks and ``check_invariants``.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.allocator import AllocatorState, BlockAllocator
from pagedkv.pool import KVPool
from pagedkv.prefix_cache import PrefixCache
from pagedkv.quantization import StorageFormat, bytes_per_token, storage_format
from pagedkv.snapshot.format import Tensors, page_parts, tensor_name
from pagedkv.snapshot.schema import DTYPES, STORAGE, Reader, fail, invariants, pair

__all__ = ["PoolPlan", "check_allocator", "check_pools"]

#: Bookkeeping bytes counted per block on top of its pages (allocator lists and queues).
_BLOCK_OVERHEAD = 64


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
        self.bytes_needed = self.num_blocks * (self.block_size * per_token + _BLOCK_OVERHEAD)
        self.saved_ids = reader.ints("saved_ids", 0, self.num_blocks - 1)
        if any(a >= b for a, b in pairwise(self.saved_ids)):
            fail(f"{reader.where}.saved_ids must be strictly increasing")
        self.allocator_reader = reader.child("allocator") if needs_allocator else None
        self.key_format: StorageFormat | None = None
        self.value_format: StorageFormat | None = None

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
                if storage.name == "int8" and np.any(codes == -128):
                    fail(f"tensor {name} holds the code -128, outside -127..127")
                scales_name = tensor_name(self.role, f"{side}_scales", layer)
                scales = self._tensor(scales_name, (*shape[:3], storage.num_groups))
                if not np.isfinite(scales).all() or np.any(scales < 0):
                    fail(f"tensor {scales_name} holds negative or non-finite scales")

    def _tensor(self, name: str, shape: tuple[int, ...], storage: StorageFormat | None = None) -> Any:
        array = self.tensors[name]
        # fp8 codes travel as uint8: safetensors' numpy API has no fp8 dtype.
        expected = self.dtype if storage is None else np.dtype(np.int8 if storage.name == "int8" else "u1")
        if array.dtype != expected:
            fail(f"tensor {name} has dtype {array.dtype}; the configuration says {expected}")
        if array.shape != shape:
            fail(f"tensor {name} has shape {array.shape}; the configuration says {shape}")
        return array

    def allocator_state(self, held: list[int]) -> AllocatorState:
        """The saved allocator state, checked: ref counts equal ``held`` (tables per block), and used,
        plain free and cached free blocks cover every block exactly once."""
        assert self.allocator_reader is not None
        reader, top = self.allocator_reader, self.num_blocks - 1
        ref_counts = [0] * self.num_blocks
        for entry in reader.get("used", list):
            block_id, count = pair(entry, f"{reader.where}.used", "[block_id, ref_count]")
            if block_id > top or count < 1 or ref_counts[block_id]:
                fail(f"{reader.where}.used holds a bad or repeated pair {entry!r}")
            ref_counts[block_id] = count
        if ref_counts != held:
            bad = next(b for b in range(self.num_blocks) if ref_counts[b] != held[b])
            fail(f"{self.role} block {bad} has ref count {ref_counts[bad]} but {held[bad]} block tables "
                 "hold it (inconsistent ref counts)")
        seen = np.array([count > 0 for count in ref_counts], bool)
        free: list[int] = []
        for run in reader.get("free_runs", list):
            first, length = pair(run, f"{reader.where}.free_runs", "[first_id, length]")
            if length < 1 or first + length > self.num_blocks or seen[first : first + length].any():
                fail(f"{reader.where}.free_runs holds {run!r}: outside the pool, or blocks counted twice")
            seen[first : first + length] = True
            free.extend(range(first, first + length))
        cached_free = reader.ints("cached_free", 0, top)
        if len(set(cached_free)) != len(cached_free) or seen[cached_free].any():
            fail(f"{reader.where}.cached_free lists blocks that are used, free or listed twice")
        seen[cached_free] = True
        if not seen.all():
            fail(f"{self.role} block {int(np.argmin(seen))} is neither used nor free")
        cached = reader.ints("cached", 0, top)
        if len(set(cached)) != len(cached):
            fail(f"{reader.where}.cached lists a block twice")
        return AllocatorState(ref_counts, free, cached_free, sorted(cached))

    def index_map(self) -> npt.NDArray[np.intp]:
        """Block id -> index of its pages in the saved tensors (-1: not saved)."""
        index = np.full(self.num_blocks, -1, np.intp)
        index[np.array(self.saved_ids, np.intp)] = np.arange(len(self.saved_ids))
        return index

    def slot_key_max(self, layer: int) -> npt.NDArray[np.floating]:
        """Largest |key| (as attention reads it) of each saved slot, ``(num_saved * block_size,)``."""
        # (num_kv_heads, num_saved, block_size, head_dim)
        codes = self.tensors[tensor_name(self.role, "keys", layer)]
        if self.key_format is None:
            per_slot = np.maximum(codes.max(axis=(0, 3)), -codes.min(axis=(0, 3)))
        else:
            scales = self.tensors[tensor_name(self.role, "key_scales", layer)]
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


def check_allocator(state: AllocatorState, keys: list[tuple[int, bytes]] | None, what: str) -> None:
    """Prove ``state`` (and the prefix ``keys`` on it; None: no prefix cache) is one an allocator can be in.

    Restores both onto throwaway objects through their own hooks and runs
    their ``check_invariants``: every block in exactly one state, cached marks
    exactly on the keyed blocks, keyed blocks used or in the cached free queue.
    """
    allocator = BlockAllocator(len(state.ref_counts))
    allocator._restore_state(state)
    invariants(allocator.check_invariants, f"{what} allocator")
    if keys is None:
        if state.cached:
            fail(f"the snapshot's {what} pool runs no prefix cache, but blocks are marked cached")
        return
    prefix = PrefixCache(allocator)
    prefix._restore_state(keys, 0)
    invariants(prefix.check_invariants, "prefix cache")


def check_pools(plans: list[PoolPlan], tensors: Tensors, limit: int) -> None:
    """The pools fit in ``limit`` bytes, and the tensors are exactly those they name."""
    needed = sum(plan.bytes_needed for plan in plans)
    if needed > limit:
        sizes = ", ".join(f"{plan.role}: {plan.num_blocks:,} blocks" for plan in plans)
        fail(f"the snapshot declares pools of {needed:,} bytes ({sizes}), more than the {limit:,} "
             "allowed; pass max_bytes= to allow more")
    expected = set().union(*(plan.names() for plan in plans))
    if set(tensors) != expected:
        fail(f"the tensors do not match the configuration: missing {sorted(expected - set(tensors))}, "
             f"unexpected {sorted(set(tensors) - expected)}")
