"""What a snapshot holds of a ``KVCache`` or a ``KVCacheManager``, and how it is rebuilt.

:mod:`pagedkv.snapshot` owns the file (safetensors, checksum, atomic save);
this module owns the state inside it: ``capture_*`` turn a live object into
JSON-ready state plus page tensors, and :func:`restore` validates all of it
and only then builds a fresh object.

The state, as JSON (block ids are plain ints; bytes are hex)::

    {"kind": "KVCacheManager",
     "manager": {layer_max_sizes, num_sink_tokens, num_q_heads, scale,
                 enable_prefix_caching, hash_algorithm, max_abs_key, counters,
                 prefix: {keys: [[block_id, key], ...] in LRU-relevant order,
                          num_evictions},
                 sequences: [{seq_id: ["s", "a"] | ["i", 7], state, num_written,
                              token_ids, block_keys, extras,
                              table: {num_tokens, window_start, first_block,
                                      sink_ids, window_ids}}, ...]},
     "pools": {"device": {config, saved_ids, allocator: {used: [[id, ref_count]],
                          free_runs: [[first_id, length]] in queue order,
                          cached_free (LRU order), cached}},
               "host": {...}}}

NOTE: the allocator and the prefix cache are rebuilt through their public
commands only (take every block, share, register the keys, then free in the
saved queue orders), and block tables through ``BlockTable.restored``, so
their internals may change freely. The manager's sequences, counters and
largest keys have no public setter: those few private fields are set
directly, after everything has been validated. Reading the prefix keys in
insertion order (a ``reset`` frees blocks in that order) reads the prefix
cache's private map.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from itertools import pairwise
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from pagedkv.allocator import BlockAllocator
from pagedkv.block_table import BlockTable
from pagedkv.cache import KVCache
from pagedkv.errors import ClosedCacheError, ConfigError, InputTypeError, PagedKVError, SnapshotError
from pagedkv.manager import KVCacheManager, SequenceState, _Sequence
from pagedkv.paged_attention import range_slots
from pagedkv.pool import KVPool
from pagedkv.prefix_cache import PrefixCache
from pagedkv.quantization import StorageFormat, bytes_per_token, storage_format

__all__ = ["capture_cache", "capture_manager", "restore"]

State = dict[str, Any]
Tensors = dict[str, npt.NDArray[Any]]

#: Bookkeeping bytes counted per block on top of its pages (allocator lists and queues).
_BLOCK_OVERHEAD = 64
_COUNTERS = ("forks", "copy_on_write", "preemptions", "swaps_out", "swaps_in", "prefix_queries",
             "prefix_hits", "resumed_reuse")
_KEY_SIZES = {"sha256": 32, "xxh3_128": 16}
_STORAGE = (None, "int8", "float8_e4m3")


def _fail(message: str) -> NoReturn:
    raise SnapshotError(message)


# =================================================================== capture


def _pool_config(pool: KVPool) -> State:
    return {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "num_kv_heads": pool.num_kv_heads,
            "head_dim": pool.head_dim, "num_layers": pool.num_layers, "dtype": pool.dtype.name,
            "key_dtype": pool.key_dtype, "value_dtype": pool.value_dtype}


def _ref_counts(allocator: BlockAllocator) -> list[int]:
    return [allocator.ref_count(block_id) for block_id in range(allocator.num_blocks)]


def _allocator_state(allocator: BlockAllocator) -> State:
    runs: list[list[int]] = []  # the plain free queue, in order, as [first_id, length] runs
    for block_id in allocator.free_block_ids():
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return {
        "used": [[block_id, n] for block_id, n in enumerate(_ref_counts(allocator)) if n],
        "free_runs": runs,
        "cached_free": allocator.cached_free_block_ids(),
        "cached": [block_id for block_id in range(allocator.num_blocks) if allocator.is_cached(block_id)],
    }


def _pages(pool: KVPool, role: str, block_ids: list[int]) -> Tensors:
    ids = np.array(block_ids, np.intp)

    def take(store: npt.NDArray[Any]) -> npt.NDArray[Any]:
        # NOTE: np.take into a fresh array, mode="clip" (the ids are the pool's
        # own): store[:, ids] would return a block-major, non-contiguous array
        # that the checksum and the writer would each copy again.
        out = np.empty((store.shape[0], len(ids), *store.shape[2:]), store.dtype)
        np.take(store, ids, axis=1, out=out, mode="clip")
        return out.view(np.uint8) if out.dtype.kind == "V" else out  # fp8 travels as its bytes

    tensors = {}
    for layer in range(pool.num_layers):
        tensors[f"{role}.keys.{layer}"] = take(pool.keys(layer))
        tensors[f"{role}.values.{layer}"] = take(pool.values(layer))
        if pool.key_format is not None:
            tensors[f"{role}.key_scales.{layer}"] = take(pool.key_scales(layer))
        if pool.value_format is not None:
            tensors[f"{role}.value_scales.{layer}"] = take(pool.value_scales(layer))
    return tensors


def _table_state(table: BlockTable) -> State:
    ids = table.block_ids
    num_sink_held = table.num_blocks - table.num_window_blocks
    return {"num_tokens": table.num_tokens, "window_start": table.window_start,
            "first_block": table.first_block_index, "sink_ids": ids[:num_sink_held],
            "window_ids": ids[num_sink_held:]}


def capture_cache(cache: KVCache) -> tuple[State, Tensors]:
    """The state and page tensors of ``cache`` (its own blocks only, even on a shared pool).

    Raises:
        ClosedCacheError: the cache is closed.
    """
    if cache.closed:
        raise ClosedCacheError("this KVCache is closed; there is nothing to save")
    pool = cache.pool
    state: State = {
        "kind": "KVCache",
        "cache": {"max_size": cache.max_size, "block_size": cache.block_size, "dtype": cache.dtype.name,
                  "scale": cache.scale, "key_dtype": cache.key_dtype, "value_dtype": cache.value_dtype,
                  "private": cache._private, "max_abs_key": cache._max_abs_key,
                  "kv_shape": None if cache._kv_shape is None else list(cache._kv_shape),
                  "table": _table_state(cache.block_table)},
        "pools": {},
    }
    if pool is None:
        return state, {}
    saved = sorted(cache.block_ids)
    entry: State = {"config": _pool_config(pool), "saved_ids": saved}
    if cache._private:
        entry["allocator"] = _allocator_state(pool.allocator)
    state["pools"]["device"] = entry
    return state, _pages(pool, "device", saved)


def _seq_id(seq_id: Hashable) -> list[Any]:
    if isinstance(seq_id, str):
        return ["s", seq_id]
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        return ["i", seq_id]
    _fail(f"sequence id {seq_id!r} is a {type(seq_id).__name__}; only str and int ids can be saved")


def _role(seq: _Sequence) -> str:
    return "host" if seq.state is SequenceState.SWAPPED else "device"


def capture_manager(manager: KVCacheManager) -> tuple[State, Tensors]:
    """The state and page tensors of ``manager`` and its pools.

    Raises:
        SnapshotError: a sequence has unwritten reserved tokens, an id is
            not a str or int, or a pool holds blocks of another owner.
    """
    pools_of = {"device": manager.pool, "host": manager.host_pool}
    held = {role: [0] * pool.num_blocks for role, pool in pools_of.items() if pool is not None}
    sequences = []
    for seq in manager._seqs.values():
        if seq.state is SequenceState.RUNNING and seq.pending_layers():
            _fail(f"sequence {seq.seq_id!r} has reserved tokens that layers {seq.pending_layers()} have "
                  "not written; write them (or free the sequence) before saving")
        for block_id in seq.table.block_ids:
            held[_role(seq)][block_id] += 1
        sequences.append({
            "seq_id": _seq_id(seq.seq_id), "state": seq.state.value, "table": _table_state(seq.table),
            "num_written": list(seq.num_written), "extras": seq.extras.hex(),
            "token_ids": None if seq.token_ids is None else list(seq.token_ids),
            "block_keys": [key.hex() for key in seq.block_keys],
        })
    prefix = manager._prefix
    pools: State = {}
    tensors: Tensors = {}
    for role, counts in held.items():
        pool = pools_of[role]
        assert pool is not None
        allocator = pool.allocator
        if _ref_counts(allocator) != counts:
            _fail(f"the {role} pool also holds blocks of another cache or manager; only a manager "
                  "that owns its pools alone can be saved")
        entry = _allocator_state(allocator)
        if entry["cached"] and (role == "host" or prefix is None):
            _fail(f"the {role} pool holds prefix-cached blocks of another manager")
        saved = sorted({b for b, n in enumerate(counts) if n} | set(entry["cached"]))
        pools[role] = {"config": _pool_config(pool), "allocator": entry, "saved_ids": saved}
        tensors.update(_pages(pool, role, saved))
    state = {
        "kind": "KVCacheManager",
        "manager": {
            "layer_max_sizes": list(manager.layer_max_sizes), "num_sink_tokens": manager.num_sink_tokens,
            "num_q_heads": manager.num_q_heads, "scale": manager.scale,
            "enable_prefix_caching": prefix is not None, "hash_algorithm": manager.hash_algorithm,
            "max_abs_key": list(manager._max_abs_key),
            "counters": {name: manager._counters[name] for name in _COUNTERS},
            "prefix": None if prefix is None else {
                "keys": [[block_id, key.hex()] for block_id, key in prefix._key_of.items()],
                "num_evictions": prefix.num_evictions},
            "sequences": sequences,
        },
        "pools": pools,
    }
    return state, tensors


# =================================================================== validate


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(values: object, where: str, low: int = 0, high: int | None = None) -> list[int]:
    if not isinstance(values, list):
        _fail(f"{where} must be a list, got {type(values).__name__}")
    for value in values:
        if not _is_int(value) or value < low or (high is not None and value > high):
            _fail(f"{where} holds {value!r}; expected ints in {low}..{'' if high is None else high}")
    return values


class _Reader:
    """Typed access to one JSON object of the state; a bad field fails naming its path."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            _fail(f"{where} must be a JSON object, got {type(value).__name__}")
        self.value: dict[str, Any] = value
        self.where = where

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if name not in self.value:
            _fail(f"{self.where}.{name} is missing")
        value = self.value[name]
        if value is None and optional:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            _fail(f"{self.where}.{name} = {value!r:.60} has the wrong type")
        return value

    def integer(self, name: str, low: int = 0, *, optional: bool = False) -> Any:
        value = self.get(name, int, optional=optional)
        if value is not None and value < low:
            _fail(f"{self.where}.{name} = {value} is below {low}")
        return value

    def number(self, name: str, *, non_negative: bool = True) -> float:
        value = float(self.get(name, (int, float)))
        if not math.isfinite(value) or (non_negative and value < 0):
            _fail(f"{self.where}.{name} = {value!r} must be finite" + (" and >= 0" if non_negative else ""))
        return value

    def choice(self, name: str, choices: tuple[Any, ...]) -> Any:
        if name not in self.value:
            _fail(f"{self.where}.{name} is missing")
        value = self.value[name]
        if isinstance(value, bool) or value not in choices:
            _fail(f"{self.where}.{name} = {value!r:.60}; expected one of {choices}")
        return value

    def ints(self, name: str, low: int = 0, high: int | None = None) -> list[int]:
        return _ints(self.get(name, list), f"{self.where}.{name}", low, high)

    def child(self, name: str) -> _Reader:
        return _Reader(self.get(name, dict), f"{self.where}.{name}")

    def hex(self, name: str, size: int | None = None) -> bytes:
        return _hex(self.get(name, str), f"{self.where}.{name}", size)


