"""Snapshots: a ``KVCache`` or a whole ``KVCacheManager`` in one safetensors file, and back.

``save(obj, path)`` writes everything that decides later outputs and block
tables: the configuration, the allocator's ref counts and free queues (in
order), every block table, the prefix keys in LRU order, the counters, and
the pages in use (blocks some table holds or a prefix key can revive, never
the whole pool), of the device pool and of the host tier. ``load(path)``
builds a fresh object whose every later output is identical, bit for bit.

The file is safetensors, through ``safetensors.numpy`` (the ``snapshot``
extra); no pickle anywhere::

    8 bytes    n, the JSON header's length, little endian
    n bytes    JSON header: each tensor's dtype, shape and byte offsets, and
               __metadata__ = {format, version, state (JSON text), checksum}
    the rest   tensor bytes, pages of the saved blocks only:
                 device.keys.{layer}        (num_kv_heads, num_saved, block_size, head_dim)
                 device.values.{layer}      floats, or codes (int8; fp8 as uint8)
                 device.key_scales.{layer}  (num_kv_heads, num_saved, block_size, num_groups)
                 host.keys.{layer} ...      the host tier, when there is one

* **Checksum**: SHA-256 over the format, version, state and every tensor's
  name, dtype, shape and bytes, so ``load`` tells a damaged file from a valid
  one. (It detects damage, not forgery: it is no signature.)
* **Atomic save**: a temporary file in the same folder, fsync, rename over
  ``path``, fsync of the folder. A process killed mid-save leaves the
  previous snapshot intact (and at worst a ``.*.tmp`` file beside it).
* **Validated load**: the header is checked against the file size before any
  tensor is read (a header declaring 10^12 blocks is refused without
  allocating them), then the state is validated whole (version, dtypes,
  shapes against the configuration, block ids in range, ref counts equal to
  the tables' counts, lengths within the pool, pages finite and within the
  recorded largest key) before a pool is made. A failure raises
  :class:`~pagedkv.errors.SnapshotError` and touches nothing that exists.

>>> import os, tempfile
>>> from pagedkv import KVCache
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

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from pagedkv.cache import KVCache
from pagedkv.errors import InputTypeError, SnapshotError
from pagedkv.manager import KVCacheManager
from pagedkv.pool import KVPool
from pagedkv.snapshot_state import capture_cache, capture_manager, restore

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "VERSION", "load", "save"]

#: The ``format`` field of every pagedkv snapshot.
FORMAT = "pagedkv-snapshot"
#: The snapshot format version this code writes and reads.
VERSION = 1
#: The largest JSON header accepted (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: Tensor dtypes a snapshot may hold (safetensors names).
_TENSOR_DTYPES = {"F32": np.float32, "F64": np.float64, "I8": np.int8, "U8": np.uint8}


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy
    except ImportError as error:
        raise ImportError('snapshots need the safetensors package: pip install "pagedkv[snapshot]"') \
            from error
    return safetensors.numpy


def _fail(message: str) -> NoReturn:
    raise SnapshotError(message)


# ---------------------------------------------------------------------- save


def save(obj: KVCache | KVCacheManager, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` as one snapshot file, atomically.

    Args:
        obj: a ``KVCache`` or a ``KVCacheManager``; it is only read.
        path: the file; an existing file there is replaced only once the
            new one is complete on disk.

    Raises:
        InputTypeError: ``obj`` is neither.
        ClosedCacheError: the cache is closed.
        SnapshotError: the manager cannot be saved as it is: a sequence has
            reserved tokens some layer has not written, a sequence id is not
            a str or int, or a pool also holds blocks of another owner.
        ImportError: safetensors is missing (the ``snapshot`` extra).
    """
    _safetensors_numpy()
    if isinstance(obj, KVCacheManager):
        state, tensors = capture_manager(obj)
    elif isinstance(obj, KVCache):
        state, tensors = capture_cache(obj)
    else:
        raise InputTypeError(f"save takes a KVCache or a KVCacheManager, got {type(obj).__name__}")
    _write(os.fspath(path), state, tensors)


def _write(path: str, state: dict[str, Any], tensors: dict[str, npt.NDArray[Any]],
           version: int = VERSION) -> None:
    """Write a snapshot file (tests call this with a tampered ``state`` to prove ``load`` refuses it)."""
    numpy_api = _safetensors_numpy()
    metadata = {"format": FORMAT, "version": str(version), "state": _canonical(state)}
    metadata["checksum"] = _checksum(metadata, tensors)
    contiguous = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.close(handle)
        numpy_api.save_file(contiguous, temporary, metadata=metadata)
        handle = os.open(temporary, os.O_RDWR)
        try:
            os.fsync(handle)  # the bytes are on disk before the name points at them
        finally:
            os.close(handle)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)  # ... and the rename itself survives a crash
    finally:
        os.close(handle)


