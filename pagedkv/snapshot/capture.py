"""Capture: the JSON state and page tensors of a live cache, manager or hybrid manager, and ``save``.

Each object hands over its own state through its ``_export_state`` hook
(the cache, the manager, the allocators); everything else is read through
public queries, and nothing is changed. The layout of the state is drawn in
:mod:`pagedkv.snapshot.schema`.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.allocator import AllocatorState
from pagedkv.cache import KVCache
from pagedkv.counts import ChunkedWindow
from pagedkv.errors import ClosedCacheError, InputTypeError
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.manager.manager import COUNTERS, KVCacheManager
from pagedkv.manager.sequence import ManagerState, RecordState, SequenceState, pending_layers
from pagedkv.memory.pool import KVPool
from pagedkv.snapshot.format import (
    Tensors,
    check_path,
    page_parts,
    safetensors_numpy,
    tensor_name,
    write_state,
)
from pagedkv.snapshot.schema import (
    State,
    allocator_json,
    fail,
    role_of,
    seq_id_json,
    table_json,
)

__all__ = ["capture_cache", "capture_hybrid", "capture_manager", "save"]


def save(obj: KVCache | KVCacheManager | HybridKVCacheManager, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` as one snapshot file, atomically.

    Args:
        obj: a ``KVCache``, a ``KVCacheManager`` or a ``HybridKVCacheManager``
            (KV-cache groups); it is only read.
        path: the file; an existing file there is replaced only once the
            new one is complete on disk. Temporary files that killed saves
            of the same ``path`` left in its folder are removed (see
            ``docs/snapshots.md``).

    Raises:
        InputTypeError: ``obj`` is none of these, or ``path`` is not a str or
            ``os.PathLike``.
        ClosedCacheError: the cache is closed.
        SnapshotError: the manager cannot be saved as it is: a sequence has
            reserved tokens some layer has not written, a sequence id is not
            a str or int, or a pool also holds blocks of another owner; or
            the file cannot be written (a missing folder, no space, no
            permission: the ``OSError`` is its ``__cause__``). A file already
            at ``path`` is then left exactly as it was.
        ImportError: safetensors is missing (the ``snapshot`` extra).

    Example:
        >>> import os, tempfile
        >>> from pagedkv import KVCache
        >>> from pagedkv.snapshot import load
        >>> cache = KVCache(max_size=4, block_size=2)
        >>> outputs = [cache.attend([1.0], [0.5], [float(i)]) for i in range(6)]
        >>> path = os.path.join(tempfile.mkdtemp(), "cache.safetensors")
        >>> save(cache, path)
        >>> twin = load(path)
        >>> twin.attend([1.0], [0.5], [6.0]) == cache.attend([1.0], [0.5], [6.0])
        True
        >>> twin.block_ids == cache.block_ids
        True
    """
    path = check_path(path)
    safetensors_numpy()  # fail on a missing extra before any work
    if isinstance(obj, KVCacheManager):
        state, tensors = capture_manager(obj)
    elif isinstance(obj, HybridKVCacheManager):
        state, tensors = capture_hybrid(obj)
    elif isinstance(obj, KVCache):
        state, tensors = capture_cache(obj)
    else:
        raise InputTypeError(f"save takes a KVCache or a KVCacheManager (or a HybridKVCacheManager), got "
                             f"{type(obj).__name__}")
    write_state(path, state, tensors)


def capture_cache(cache: KVCache) -> tuple[State, Tensors]:
    """The state and page tensors of ``cache`` (its own blocks only, even on a shared pool).

    Raises:
        ClosedCacheError: the cache is closed.
    """
    if cache.closed:
        raise ClosedCacheError("this KVCache is closed; there is nothing to save")
    own = cache._export_state()
    pool = cache.pool
    state: State = {
        "kind": "KVCache",
        "cache": {"max_size": cache.max_size, "block_size": cache.block_size, "dtype": cache.dtype.name,
                  "scale": cache.scale, "key_dtype": cache.key_dtype, "value_dtype": cache.value_dtype,
                  "private": own.private, "max_abs_key": own.max_abs_key,
                  "kv_shape": None if own.kv_shape is None else list(own.kv_shape),
                  "table": table_json(own.table)},
        "pools": {},
    }
    if pool is None:
        return state, {}
    saved = sorted(cache.block_ids)
    entry: State = {"config": _pool_config(pool), "saved_ids": saved}
    if own.private:
        entry["allocator"] = allocator_json(pool.allocator._export_state())
    state["pools"]["device"] = entry
    return state, _pages(pool, "device", saved)