def _pair(value: object, where: str, what: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2):
        _fail(f"{where} holds {value!r:.60}; expected {what} pairs")
    first, second = _ints(value, where)
    return first, second


def _hex(value: object, where: str, size: int | None = None) -> bytes:
    if not isinstance(value, str):
        _fail(f"{where} holds {value!r:.60}, not a hex string")
    try:
        data = bytes.fromhex(value)
    except ValueError:
        _fail(f"{where} holds {value:.40!r}, not hex")
    if size is not None and len(data) != size:
        _fail(f"{where} holds a {len(data)}-byte key; the hash makes {size}-byte keys")
    return data


def _invariants(check: Callable[[], None], what: str) -> None:
    try:
        check()
    except AssertionError as error:
        _fail(f"the snapshot's {what} is inconsistent: {error}")


class _PoolPlan:
    """One pool's configuration, bookkeeping and pages, validated; nothing allocated until ``build``."""

    def __init__(self, reader: _Reader, tensors: Tensors, role: str, needs_allocator: bool) -> None:
        config = reader.child("config")
        self.role, self.reader, self.tensors = role, reader, tensors
        self.num_blocks = config.integer("num_blocks", 1)
        self.block_size = config.integer("block_size", 1)
        self.num_kv_heads = config.integer("num_kv_heads", 1)
        self.head_dim = config.integer("head_dim", 1)
        self.num_layers = config.integer("num_layers", 1)
        self.dtype = np.dtype(config.choice("dtype", ("float32", "float64")))
        self.key_dtype: str | None = config.choice("key_dtype", _STORAGE)
        self.value_dtype: str | None = config.choice("value_dtype", _STORAGE)
        per_token = bytes_per_token(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                    key_dtype=self.key_dtype, value_dtype=self.value_dtype,
                                    num_layers=self.num_layers)
        self.bytes_needed = self.num_blocks * (self.block_size * per_token + _BLOCK_OVERHEAD)
        self.saved_ids = reader.ints("saved_ids", 0, self.num_blocks - 1)
        if any(a >= b for a, b in pairwise(self.saved_ids)):
            _fail(f"{reader.where}.saved_ids must be strictly increasing")
        self.allocator_reader = reader.child("allocator") if needs_allocator else None
        self.key_format: StorageFormat | None = None
        self.value_format: StorageFormat | None = None

    def same_shape(self) -> tuple[Any, ...]:
        return (self.block_size, self.num_kv_heads, self.head_dim, self.num_layers, self.dtype,
                self.key_dtype, self.value_dtype)

    def names(self) -> set[str]:
        names = set()
        for layer in range(self.num_layers):
            names |= {f"{self.role}.keys.{layer}", f"{self.role}.values.{layer}"}
            names |= {f"{self.role}.key_scales.{layer}"} if self.key_dtype else set()
            names |= {f"{self.role}.value_scales.{layer}"} if self.value_dtype else set()
        return names

    def check_pages(self) -> None:
        """Every tensor has the configured dtype and shape, and finite, in-range contents."""
        self.key_format = storage_format(self.key_dtype, self.head_dim) if self.key_dtype else None
        self.value_format = storage_format(self.value_dtype, self.head_dim) if self.value_dtype else None
        shape = (self.num_kv_heads, len(self.saved_ids), self.block_size, self.head_dim)
        for layer in range(self.num_layers):
            for side, storage in (("key", self.key_format), ("value", self.value_format)):
                name = f"{self.role}.{side}s.{layer}"
                codes = self._tensor(name, shape, storage)
                if storage is None:
                    if not np.isfinite(codes).all():
                        _fail(f"tensor {name} holds NaN or infinity")
                    continue
                if storage.name == "float8_e4m3" and np.any((codes & 0x7F) == 0x7F):
                    _fail(f"tensor {name} holds NaN fp8 codes")  # e4m3fn's only non-finite codes
                if storage.name == "int8" and np.any(codes == -128):
                    _fail(f"tensor {name} holds the code -128, outside -127..127")
                scales = self._tensor(f"{self.role}.{side}_scales.{layer}", (*shape[:3], storage.num_groups))
                if not np.isfinite(scales).all() or np.any(scales < 0):
                    _fail(f"tensor {self.role}.{side}_scales.{layer} holds negative or non-finite scales")

    def _tensor(self, name: str, shape: tuple[int, ...], storage: StorageFormat | None = None) -> Any:
        array = self.tensors[name]
        # fp8 codes travel as uint8: safetensors' numpy API has no fp8 dtype.
        expected = self.dtype if storage is None else np.dtype(np.int8 if storage.name == "int8" else "u1")
        if array.dtype != expected:
            _fail(f"tensor {name} has dtype {array.dtype}; the configuration says {expected}")
        if array.shape != shape:
            _fail(f"tensor {name} has shape {array.shape}; the configuration says {shape}")
        return array

    def bookkeeping(self, held: list[int]) -> _Bookkeeping:
        """The allocator state, checked: ref counts equal ``held`` (tables per block), and used,
        plain free and cached free blocks cover every block exactly once."""
        assert self.allocator_reader is not None
        reader, top = self.allocator_reader, self.num_blocks - 1
        ref_counts = [0] * self.num_blocks
        for pair in reader.get("used", list):
            block_id, count = _pair(pair, f"{reader.where}.used", "[block_id, ref_count]")
            if block_id > top or count < 1 or ref_counts[block_id]:
                _fail(f"{reader.where}.used holds a bad or repeated pair {pair!r}")
            ref_counts[block_id] = count
        if ref_counts != held:
            bad = next(b for b in range(self.num_blocks) if ref_counts[b] != held[b])
            _fail(f"{self.role} block {bad} has ref count {ref_counts[bad]} but {held[bad]} block tables "
                  "hold it (inconsistent ref counts)")
        seen = np.array([count > 0 for count in ref_counts], bool)
        free: list[int] = []
        for run in reader.get("free_runs", list):
            first, length = _pair(run, f"{reader.where}.free_runs", "[first_id, length]")
            if length < 1 or first + length > self.num_blocks or seen[first : first + length].any():
                _fail(f"{reader.where}.free_runs holds {run!r}: outside the pool, or blocks counted twice")
            seen[first : first + length] = True
            free.extend(range(first, first + length))
        cached_free = reader.ints("cached_free", 0, top)
        if len(set(cached_free)) != len(cached_free) or seen[cached_free].any():
            _fail(f"{reader.where}.cached_free lists blocks that are used, free or listed twice")
        seen[cached_free] = True
        if not seen.all():
            _fail(f"{self.role} block {int(np.argmin(seen))} is neither used nor free")
        cached = reader.ints("cached", 0, top)
        return _Bookkeeping(ref_counts, free, cached_free, cached)

    def index_map(self) -> npt.NDArray[np.intp]:
        """Block id -> index of its pages in the saved tensors (-1: not saved)."""
        index = np.full(self.num_blocks, -1, np.intp)
        index[np.array(self.saved_ids, np.intp)] = np.arange(len(self.saved_ids))
        return index

    def slot_key_max(self, layer: int) -> npt.NDArray[np.floating]:
        """Largest |key| (as attention reads it) of each saved slot, ``(num_saved * block_size,)``."""
        codes = self.tensors[f"{self.role}.keys.{layer}"]  # (num_kv_heads, num_saved, block_size, head_dim)
        if self.key_format is None:
            per_slot = np.maximum(codes.max(axis=(0, 3)), -codes.min(axis=(0, 3)))
        else:
            scales = self.tensors[f"{self.role}.key_scales.{layer}"]
            per_slot = self.key_format.group_max_abs(codes, scales, self.dtype).max(axis=(0, 3))
        result: npt.NDArray[np.floating] = per_slot.reshape(-1)
        return result

    def build(self, growable: bool) -> KVPool:
        return KVPool(self.num_blocks, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, num_layers=self.num_layers, dtype=self.dtype, growable=growable,
                      key_dtype=self.key_dtype, value_dtype=self.value_dtype)

    def write_pages(self, pool: KVPool, block_ids: list[int]) -> None:
        """Copy the saved pages (in ``saved_ids`` order) into ``block_ids`` of ``pool``."""
        ids: slice | npt.NDArray[np.intp] = np.array(block_ids, np.intp)
        if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
            ids = slice(block_ids[0], block_ids[0] + len(block_ids))  # one run: a plain copy
        for layer in range(self.num_layers):
            for side, store in (("key", pool.keys(layer)), ("value", pool.values(layer))):
                store[:, ids] = self.tensors[f"{self.role}.{side}s.{layer}"].view(store.dtype)
            if self.key_format is not None:
                pool.key_scales(layer)[:, ids] = self.tensors[f"{self.role}.key_scales.{layer}"]
            if self.value_format is not None:
                pool.value_scales(layer)[:, ids] = self.tensors[f"{self.role}.value_scales.{layer}"]


