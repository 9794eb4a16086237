"""Restore: validate a snapshot's state and pages whole, then build the object, and ``load``.

Validation comes first and allocates no pool: the bytes the load will
take against ``max_bytes``, every field, every block table (rebuilt with
``BlockTable.restored`` and compared with its saved state), every allocator
state (checked compactly, see :mod:`pagedkv.snapshot.pools`), the prefix keys
(recomputed, see :mod:`pagedkv.snapshot.prefix`), the pages, and the
recorded largest key. Only then are the pools made and each object takes its
state through its own ``_restore_state`` hook: allocators, then the manager
(its prefix cache and sequence records; a hybrid manager's, each group's) or
the cache (its table, filled in place). A final ``check_invariants()`` runs every class's own rules.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Hashable
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.table import BlockTable
from pagedkv.cache import CacheState, KVCache
from pagedkv.counts import ChunkedWindow, check_count, window_blocks
from pagedkv.errors import ConfigError, InputTypeError, PagedKVError, SnapshotError
from pagedkv.manager.groups import GroupLayout, KVCacheGroup
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.manager.manager import COUNTERS, KVCacheManager, ManagerState
from pagedkv.manager.sequence import RecordState, SequenceState, pending_layers
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import HASH_KEY_SIZES
from pagedkv.snapshot.format import Tensors, read_state
from pagedkv.snapshot.pools import PoolPlan, SavedAllocator, check_keys, check_pools
from pagedkv.snapshot.prefix import vouch_keys
from pagedkv.snapshot.schema import (
    DTYPES,
    STORAGE,
    Reader,
    fail,
    hex_bytes,
    ints,
    invariants,
    is_int,
    role_of,
    shown,
    table_json,
)

__all__ = ["load", "restore"]


def load(
    path: str | os.PathLike[str], *, pool: KVPool | None = None, max_bytes: int | None = None,
    trust_cached_keys: bool = False,
) -> KVCache | KVCacheManager | HybridKVCacheManager:
    """Build a fresh ``KVCache``, ``KVCacheManager`` or ``HybridKVCacheManager`` from a ``save``d file.

    Args:
        path: the snapshot file.
        pool: (cache snapshots only) a shared pool to hold the cache's
            blocks; their ids then differ, the outputs do not. By default a
            cache gets a private pool, with its saved block ids if it had one.
        max_bytes: refuse a snapshot whose load would take more bytes than
            this: its tensors and parsed header, and the pools' pages and
            bookkeeping of every block, free or not. The default is the
            machine's physical memory.
        trust_cached_keys: keep the prefix keys that no saved sequence
            vouches for (those of cached free blocks). By default they are
            dropped, since nothing in the file can prove them (see
            :mod:`pagedkv.snapshot.prefix`); pass True only for a file you
            wrote and nobody else could change, to keep its cache hits.

    Returns:
        The new object: every later output equals the saved object's (with
        ``trust_cached_keys``, also every later prefix hit).

    Raises:
        SnapshotError: the file is truncated, damaged, of another format or
            version, inconsistent (forged prefix keys included), or larger
            than ``max_bytes``; nothing is built and ``pool`` is untouched.
        InputTypeError, ConfigError: ``path`` is not a str or ``os.PathLike``,
            ``max_bytes`` is not an int >= 0 (NaN, floats and bools
            included) or ``trust_cached_keys`` not a bool.
        ConfigError: ``pool`` does not fit the cache or has too few free
            blocks (unchanged), or was given for a manager snapshot.
        ImportError: safetensors (``snapshot`` extra), for fp8 pages
            ml_dtypes (``fp8`` extra), or for ``"xxh3_128"`` prefix keys
            xxhash (``xxhash`` extra) is missing.
    """
    limit = _physical_memory() if max_bytes is None else check_count("max_bytes", max_bytes, minimum=0)
    if not isinstance(trust_cached_keys, bool):
        raise InputTypeError(f"trust_cached_keys must be True or False, got {shown(trust_cached_keys)}")
    state, tensors, num_bytes = read_state(path, limit)
    return restore(state, tensors, (limit, num_bytes), pool, trust_cached_keys=trust_cached_keys)


def restore(state: object, tensors: Tensors, limit: tuple[int, int], pool: KVPool | None, *,
            trust_cached_keys: bool = False) -> KVCache | KVCacheManager | HybridKVCacheManager:
    """Validate ``state`` and ``tensors`` whole, then build the object they describe.

    Args:
        state: the parsed state.
        tensors: the file's tensors.
        limit: ``(max_bytes, bytes reading the file took)``.
        pool: see ``load``.
        trust_cached_keys: see ``load``.

    Raises:
        SnapshotError: anything is inconsistent or the load needs more than ``max_bytes``.
        ConfigError, InputTypeError: ``pool`` does not fit (see ``load``).
    """
    root = Reader(state, "state")
    kind = root.choice("kind", ("KVCache", "KVCacheManager", "HybridKVCacheManager"))
    if kind == "KVCache":
        return _restore_cache(root, tensors, limit, pool)
    if pool is not None:
        raise ConfigError("pool= is for cache snapshots; a manager snapshot builds its own pools")
    if kind == "HybridKVCacheManager":
        return _restore_hybrid(root, tensors, limit, trust_cached_keys)
    return _restore_manager(root, tensors, limit, trust_cached_keys)


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 1 << 40


# ===================================================================== caches


def _restore_cache(root: Reader, tensors: Tensors, limit: tuple[int, int], pool: KVPool | None) -> KVCache:
    config = root.child("cache")
    max_size = config.integer("max_size", 1, optional=True)
    block_size = config.integer("block_size", 1)
    dtype = np.dtype(config.choice("dtype", DTYPES))
    key_dtype, value_dtype = config.choice("key_dtype", STORAGE), config.choice("value_dtype", STORAGE)
    scale = config.number("scale", non_negative=False)
    private = config.get("private", bool)
    max_abs_key = config.number("max_abs_key")
    kv_shape = config.get("kv_shape", list, optional=True)
    pools = root.child("pools")
    if set(pools.value) - {"device"}:
        fail(f"a cache snapshot holds one pool, got {sorted(pools.value)}")
    plan = PoolPlan(pools.child("device"), tensors, "device", private) if "device" in pools.value else None
    if plan is not None and plan.same_shape()[:1] + plan.same_shape()[3:] != (
        block_size, 1, dtype, key_dtype, value_dtype
    ):
        fail("the cache's pool disagrees with its block_size, dtype or storage dtypes, or has many layers")
    table = _table(config.child("table"), block_size, 0, plan.num_blocks if plan else 0)
    if max_size is not None and (table.num_blocks > window_blocks(max_size, block_size)
                                 or table.num_live_tokens > max_size):
        fail(f"{config.where}.table holds more than max_size={max_size} allows")
    # The pool this load builds: the saved one (private), one for a cache saved on a shared pool, or none.
    num_built = 0 if plan is None or pool is not None else (
        plan.num_blocks if private else _private_pool_blocks(max_size, block_size, table.num_blocks))
    check_pools([plan] if plan else [], tensors, limit, [num_built] if plan else None)
    if kv_shape is not None:
        heads = tuple(ints(kv_shape, f"{config.where}.kv_shape", 1))
        if plan is None or (heads if len(heads) == 2 else (1, *heads)) != (plan.num_kv_heads, plan.head_dim):
            fail(f"{config.where}.kv_shape = {shown(kv_shape)} does not fit the pool")
    elif table.num_blocks:
        fail(f"{config.where} holds blocks but no kv_shape")
    allocator: SavedAllocator | None = None
    if plan is not None:
        if sorted(table.block_ids) != plan.saved_ids:
            fail("the saved pages are not exactly the cache's blocks")
        plan.check_pages()
        _check_key_bound(plan, 0, _live_slots(table, plan), max_abs_key)
        if private:
            allocator = plan.saved_allocator(Counter(table.block_ids))
            if allocator.cached or allocator.cached_free:
                fail("a cache's private pool has no prefix cache, but blocks are marked cached")
    if pool is not None:
        _check_target_pool(pool, plan, block_size, dtype, key_dtype, value_dtype, table.num_blocks)
    # ---- validated: from here on nothing can fail ----
    cache = KVCache(max_size, block_size=block_size, pool=pool, dtype=dtype, scale=scale,
                    key_dtype=key_dtype, value_dtype=value_dtype)
    saved = table._export_state()
    shape = None if kv_shape is None else tuple(kv_shape)
    if plan is None:
        cache._restore_state(CacheState(pool is None, max_abs_key, shape, saved), None)
        return cache
    old_ids = table.block_ids
    if pool is not None:
        target, new_ids = pool, pool.allocator.allocate(len(old_ids))
    elif allocator is not None:
        target, new_ids = plan.build(growable=True), old_ids  # exactly as saved
        target.allocator._restore_state(allocator.state())
    else:  # it was on a shared pool: a private one, ids 0..k-1 in logical order
        target = KVPool(num_built, block_size=block_size, num_kv_heads=plan.num_kv_heads,
                        head_dim=plan.head_dim, dtype=dtype, growable=True, key_dtype=key_dtype,
                        value_dtype=value_dtype)
        new_ids = target.allocator.allocate(len(old_ids))
    rename = dict(zip(old_ids, new_ids))
    plan.write_pages(target, [rename[block_id] for block_id in plan.saved_ids])
    placed = dataclasses.replace(saved, sink_ids=[rename[block_id] for block_id in saved.sink_ids],
                                 window_ids=[rename[block_id] for block_id in saved.window_ids])
    cache._restore_state(CacheState(pool is None, max_abs_key, shape, placed), None if pool else target)
    # A given pool may be shared with others whose state is theirs: check only what is ours there.
    check = cache.check_invariants if pool is None else cache.block_table.check_invariants
    try:
        invariants(check, "cache")
    except SnapshotError:
        cache.close()  # gives the blocks back: a failed load leaves the pool as it was
        raise
    return cache


def _private_pool_blocks(max_size: int | None, block_size: int, num_blocks: int) -> int:
    """The blocks of the private pool a cache saved on a shared pool loads into.

    NOTE: sized as ``KVCache`` sizes its own first pool (twice the window's
    blocks, at most 64; 4 without a window) but never below the blocks it
    holds: the pool is growable, and a forged ``max_size`` of 10**12 must not
    size it.
    """
    first = min(2 * window_blocks(max_size, block_size), 64) if max_size is not None else 4
    return max(first, num_blocks)


def _check_target_pool(pool: KVPool, plan: PoolPlan | None, block_size: int, dtype: np.dtype[Any],
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


# =================================================================== managers


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """What a manager, or every group of a hybrid one, is configured with besides windows and sinks."""

    num_q_heads: int
    scale: float
    prefix_on: bool
    hash_algorithm: str
    trusted_inputs: bool


@dataclasses.dataclass(slots=True)
class _GroupPlan:
    """One manager's own state (or one KV-cache group's), read and checked; nothing built.

    Attributes:
        num_layers: the pool layers it uses.
        num_sinks: its sink tokens.
        max_abs_key: its largest |key| of each of its layers.
        counters: its counters.
        records: its sequence records, in the saved order.
        tables: each record's block table, by sequence id.
        keys: its prefix keys ``(block_id, key)`` (empty without prefix caching).
        num_evictions: its prefix cache's eviction count.
    """

    num_layers: int
    num_sinks: int
    max_abs_key: list[float]
    counters: dict[str, int]
    records: list[RecordState]
    tables: dict[Hashable, BlockTable]
    keys: list[tuple[int, bytes]]
    num_evictions: int

    def state(self) -> ManagerState:
        """The ``ManagerState`` a new manager of this group takes through ``_restore_state``."""
        return ManagerState(max_abs_key=self.max_abs_key, counters=self.counters, records=self.records,
                            prefix_keys=self.keys, num_prefix_evictions=self.num_evictions)


def _restore_manager(
    root: Reader, tensors: Tensors, limit: tuple[int, int], trust_cached_keys: bool
) -> KVCacheManager:
    config = root.child("manager")
    plans = _pool_plans(root, tensors, limit)
    num_layers = plans["device"].num_layers
    saved_windows = config.get("layer_max_sizes", list)
    if len(saved_windows) != num_layers:
        fail(f"{config.where}.layer_max_sizes = {shown(saved_windows)} does not fit {num_layers} layers")
    windows = [_window(window, f"{config.where}.layer_max_sizes[{layer}]")
               for layer, window in enumerate(saved_windows)]
    num_sinks = config.integer("num_sink_tokens")
    settings = _settings(config, plans["device"])
    group = _group_plan(config, plans, settings, num_layers, num_sinks)
    allocators, unkeyed = _check_groups(plans, [group], settings, trust_cached_keys)
    # ---- validated: from here on nothing can fail ----
    built = _build_pools(plans, allocators, unkeyed)
    manager = KVCacheManager(built["device"], layer_max_sizes=windows, num_sink_tokens=num_sinks,
                             num_q_heads=settings.num_q_heads, scale=settings.scale,
                             host_pool=built.get("host"), enable_prefix_caching=settings.prefix_on,
                             hash_algorithm=settings.hash_algorithm, trusted_inputs=settings.trusted_inputs)
    manager._restore_state(group.state())
    invariants(manager.check_invariants, "manager")
    return manager


def _restore_hybrid(
    root: Reader, tensors: Tensors, limit: tuple[int, int], trust_cached_keys: bool
) -> HybridKVCacheManager:
    """A ``HybridKVCacheManager``: the layout, one pool (and host pool) shared by every group's state.

    Each group is checked as a plain manager's state is, against the pools the
    groups share: ref counts count every group's tables, the prefix keys of all
    groups together sit exactly on the cached blocks (a block keyed by one group
    at most), and every group must hold the same sequences, each in the same
    state with the same tokens.
    """
    config = root.child("hybrid")
    plans = _pool_plans(root, tensors, limit)
    device = plans["device"]
    layout = _layout(config.child("layout"))
    if layout.layers_per_group != device.num_layers:
        fail(f"{config.where}.layout puts {layout.layers_per_group} layers in a block but the device pool's "
             f"blocks hold {device.num_layers}; the layout and the pool disagree")
    settings = _settings(config, device)
    raw_groups = config.get("groups", list)
    if len(raw_groups) != len(layout.groups):
        fail(f"{config.where}.groups holds {len(raw_groups)} group states for the layout's "
             f"{len(layout.groups)} groups")
    groups = [
        _group_plan(Reader(raw, f"{config.where}.groups[{index}]"), plans, settings, len(group.layers),
                    group.num_sink_tokens)
        for index, (raw, group) in enumerate(zip(raw_groups, layout.groups))
    ]
    _check_in_step(groups)
    allocators, unkeyed = _check_groups(plans, groups, settings, trust_cached_keys)
    # ---- validated: from here on nothing can fail ----
    built = _build_pools(plans, allocators, unkeyed)
    manager = HybridKVCacheManager(built["device"], layout, num_q_heads=settings.num_q_heads,
                                   scale=settings.scale, host_pool=built.get("host"),
                                   enable_prefix_caching=settings.prefix_on,
                                   hash_algorithm=settings.hash_algorithm,
                                   trusted_inputs=settings.trusted_inputs)
    manager._restore_state([group.state() for group in groups])
    invariants(manager.check_invariants, "hybrid manager")
    return manager


def _pool_plans(root: Reader, tensors: Tensors, limit: tuple[int, int]) -> dict[str, PoolPlan]:
    """A manager's device pool and maybe host pool, each plan checked, and against ``max_bytes``."""
    pools = root.child("pools")
    if "device" not in pools.value or set(pools.value) - {"device", "host"}:
        fail(f"a manager snapshot holds a device pool and maybe a host pool, got {sorted(pools.value)}")
    roles = [role for role in ("device", "host") if role in pools.value]
    plans: dict[str, PoolPlan] = {role: PoolPlan(pools.child(role), tensors, role, True) for role in roles}
    check_pools(list(plans.values()), tensors, limit)
    if "host" in plans and plans["host"].same_shape() != plans["device"].same_shape():
        fail("the host pool's shape or dtypes differ from the device pool's")
    return plans