def capture_manager(manager: KVCacheManager) -> tuple[State, Tensors]:
    """The state and page tensors of ``manager`` and its pools.

    Raises:
        SnapshotError: a sequence has unwritten reserved tokens, an id is
            not a str or int, or a pool holds blocks of another owner.
    """
    held = _held(manager.pool, manager.host_pool)
    group = _group_json(manager, manager._export_state(), held)
    pools, tensors = _pools_json(manager.pool, manager.host_pool, held, manager.prefix_caching)
    state = {
        "kind": "KVCacheManager",
        "manager": {
            "layer_max_sizes": [_window_json(window) for window in manager.layer_max_sizes],
            "num_sink_tokens": manager.num_sink_tokens,
            **_settings_json(manager), **group,
        },
        "pools": pools,
    }
    return state, tensors


def capture_hybrid(manager: HybridKVCacheManager) -> tuple[State, Tensors]:
    """The state and page tensors of a ``HybridKVCacheManager``: its layout, each group's state, the pools.

    The shared pool is saved once; each group saves what a plain manager
    saves of its own (records, prefix keys, counters), under ``groups``.

    Raises:
        SnapshotError: as ``capture_manager``, for any group.
    """
    held = _held(manager.pool, manager.host_pool)
    groups = [_group_json(group, own, held) for group, own in zip(manager.groups, manager._export_state())]
    pools, tensors = _pools_json(manager.pool, manager.host_pool, held, manager.prefix_caching)
    layout = manager.layout
    state = {
        "kind": "HybridKVCacheManager",
        "hybrid": {
            "layout": {
                "layers_per_group": layout.layers_per_group,
                "groups": [{"layers": list(group.layers), "window": _window_json(group.window),
                            "num_sink_tokens": group.num_sink_tokens} for group in layout.groups],
            },
            **_settings_json(manager.groups[0]),
            "groups": groups,
        },
        "pools": pools,
    }
    return state, tensors


def _window_json(window: int | None) -> int | dict[str, int] | None:
    """A layer's window as JSON: None (full attention), its int (a sliding window), or
    ``{"chunk": C}`` (chunked local attention, ``ChunkedWindow(C)``).

    Raises:
        SnapshotError: the window is another subclass of int: saved as its
            int it would load as a sliding window and change every later
            output, so it is refused.
    """
    if window is None or window.__class__ is int:
        return window
    if window.__class__ is ChunkedWindow:
        return {"chunk": int(window)}
    fail(f"a layer's window is {window!r}, a {type(window).__name__}; snapshots save full attention, "
         "sliding windows and ChunkedWindow only")


def _settings_json(manager: KVCacheManager) -> State:
    """What a manager (or every group of a hybrid one) is configured with, besides windows and sinks."""
    return {
        "num_q_heads": manager.num_q_heads, "scale": manager.scale,
        "enable_prefix_caching": manager.prefix_caching, "hash_algorithm": manager.hash_algorithm,
        # NOTE: only when set, so a default manager's file is byte for byte what it always was.
        **({"trusted_inputs": True} if manager.trusted_inputs else {}),
    }


def _held(device: KVPool, host: KVPool | None) -> dict[str, list[int]]:
    """A zero count of the block tables holding each block, per pool role."""
    pools_of = {"device": device, "host": host}
    return {role: [0] * pool.num_blocks for role, pool in pools_of.items() if pool is not None}