class _Bookkeeping:
    """An allocator's saved state: ref counts, plain free queue, cached free LRU, cached marks."""

    def __init__(
        self, ref_counts: list[int], free: list[int], cached_free: list[int], cached: list[int]
    ) -> None:
        self.ref_counts, self.free, self.cached_free, self.cached = ref_counts, free, cached_free, cached

    def replay(
        self, allocator: BlockAllocator, keys: list[tuple[int, bytes]], prefix: PrefixCache | None
    ) -> None:
        """Bring a fresh ``allocator`` (and ``prefix``) to this state with public commands only."""
        allocator.allocate(allocator.num_blocks)  # every block used once...
        for block_id, count in enumerate(self.ref_counts):
            if count > 1:
                allocator.share([block_id] * (count - 1))  # ... then as many times as saved
        for block_id, key in keys:  # keys in their saved (insertion) order
            if prefix is None or not prefix.register(block_id, key):
                _fail(f"prefix key {key.hex()[:16]}... cannot be registered on block {block_id}")
        allocator.free(self.free)  # plain free queue, in order
        allocator.free(self.cached_free)  # cached free LRU, in order

    def check(self, num_blocks: int, keys: list[tuple[int, bytes]], what: str) -> None:
        """Replay onto throwaway objects and compare: proves the state is one an allocator can be in."""
        allocator = BlockAllocator(num_blocks)
        prefix = PrefixCache(allocator) if keys else None
        try:
            self.replay(allocator, keys, prefix)
        except PagedKVError as error:
            _fail(f"the snapshot's {what} allocator state is impossible: {error}")
        _invariants(allocator.check_invariants, f"{what} allocator")
        if prefix is not None:
            _invariants(prefix.check_invariants, "prefix cache")
        cached = [b for b in range(num_blocks) if allocator.is_cached(b)]
        if (allocator.free_block_ids(), allocator.cached_free_block_ids(), cached) != (
            self.free, self.cached_free, sorted(self.cached)
        ):
            _fail(f"the snapshot's {what} free queues or cached marks disagree with its prefix keys")