def _settings(config: Reader, device: PoolPlan) -> _Settings:
    num_q_heads = config.integer("num_q_heads", 1)
    if num_q_heads % device.num_kv_heads:
        fail(f"{config.where}.num_q_heads = {num_q_heads} is not a multiple of num_kv_heads")
    scale = config.number("scale", non_negative=False)
    prefix_on = config.get("enable_prefix_caching", bool)
    hash_algorithm = config.choice("hash_algorithm", tuple(HASH_KEY_SIZES))
    trusted_inputs = config.get("trusted_inputs", bool) if "trusted_inputs" in config.value else False
    return _Settings(num_q_heads, scale, prefix_on, hash_algorithm, trusted_inputs)


def _window(value: Any, where: str) -> int | None:
    """A saved window (``capture._window_json``): None, an int >= 1, or ``{"chunk": C >= 1}``.

    >>> _window({"chunk": 4}, "w"), _window(3, "w"), _window(None, "w")
    (ChunkedWindow(4), 3, None)
    """
    if value is None or (is_int(value) and value >= 1):
        return value  # type: ignore[no-any-return]
    chunk: Any = value.get("chunk") if isinstance(value, dict) and list(value) == ["chunk"] else None
    if is_int(chunk) and chunk >= 1:
        return ChunkedWindow(chunk)
    fail(f"{where} = {shown(value)} is not a window: null, an int >= 1, or {{\"chunk\": C}} with C >= 1")