def _group_json(manager: KVCacheManager, own: ManagerState, held: dict[str, list[int]]) -> State:
    """One manager's own state (records, keys, counters) as JSON; counts its tables' blocks in ``held``.

    Raises:
        SnapshotError: a sequence has unwritten reserved tokens, or an id is not a str or int.
    """
    sequences = []
    for record in own.records:
        pending = pending_layers(record.num_written, record.table.num_tokens)
        if record.state is SequenceState.RUNNING and pending:
            fail(f"sequence {record.seq_id!r} has reserved tokens that layers {pending} have not "
                 "written; write them (or free the sequence) before saving")
        for block_id in (*record.table.sink_ids, *record.table.window_ids):
            held[role_of(record.state)][block_id] += 1
        sequences.append(_record_json(record))
    return {
        "max_abs_key": list(own.max_abs_key),
        "counters": {name: own.counters[name] for name in COUNTERS},
        "prefix": {
            "keys": [[block_id, key.hex()] for block_id, key in own.prefix_keys],
            "num_evictions": own.num_prefix_evictions,
        } if manager.prefix_caching else None,
        "sequences": sequences,
    }


def _pools_json(device: KVPool, host: KVPool | None, held: dict[str, list[int]],
                prefix_caching: bool) -> tuple[State, Tensors]:
    """Each pool's configuration, allocator state and saved pages; they must hold only ``held``.

    Raises:
        SnapshotError: a pool also holds blocks of another owner.
    """
    pools_of = {"device": device, "host": host}
    pools: State = {}
    tensors: Tensors = {}
    for role, counts in held.items():
        pool = pools_of[role]
        assert pool is not None
        allocator = pool.allocator._export_state()
        if allocator.ref_counts != counts:
            fail(f"the {role} pool also holds blocks of another cache or manager; only a manager "
                 "that owns its pools alone can be saved")
        if allocator.cached and (role == "host" or not prefix_caching):
            fail(f"the {role} pool holds prefix-cached blocks of another manager")
        saved = _saved_ids(allocator)
        pools[role] = {"config": _pool_config(pool), "allocator": allocator_json(allocator),
                       "saved_ids": saved}
        tensors.update(_pages(pool, role, saved))
    return pools, tensors


def _record_json(record: RecordState) -> State:
    return {
        "seq_id": seq_id_json(record.seq_id), "state": record.state.value, "table": table_json(record.table),
        "num_written": list(record.num_written), "extras": record.extras.hex(),
        "token_ids": None if record.token_ids is None else list(record.token_ids),
        "block_keys": [key.hex() for key in record.block_keys],
    }


def _saved_ids(allocator: AllocatorState) -> list[int]:
    """The blocks whose pages a snapshot keeps: in use, or cached (a prefix hit can revive them)."""
    return sorted({b for b, n in enumerate(allocator.ref_counts) if n} | set(allocator.cached))


def _pool_config(pool: KVPool) -> State:
    return {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "num_kv_heads": pool.num_kv_heads,
            "head_dim": pool.head_dim, "num_layers": pool.num_layers, "dtype": pool.dtype.name,
            "key_dtype": pool.key_dtype, "value_dtype": pool.value_dtype}


def _pages(pool: KVPool, role: str, block_ids: list[int]) -> Tensors:
    ids = np.array(block_ids, np.intp)

    def take(store: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
        # NOTE: np.take into a fresh array, mode="clip" (the ids are the pool's
        # own): store[:, ids] would return a block-major, non-contiguous array
        # that the checksum and the writer would each copy again.
        out = np.empty((store.shape[0], len(ids), *store.shape[2:]), store.dtype)
        np.take(store, ids, axis=1, out=out, mode="clip")
        # fp8 and bfloat16 travel as unsigned ints of their size (safetensors' numpy API has neither)
        return out.view(np.dtype(f"u{out.dtype.itemsize}")) if out.dtype.kind == "V" else out

    parts = page_parts(pool.key_format is not None, pool.value_format is not None)
    return {tensor_name(role, part, layer): take(getattr(pool, part)(layer))
            for layer in range(pool.num_layers) for part in parts}