def _check_pools(plans: list[_PoolPlan], tensors: Tensors, limit: int) -> None:
    """The pools fit in ``limit`` bytes, and the tensors are exactly those they name."""
    needed = sum(plan.bytes_needed for plan in plans)
    if needed > limit:
        sizes = ", ".join(f"{plan.role}: {plan.num_blocks:,} blocks" for plan in plans)
        _fail(f"the snapshot declares pools of {needed:,} bytes ({sizes}), more than the {limit:,} "
              "allowed; pass max_bytes= to allow more")
    expected = set().union(*(plan.names() for plan in plans))
    if set(tensors) != expected:
        _fail(f"the tensors do not match the configuration: missing {sorted(expected - set(tensors))}, "
              f"unexpected {sorted(set(tensors) - expected)}")


def _table(reader: _Reader, block_size: int, num_sink_tokens: int, num_blocks: int) -> BlockTable:
    """A block table from its state, ids within ``num_blocks``, its invariants checked."""
    sink_ids = reader.ints("sink_ids", 0, num_blocks - 1)
    window_ids = reader.ints("window_ids", 0, num_blocks - 1)
    num_tokens, window_start = reader.integer("num_tokens"), reader.integer("window_start")
    reader.integer("first_block")
    table = BlockTable.restored(block_size, num_sink_tokens, num_tokens, window_start, sink_ids + window_ids)
    _invariants(table.check_invariants, reader.where)
    if _table_state(table) != reader.value:
        _fail(f"{reader.where} is inconsistent: its fields do not describe one block table")
    return table