def _layout(reader: Reader) -> GroupLayout:
    """The saved ``GroupLayout``, checked by its own constructor."""
    layers_per_group = reader.integer("layers_per_group", 1)
    groups = []
    for index, raw in enumerate(reader.get("groups", list)):
        entry = Reader(raw, f"{reader.where}.groups[{index}]")
        layers = entry.ints("layers", 0, (1 << 31) - 1)
        window = _window(entry.get("window", (int, dict), optional=True), f"{entry.where}.window")
        groups.append(KVCacheGroup(tuple(layers), window, entry.integer("num_sink_tokens")))
    try:
        return GroupLayout(tuple(groups), layers_per_group)
    except PagedKVError as error:
        fail(f"{reader.where} is not a valid layout: {error}")


def _group_plan(config: Reader, plans: dict[str, PoolPlan], settings: _Settings, num_layers: int,
                num_sinks: int) -> _GroupPlan:
    """One manager's (or group's) largest keys, counters, sequences and prefix keys, each checked."""
    max_abs_key = config.get("max_abs_key", list)
    if len(max_abs_key) != num_layers or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        for x in max_abs_key
    ):
        fail(f"{config.where}.max_abs_key must hold {num_layers} finite numbers >= 0")
    counters = {name: config.child("counters").integer(name) for name in COUNTERS}
    key_size = HASH_KEY_SIZES[settings.hash_algorithm]
    records: dict[Hashable, RecordState] = {}
    tables: dict[Hashable, BlockTable] = {}
    for number, raw in enumerate(config.get("sequences", list)):
        record, table = _record(Reader(raw, f"{config.where}.sequences[{number}]"), plans, num_sinks,
                                num_layers, key_size if settings.prefix_on else None)
        if record.seq_id in records:
            fail(f"sequence id {record.seq_id!r} appears twice")
        records[record.seq_id], tables[record.seq_id] = record, table
    keys: list[tuple[int, bytes]] = []
    num_evictions = 0
    if settings.prefix_on:
        prefix = config.child("prefix")
        num_evictions = prefix.integer("num_evictions")
        for entry in prefix.get("keys", list):
            if not (isinstance(entry, list) and len(entry) == 2 and is_int(entry[0])
                    and 0 <= entry[0] < plans["device"].num_blocks):
                fail(f"{prefix.where}.keys holds {shown(entry)}; expected [block_id, hex key] pairs")
            keys.append((entry[0], hex_bytes(entry[1], f"{prefix.where}.keys", key_size)))
    elif config.get("prefix", dict, optional=True) is not None:
        fail(f"{config.where}.prefix is given but prefix caching is off")
    return _GroupPlan(num_layers, num_sinks, [float(x) for x in max_abs_key], counters,
                      list(records.values()), tables, keys, num_evictions)