def _canonical(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _checksum(metadata: dict[str, str], tensors: dict[str, npt.NDArray[Any]]) -> str:
    """``sha256:<hex>`` over the format, version, state and every tensor (sorted by name)."""
    digest = hashlib.sha256()
    for field in ("format", "version", "state"):
        digest.update(f"{field}\0{metadata[field]}\0".encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{array.dtype.str}\0{list(array.shape)}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return "sha256:" + digest.hexdigest()


# ---------------------------------------------------------------------- load


def load(
    path: str | os.PathLike[str], *, pool: KVPool | None = None, max_bytes: int | None = None
) -> KVCache | KVCacheManager:
    """Build a fresh ``KVCache`` or ``KVCacheManager`` from a snapshot written by ``save``.

    Args:
        path: the snapshot file.
        pool: (cache snapshots only) a shared pool to hold the cache's
            blocks; their ids then differ, the outputs do not. By default a
            cache gets a private pool, with its saved block ids if it had one.
        max_bytes: refuse a snapshot whose pools would take more bytes than
            this (pages and bookkeeping of every block, free or not); the
            default is the machine's physical memory.

    Returns:
        The new object: every later output equals the saved object's.

    Raises:
        SnapshotError: the file is truncated, damaged, of another format or
            version, inconsistent, or larger than ``max_bytes``; nothing is
            built and ``pool`` is untouched.
        ConfigError: ``pool`` does not fit the cache or has too few free
            blocks (unchanged), or was given for a manager snapshot.
        ImportError: safetensors (``snapshot`` extra) or, for fp8 pages,
            ml_dtypes (``fp8`` extra) is missing.
    """
    metadata, tensors = _read(os.fspath(path))
    try:
        state = json.loads(metadata["state"])
    except ValueError as error:
        _fail(f"the snapshot's state is not valid JSON: {error}")
    limit = _physical_memory() if max_bytes is None else max_bytes
    return restore(state, tensors, limit, pool)


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 1 << 40


def _read(path: str) -> tuple[dict[str, str], dict[str, npt.NDArray[Any]]]:
    """The metadata and tensors of ``path``, each header field checked against the file first."""
    numpy_api = _safetensors_numpy()
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                _fail(f"{path!r} is {file_size} bytes long, too short for a safetensors header (truncated?)")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
                _fail(f"{path!r} declares a {header_size}-byte header but the file is {file_size} bytes "
                      "(truncated, or not a snapshot)")
            raw_header = handle.read(header_size)
    except OSError as error:
        _fail(f"cannot read snapshot {path!r}: {error}")
    try:
        header = json.loads(raw_header)
    except ValueError as error:  # UnicodeDecodeError is a ValueError
        _fail(f"{path!r} has a damaged header: {error}")
    if not isinstance(header, dict):
        _fail(f"{path!r} has a damaged header: not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        _fail(f"{path!r} is not a pagedkv snapshot (no format {FORMAT!r} in its metadata)")
    if metadata.get("version") != str(VERSION):
        _fail(f"{path!r} is snapshot version {metadata.get('version')!r}; this pagedkv reads version "
              f"{VERSION} only")
    fields = ("format", "version", "state", "checksum")
    if set(metadata) != set(fields) or not all(isinstance(metadata[f], str) for f in fields):
        _fail(f"{path!r} has damaged metadata: expected the string fields {fields}")
    payload = file_size - 8 - header_size
    position = 0
    for start, end, name in sorted(_tensor_span(name, entry, payload) for name, entry in header.items()):
        if start != position:
            _fail(f"tensor {name!r} starts at payload byte {start}, expected {position} (overlapping "
                  "or missing data)")
        position = end
    if position != payload:
        _fail(f"the tensors cover {position} of the file's {payload} payload bytes (truncated or padded)")
    # Only now, every size known to fit the file, does safetensors read the tensors.
    try:
        with numpy_api.safe_open(path, framework="np") as opened:
            tensors: dict[str, npt.NDArray[Any]] = {name: opened.get_tensor(name) for name in header}
            found = opened.metadata()
    except Exception as error:  # safetensors raises its own error types
        _fail(f"{path!r} is not a valid safetensors file: {error}")
    if found != metadata or set(tensors) != set(header):
        _fail(f"{path!r} changed while it was read")
    if metadata["checksum"] != _checksum(metadata, tensors):
        _fail(f"{path!r} is damaged: its checksum does not match its contents")
    return metadata, tensors


def _tensor_span(name: str, entry: object, payload: int) -> tuple[int, int, str]:
    """``(start, end, name)`` of a header entry whose declared size fits the file."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        _fail(f"tensor {name!r} has a damaged header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _TENSOR_DTYPES:
        _fail(f"tensor {name!r} has dtype {dtype!r}; snapshots hold only {sorted(_TENSOR_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        _fail(f"tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)):
        _fail(f"tensor {name!r} has bad data offsets {offsets!r}")
    start, end = offsets
    size = math.prod(shape) * np.dtype(_TENSOR_DTYPES[dtype]).itemsize
    if not 0 <= start <= end <= payload or end - start != size:
        _fail(f"tensor {name!r} declares shape {shape} ({size} bytes) at [{start}, {end}) but the "
              f"file holds {payload} payload bytes (truncated, or sizes that cannot be true)")
    return start, end, name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