def _live_slots(table: BlockTable, index_map: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """Live tokens of ``table`` as ``saved_index * block_size + offset``."""
    ranges = table.live_ranges()
    if not table.num_blocks or not ranges:
        return np.empty(0, np.intp)
    slots = range_slots(table, ranges)
    bs = table.block_size
    index = index_map[slots // bs]
    if np.any(index < 0):
        _fail(f"block {int(slots[index < 0][0]) // bs} is in a block table but its pages are not saved")
    result: npt.NDArray[np.intp] = index * bs + slots % bs
    return result


def _check_key_bound(plan: _PoolPlan, layer: int, slots: npt.NDArray[np.intp], bound: float) -> None:
    # NOTE: attend refuses queries whose scores could overflow, using the
    # largest |key| written so far; pages beyond the recorded maximum would
    # slip past that check. Dequantized keys may pass it by a few ulps.
    found = float(plan.slot_key_max(layer)[slots].max()) if len(slots) else 0.0
    if found > bound * (1 + 1e-6):
        _fail(f"layer {layer} holds keys up to {found:.6g} but the snapshot records a largest |key| "
              f"of {bound:.6g}")


# =================================================================== restore


def restore(state: object, tensors: Tensors, limit: int, pool: KVPool | None) -> KVCache | KVCacheManager:
    """Validate ``state`` and ``tensors`` whole, then build the object they describe.

    Raises:
        SnapshotError: anything is inconsistent or larger than ``limit`` bytes.
        ConfigError, InputTypeError: ``pool`` does not fit (see ``snapshot.load``).
    """
    root = _Reader(state, "state")
    kind = root.choice("kind", ("KVCache", "KVCacheManager"))
    if kind == "KVCache":
        return _restore_cache(root, tensors, limit, pool)
    if pool is not None:
        raise ConfigError("pool= is for cache snapshots; a manager snapshot builds its own pools")
    return _restore_manager(root, tensors, limit)


def _restore_cache(root: _Reader, tensors: Tensors, limit: int, pool: KVPool | None) -> KVCache:
    config = root.child("cache")
    max_size = config.integer("max_size", 1, optional=True)
    block_size = config.integer("block_size", 1)
    dtype = np.dtype(config.choice("dtype", ("float32", "float64")))
    key_dtype, value_dtype = config.choice("key_dtype", _STORAGE), config.choice("value_dtype", _STORAGE)
    scale = config.number("scale", non_negative=False)
    private = config.get("private", bool)
    max_abs_key = config.number("max_abs_key")
    kv_shape = config.get("kv_shape", list, optional=True)
    pools = root.child("pools")
    if set(pools.value) - {"device"}:
        _fail(f"a cache snapshot holds one pool, got {sorted(pools.value)}")
    plan = _PoolPlan(pools.child("device"), tensors, "device", private) if "device" in pools.value else None
    _check_pools([plan] if plan else [], tensors, limit)
    if plan is not None and plan.same_shape()[:1] + plan.same_shape()[3:] != (
        block_size, 1, dtype, key_dtype, value_dtype
    ):
        _fail("the cache's pool disagrees with its block_size, dtype or storage dtypes, or has many layers")
    table = _table(config.child("table"), block_size, 0, plan.num_blocks if plan else 0)
    if max_size is not None and (table.num_blocks > -(-max_size // block_size) + 1
                                 or table.num_live_tokens > max_size):
        _fail(f"{config.where}.table holds more than max_size={max_size} allows")
    if kv_shape is not None:
        heads = tuple(_ints(kv_shape, f"{config.where}.kv_shape", 1))
        if plan is None or (heads if len(heads) == 2 else (1, *heads)) != (plan.num_kv_heads, plan.head_dim):
            _fail(f"{config.where}.kv_shape = {kv_shape} does not fit the pool")
    elif table.num_blocks:
        _fail(f"{config.where} holds blocks but no kv_shape")
    bookkeeping = None
    if plan is not None:
        if sorted(table.block_ids) != plan.saved_ids:
            _fail("the saved pages are not exactly the cache's blocks")
        plan.check_pages()
        _check_key_bound(plan, 0, _live_slots(table, plan.index_map()), max_abs_key)
        if private:
            held = [0] * plan.num_blocks
            for block_id in table.block_ids:
                held[block_id] = 1
            bookkeeping = plan.bookkeeping(held)
            if bookkeeping.cached or bookkeeping.cached_free:
                _fail("a cache's private pool has no prefix cache, but blocks are marked cached")
            bookkeeping.check(plan.num_blocks, [], "cache pool")
    if pool is not None:
        _check_target_pool(pool, plan, block_size, dtype, key_dtype, value_dtype, table.num_blocks)
    # ---- validated: from here on nothing can fail ----
    cache = KVCache(max_size, block_size=block_size, pool=pool, dtype=dtype, scale=scale,
                    key_dtype=key_dtype, value_dtype=value_dtype)
    cache._max_abs_key = max_abs_key
    cache._kv_shape = None if kv_shape is None else tuple(kv_shape)
    if plan is None:
        return cache
    old_ids = table.block_ids
    if pool is not None:
        target, new_ids = pool, pool.allocator.allocate(len(old_ids))
    elif bookkeeping is not None:
        target, new_ids = plan.build(growable=True), old_ids  # exactly as saved
        bookkeeping.replay(target.allocator, [], None)
    else:  # it was on a shared pool: a private one, ids 0..k-1 in logical order
        num_blocks = max(2 * (-(-max_size // block_size) + 1) if max_size else 4, len(old_ids))
        target = KVPool(num_blocks, block_size=block_size, num_kv_heads=plan.num_kv_heads,
                        head_dim=plan.head_dim, dtype=dtype, growable=True, key_dtype=key_dtype,
                        value_dtype=value_dtype)
        new_ids = target.allocator.allocate(len(old_ids))
    if pool is None:
        cache._pool = target
        cache._attach(target)
    rename = dict(zip(old_ids, new_ids))
    plan.write_pages(target, [rename[block_id] for block_id in plan.saved_ids])
    placed = BlockTable.restored(block_size, 0, table.num_tokens, table.window_start, new_ids)
    # The cache's own table object is the one its finalizer frees: fill it in place.
    for name in BlockTable.__slots__:
        setattr(cache._table, name, getattr(placed, name))
    # A given pool may be shared with others whose state is theirs: check only what is ours there.
    check = cache.check_invariants if pool is None else cache._table.check_invariants
    try:
        _invariants(check, "cache")
    except SnapshotError:
        cache.close()  # gives the blocks back: a failed load leaves the pool as it was
        raise
    return cache


def _check_target_pool(pool: KVPool, plan: _PoolPlan | None, block_size: int, dtype: np.dtype[Any],
                       key_dtype: str | None, value_dtype: str | None, num_blocks: int) -> None:
    if not isinstance(pool, KVPool):
        raise InputTypeError(f"pool must be a KVPool, got {type(pool).__name__}")
    wanted: dict[str, object] = {"block_size": block_size, "dtype": dtype, "key_dtype": key_dtype,
                                 "value_dtype": value_dtype, "num_layers": 1}
    if plan is not None:
        wanted.update(num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim)
    for name, value in wanted.items():
        if getattr(pool, name) != value:
            raise ConfigError(f"the cache was saved with {name}={value}, the pool has {getattr(pool, name)}")
    if not pool.can_allocate(num_blocks):
        raise ConfigError(f"the cache needs {num_blocks} blocks, {pool.num_free_blocks} are free in the "
                          "pool; free some first (nothing was changed)")


def _restore_manager(root: _Reader, tensors: Tensors, limit: int) -> KVCacheManager:
    config, pools = root.child("manager"), root.child("pools")
    if "device" not in pools.value or set(pools.value) - {"device", "host"}:
        _fail(f"a manager snapshot holds a device pool and maybe a host pool, got {sorted(pools.value)}")
    roles = [role for role in ("device", "host") if role in pools.value]
    plans: dict[str, _PoolPlan] = {role: _PoolPlan(pools.child(role), tensors, role, True) for role in roles}
    _check_pools(list(plans.values()), tensors, limit)
    device = plans["device"]
    if "host" in plans and plans["host"].same_shape() != device.same_shape():
        _fail("the host pool's shape or dtypes differ from the device pool's")
    num_layers, bs = device.num_layers, device.block_size
    windows = config.get("layer_max_sizes", list)
    if len(windows) != num_layers or not all(w is None or (_is_int(w) and w >= 1) for w in windows):
        _fail(f"{config.where}.layer_max_sizes = {windows!r:.60} does not fit {num_layers} layers")
    num_sinks = config.integer("num_sink_tokens")
    num_q_heads = config.integer("num_q_heads", 1)
    if num_q_heads % device.num_kv_heads:
        _fail(f"{config.where}.num_q_heads = {num_q_heads} is not a multiple of num_kv_heads")
    scale = config.number("scale", non_negative=False)
    prefix_on = config.get("enable_prefix_caching", bool)
    hash_algorithm = config.choice("hash_algorithm", tuple(_KEY_SIZES))
    max_abs_key = config.get("max_abs_key", list)
    if len(max_abs_key) != num_layers or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        for x in max_abs_key
    ):
        _fail(f"{config.where}.max_abs_key must hold {num_layers} finite numbers >= 0")
    counters = {name: config.child("counters").integer(name) for name in _COUNTERS}
    held = {role: [0] * plan.num_blocks for role, plan in plans.items()}
    sequences: dict[Hashable, _Sequence] = {}
    for number, raw in enumerate(config.get("sequences", list)):
        seq = _sequence(_Reader(raw, f"{config.where}.sequences[{number}]"), plans, num_sinks, num_layers,
                        _KEY_SIZES[hash_algorithm] if prefix_on else None)
        if seq.seq_id in sequences:
            _fail(f"sequence id {seq.seq_id!r} appears twice")
        sequences[seq.seq_id] = seq
        for block_id in seq.table.block_ids:
            held[_role(seq)][block_id] += 1
    keys: list[tuple[int, bytes]] = []
    num_evictions = 0
    if prefix_on:
        prefix = config.child("prefix")
        num_evictions = prefix.integer("num_evictions")
        for pair in prefix.get("keys", list):
            if not (isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0])
                    and 0 <= pair[0] < device.num_blocks):
                _fail(f"{prefix.where}.keys holds {pair!r:.60}; expected [block_id, hex key] pairs")
            keys.append((pair[0], _hex(pair[1], f"{prefix.where}.keys", _KEY_SIZES[hash_algorithm])))
    elif config.get("prefix", dict, optional=True) is not None:
        _fail(f"{config.where}.prefix is given but prefix caching is off")
    bookkeeping = {}
    for role, plan in plans.items():
        bookkeeping[role] = plan.bookkeeping(held[role])
        bookkeeping[role].check(plan.num_blocks, keys if role == "device" else [], role)
        in_use = {b for b, n in enumerate(held[role]) if n} | set(bookkeeping[role].cached)
        if set(plan.saved_ids) != in_use:
            _fail(f"the {role} pages saved are not exactly the blocks in use or cached")
        plan.check_pages()
        index_map = plan.index_map()
        cached = index_map[np.array(sorted(bookkeeping[role].cached), np.intp)]
        slots = [(cached[:, None] * bs + np.arange(bs)).ravel()]
        slots += [_live_slots(seq.table, index_map) for seq in sequences.values() if _role(seq) == role]
        for layer in range(num_layers):
            _check_key_bound(plan, layer, np.concatenate(slots), float(max_abs_key[layer]))
    # ---- validated: from here on nothing can fail ----
    built = {role: plan.build(growable=False) for role, plan in plans.items()}
    for role, plan in plans.items():
        plan.write_pages(built[role], plan.saved_ids)
    manager = KVCacheManager(built["device"], layer_max_sizes=windows, num_sink_tokens=num_sinks,
                             num_q_heads=num_q_heads, scale=scale, host_pool=built.get("host"),
                             enable_prefix_caching=prefix_on, hash_algorithm=hash_algorithm)
    for role, pool in built.items():
        bookkeeping[role].replay(pool.allocator, keys if role == "device" else [], manager._prefix)
    if manager._prefix is not None:
        manager._prefix.num_evictions = num_evictions
    manager._max_abs_key = [float(x) for x in max_abs_key]
    manager._counters.update(counters)
    manager._seqs = sequences
    _invariants(manager.check_invariants, "manager")
    return manager


def _sequence(reader: _Reader, plans: dict[str, _PoolPlan], num_sinks: int, num_layers: int,
              key_size: int | None) -> _Sequence:
    raw_id = reader.get("seq_id", list)
    if not (len(raw_id) == 2 and ((raw_id[0] == "s" and isinstance(raw_id[1], str))
                                  or (raw_id[0] == "i" and _is_int(raw_id[1])))):
        _fail(f"{reader.where}.seq_id = {raw_id!r:.60}; expected ['s', str] or ['i', int]")
    state = SequenceState(reader.choice("state", tuple(s.value for s in SequenceState)))
    role = "host" if state is SequenceState.SWAPPED else "device"
    if role not in plans:
        _fail(f"{reader.where} is swapped but the snapshot has no host pool")
    table = _table(reader.child("table"), plans[role].block_size, num_sinks, plans[role].num_blocks)
    num_written = reader.ints("num_written", 0, table.num_tokens)
    if len(num_written) != num_layers:
        _fail(f"{reader.where}.num_written has {len(num_written)} entries for {num_layers} layers")
    if state is SequenceState.PREEMPTED and (table.num_tokens or any(num_written)):
        _fail(f"{reader.where} is preempted but holds tokens")
    if state is not SequenceState.PREEMPTED and any(n != table.num_tokens for n in num_written):
        _fail(f"{reader.where} has reserved tokens not written in every layer")
    token_ids = reader.get("token_ids", list, optional=True)
    block_keys = reader.get("block_keys", list)
    if block_keys and key_size is None:
        _fail(f"{reader.where} has block keys but prefix caching is off")
    seq = _Sequence(raw_id[1], table, num_layers)
    seq.state = state
    seq.num_written = list(num_written)
    if token_ids is not None:
        token_ids = _ints(token_ids, f"{reader.where}.token_ids", 0, (1 << 63) - 1)
    seq.token_ids = token_ids
    seq.block_keys = [_hex(key, f"{reader.where}.block_keys", key_size) for key in block_keys]
    seq.extras = reader.hex("extras")
    return seq