def _check_in_step(groups: list[_GroupPlan]) -> None:
    """Every group holds the same sequences in the same order, each in one state with the same tokens."""
    first = groups[0]
    seq_ids = [record.seq_id for record in first.records]
    for index, group in enumerate(groups[1:], 1):
        if [record.seq_id for record in group.records] != seq_ids:
            fail(f"group {index} holds sequences {shown([r.seq_id for r in group.records])}, group 0 "
                 f"{shown(seq_ids)}; every group holds the same sequences")
        for mine, theirs in zip(first.records, group.records):
            if (theirs.state, theirs.table.num_tokens) != (mine.state, mine.table.num_tokens):
                fail(f"sequence {shown(mine.seq_id)} holds {theirs.table.num_tokens} tokens "
                     f"({theirs.state.value}) in group {index} but {mine.table.num_tokens} "
                     f"({mine.state.value}) in group 0; every group holds the same tokens")
            if (theirs.token_ids, theirs.extras) != (mine.token_ids, mine.extras):
                fail(f"sequence {shown(mine.seq_id)} has other token ids or extra keys in group {index} "
                     "than in group 0")


def _check_groups(plans: dict[str, PoolPlan], groups: list[_GroupPlan], settings: _Settings,
                  trust_cached_keys: bool) -> tuple[dict[str, SavedAllocator], set[int]]:
    """Check the groups' tables and keys against the pools they share; vouch for each group's keys.

    Returns:
        Each pool's saved allocator and the device blocks whose keys were
        dropped. Each group's records and keys become those the load keeps.
    """
    held: dict[str, Counter[int]] = {role: Counter() for role in plans}  # tables holding each block
    for group in groups:
        for record in group.records:
            held[role_of(record.state)].update(group.tables[record.seq_id].block_ids)
    allocators: dict[str, SavedAllocator] = {}
    for role, plan in plans.items():
        allocator = allocators[role] = plan.saved_allocator(held[role])
        device_keys = role == "device" and settings.prefix_on
        check_keys(allocator, [group.keys for group in groups] if device_keys else None, role)
        if set(plan.saved_ids) != held[role].keys() | set(allocator.cached):
            fail(f"the {role} pages saved are not exactly the blocks in use or cached")
        plan.check_pages()
        if settings.trusted_inputs:  # a trusted manager tracks no largest |key| (nor bounds scores)
            continue
        bs = plan.block_size
        for group in groups:  # a cached block was written by the group that keyed it
            cached = plan.saved_index(np.array([block_id for block_id, _ in group.keys] if device_keys
                                               else [], np.intp))
            slots = [(cached[:, None] * bs + np.arange(bs)).ravel()]
            slots += [_live_slots(group.tables[record.seq_id], plan) for record in group.records
                      if role_of(record.state) == role]
            for layer in range(group.num_layers):
                _check_key_bound(plan, layer, np.concatenate(slots), group.max_abs_key[layer])
    unkeyed: set[int] = set()
    if settings.prefix_on:
        block_size = plans["device"].block_size
        for group in groups:
            vouched = vouch_keys(group.records, group.tables, group.keys, block_size, settings.hash_algorithm,
                                 trust=trust_cached_keys)
            group.records, group.keys = vouched.records, vouched.keys
            unkeyed |= vouched.unkeyed
    return allocators, unkeyed


