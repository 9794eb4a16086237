"""The snapshot file: safetensors, a checksum, an atomic write, and a read that checks first.

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

This module knows nothing of caches or managers: it writes a state (any
JSON object) and named tensors, and reads them back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.snapshot.schema import State, fail, is_int

__all__ = [
    "FORMAT",
    "MAX_HEADER_BYTES",
    "VERSION",
    "Tensors",
    "page_parts",
    "read_state",
    "safetensors_numpy",
    "tensor_name",
    "write_state",
]

Tensors = dict[str, npt.NDArray[Any]]

#: The ``format`` field of every pagedkv snapshot.
FORMAT = "pagedkv-snapshot"
#: The snapshot format version this code writes and reads.
VERSION = 1
#: The largest JSON header accepted (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: Tensor dtypes a snapshot may hold (safetensors names).
_TENSOR_DTYPES = {"F32": np.float32, "F64": np.float64, "I8": np.int8, "U8": np.uint8}
_METADATA_FIELDS = ("format", "version", "state", "checksum")


def safetensors_numpy() -> Any:
    """``safetensors.numpy``.

    Raises:
        ImportError: safetensors is missing, naming the ``snapshot`` extra.
    """
    try:
        import safetensors.numpy
    except ImportError as error:
        raise ImportError('snapshots need the safetensors package: pip install "pagedkv[snapshot]"') \
            from error
    return safetensors.numpy


def tensor_name(role: str, part: str, layer: int) -> str:
    """The name of one page tensor: ``tensor_name("host", "key_scales", 1) == "host.key_scales.1"``."""
    return f"{role}.{part}.{layer}"


def page_parts(key_quantized: bool, value_quantized: bool) -> list[str]:
    """The page tensors of each layer: keys and values, and the scales of the quantized ones.

    Each part is named after the ``KVPool`` accessor that holds it
    (``pool.keys(layer)``, ``pool.key_scales(layer)``, ...).
    """
    return ["keys", "values"] + ["key_scales"] * key_quantized + ["value_scales"] * value_quantized


# --------------------------------------------------------------------- write


def write_state(path: str | os.PathLike[str], state: State, tensors: Tensors) -> None:
    """Write ``state`` and ``tensors`` to ``path`` as one snapshot file, atomically."""
    _write(os.fspath(path), state, tensors)


def _write(path: str, state: State, tensors: Tensors, version: int = VERSION) -> None:
    """Write a snapshot file (tests call this with a tampered ``state`` to prove ``load`` refuses it)."""
    numpy_api = safetensors_numpy()
    metadata = {"format": FORMAT, "version": str(version), "state": _canonical(state)}
    metadata["checksum"] = _checksum(metadata, tensors)
    contiguous = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.close(handle)
        numpy_api.save_file(contiguous, temporary, metadata=metadata)
        _fsync(temporary, os.O_RDWR)  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    _fsync(folder, os.O_RDONLY)  # ... and the rename itself survives a crash


def _fsync(path: str, flags: int) -> None:
    handle = os.open(path, flags)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _canonical(state: State) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _checksum(metadata: dict[str, str], tensors: Tensors) -> str:
    """``sha256:<hex>`` over the format, version, state and every tensor (sorted by name)."""
    digest = hashlib.sha256()
    for field in ("format", "version", "state"):
        digest.update(f"{field}\0{metadata[field]}\0".encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}\0{array.dtype.str}\0{list(array.shape)}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return "sha256:" + digest.hexdigest()


# ---------------------------------------------------------------------- read


def read_state(path: str | os.PathLike[str]) -> tuple[object, Tensors]:
    """The state (parsed JSON, not yet validated) and the tensors of the snapshot at ``path``.

    Raises:
        SnapshotError: the file is truncated, damaged, or of another format
            or version.
        ImportError: safetensors is missing (the ``snapshot`` extra).
    """
    metadata, tensors = _read(os.fspath(path))
    try:
        state: object = json.loads(metadata["state"])
    except ValueError as error:
        fail(f"the snapshot's state is not valid JSON: {error}")
    return state, tensors


def _read(path: str) -> tuple[dict[str, str], Tensors]:
    """The metadata and tensors of ``path``, each header field checked against the file first."""
    numpy_api = safetensors_numpy()
    header, file_size, header_size = _header(path)
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        fail(f"{path!r} is not a pagedkv snapshot (no format {FORMAT!r} in its metadata)")
    if metadata.get("version") != str(VERSION):
        fail(f"{path!r} is snapshot version {metadata.get('version')!r}; this pagedkv reads version "
             f"{VERSION} only")
    fields = _METADATA_FIELDS
    if set(metadata) != set(fields) or not all(isinstance(metadata[f], str) for f in fields):
        fail(f"{path!r} has damaged metadata: expected the string fields {fields}")
    payload = file_size - 8 - header_size
    position = 0
    for start, end, name in sorted(_tensor_span(name, entry, payload) for name, entry in header.items()):
        if start != position:
            fail(f"tensor {name!r} starts at payload byte {start}, expected {position} (overlapping "
                 "or missing data)")
        position = end
    if position != payload:
        fail(f"the tensors cover {position} of the file's {payload} payload bytes (truncated or padded)")
    # Only now, every size known to fit the file, does safetensors read the tensors.
    try:
        with numpy_api.safe_open(path, framework="np") as opened:
            tensors: Tensors = {name: opened.get_tensor(name) for name in header}
            found = opened.metadata()
    except Exception as error:  # safetensors raises its own error types
        fail(f"{path!r} is not a valid safetensors file: {error}")
    if found != metadata or set(tensors) != set(header):
        fail(f"{path!r} changed while it was read")
    if metadata["checksum"] != _checksum(metadata, tensors):
        fail(f"{path!r} is damaged: its checksum does not match its contents")
    return metadata, tensors


def _header(path: str) -> tuple[dict[str, Any], int, int]:
    """``(header, file_size, header_size)``: the JSON header, its length checked against the file."""
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                fail(f"{path!r} is {file_size} bytes long, too short for a safetensors header (truncated?)")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
                fail(f"{path!r} declares a {header_size}-byte header but the file is {file_size} bytes "
                     "(truncated, or not a snapshot)")
            raw_header = handle.read(header_size)
    except OSError as error:
        fail(f"cannot read snapshot {path!r}: {error}")
    try:
        header = json.loads(raw_header)
    except ValueError as error:  # UnicodeDecodeError is a ValueError
        fail(f"{path!r} has a damaged header: {error}")
    if not isinstance(header, dict):
        fail(f"{path!r} has a damaged header: not a JSON object")
    return header, file_size, header_size


def _tensor_span(name: str, entry: object, payload: int) -> tuple[int, int, str]:
    """``(start, end, name)`` of a header entry whose declared size fits the file."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        fail(f"tensor {name!r} has a damaged header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _TENSOR_DTYPES:
        fail(f"tensor {name!r} has dtype {dtype!r}; snapshots hold only {sorted(_TENSOR_DTYPES)}")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        fail(f"tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(n) for n in offsets)):
        fail(f"tensor {name!r} has bad data offsets {offsets!r}")
    start, end = offsets
    size = math.prod(shape) * np.dtype(_TENSOR_DTYPES[dtype]).itemsize
    if not 0 <= start <= end <= payload or end - start != size:
        fail(f"tensor {name!r} declares shape {shape} ({size} bytes) at [{start}, {end}) but the "
             f"file holds {payload} payload bytes (truncated, or sizes that cannot be true)")
    return start, end, name