def _build_pools(plans: dict[str, PoolPlan], allocators: dict[str, SavedAllocator],
                 unkeyed: set[int]) -> dict[str, KVPool]:
    """The pools, their pages written and allocators restored (device: ``unkeyed`` blocks not cached)."""
    built: dict[str, KVPool] = {}
    for role, plan in plans.items():  # one pool at a time: its state's Python ints live only here
        built[role] = plan.build(growable=False)
        plan.write_pages(built[role], plan.saved_ids)
        built[role].allocator._restore_state(allocators[role].state(unkeyed if role == "device" else set()))
    return built


def _record(reader: Reader, plans: dict[str, PoolPlan], num_sinks: int, num_layers: int,
            key_size: int | None) -> tuple[RecordState, BlockTable]:
    """One sequence's record state, checked, and its block table (for the checks that follow)."""
    raw_id = reader.get("seq_id", list)
    if not (len(raw_id) == 2 and ((raw_id[0] == "s" and isinstance(raw_id[1], str))
                                  or (raw_id[0] == "i" and is_int(raw_id[1])))):
        fail(f"{reader.where}.seq_id = {shown(raw_id)}; expected ['s', str] or ['i', int]")
    state = SequenceState(reader.choice("state", tuple(s.value for s in SequenceState)))
    role = role_of(state)
    if role not in plans:
        fail(f"{reader.where} is swapped but the snapshot has no host pool")
    table = _table(reader.child("table"), plans[role].block_size, num_sinks, plans[role].num_blocks)
    num_written = reader.ints("num_written", 0, table.num_tokens)
    if len(num_written) != num_layers:
        fail(f"{reader.where}.num_written has {len(num_written)} entries for {num_layers} layers")
    if state is SequenceState.PREEMPTED and (table.num_tokens or any(num_written)):
        fail(f"{reader.where} is preempted but holds tokens")
    if state is not SequenceState.PREEMPTED and pending_layers(num_written, table.num_tokens):
        fail(f"{reader.where} has reserved tokens not written in every layer")
    token_ids = reader.get("token_ids", list, optional=True)
    block_keys = reader.get("block_keys", list)
    if block_keys and key_size is None:
        fail(f"{reader.where} has block keys but prefix caching is off")
    if token_ids is not None:
        token_ids = ints(token_ids, f"{reader.where}.token_ids", 0, (1 << 63) - 1)
    record = RecordState(
        seq_id=raw_id[1], state=state, table=table._export_state(), num_written=list(num_written),
        token_ids=token_ids, block_keys=[hex_bytes(key, f"{reader.where}.block_keys", key_size)
                                         for key in block_keys],
        extras=reader.hex("extras"),
    )
    return record, table


def _table(reader: Reader, block_size: int, num_sink_tokens: int, num_blocks: int) -> BlockTable:
    """A block table from its state, ids within ``num_blocks``, its invariants checked."""
    sink_ids = reader.ints("sink_ids", 0, num_blocks - 1)
    window_ids = reader.ints("window_ids", 0, num_blocks - 1)
    num_tokens, window_start = reader.integer("num_tokens"), reader.integer("window_start")
    reader.integer("first_block")
    table = BlockTable.restored(block_size, num_sink_tokens, num_tokens, window_start, sink_ids + window_ids)
    invariants(table.check_invariants, reader.where)
    if table_json(table._export_state()) != reader.value:
        fail(f"{reader.where} is inconsistent: its fields do not describe one block table")
    return table


def _live_slots(table: BlockTable, plan: PoolPlan) -> npt.NDArray[np.intp]:
    """Live tokens of ``table`` as ``saved_index * block_size + offset``."""
    ranges = table.live_ranges()
    if not table.num_blocks or not ranges:
        return np.empty(0, np.intp)
    slots = table.slot_array(ranges)
    bs = table.block_size
    index = plan.saved_index(slots // bs)
    if np.any(index < 0):
        fail(f"block {int(slots[index < 0][0]) // bs} is in a block table but its pages are not saved")
    result: npt.NDArray[np.intp] = index * bs + slots % bs
    return result


def _check_key_bound(plan: PoolPlan, layer: int, slots: npt.NDArray[np.intp], bound: float) -> None:
    # NOTE: attend refuses queries whose scores could overflow, using the
    # largest |key| written so far; pages beyond the recorded maximum would
    # slip past that check. Dequantized keys may pass it by a few ulps.
    found = float(plan.slot_key_max(layer)[slots].max()) if len(slots) else 0.0
    if found > bound * (1 + 1e-6):
        fail(f"layer {layer} holds keys up to {found:.6g} but the snapshot records a largest |key| "
             f"of {bound:.6g}")
