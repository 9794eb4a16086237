"""The snapshot file: safetensors, a checksum, an atomic write, and a read that checks first.

safetensors (the ``snapshot`` extra), no pickle: the header's length, a JSON header whose
``__metadata__`` holds the format, version, state and checksum, then the pages of the saved
blocks only. This module knows nothing of caches or managers: it writes a state (any JSON
object) and named tensors, and reads them back. The byte layout and tensor names: "The file"
in docs/snapshots.md; why ``safetensors.numpy.save_file`` is not used: "Atomic save" there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import struct
import sys
import tempfile
import time
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from pagedkv.errors import InputTypeError, SnapshotIOError
from pagedkv.snapshot.schema import State, fail, is_int, shown

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, so no cleanup of stale temporaries
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FORMAT",
    "JSON_BYTES_PER_BYTE",
    "MAX_HEADER_BYTES",
    "STALE_TEMPORARY_AGE_S",
    "VERSION",
    "Tensors",
    "check_path",
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
#: Bytes of Python objects one header byte may parse into, counted against
#: ``max_bytes`` before parsing: ``[{},{},...]`` makes a 64-byte dict of every
#: 3 bytes (24x, the worst measured with tracemalloc; lists of ints: 4-6x).
JSON_BYTES_PER_BYTE = 32
#: A save removes another save's temporary file of the same target only
#: once it is this old (seconds) and unlocked; see ``_remove_stale_temporaries``.
STALE_TEMPORARY_AGE_S = 60.0
#: Tensor dtypes a snapshot may hold (safetensors names).
_TENSOR_DTYPES = {
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
}
#: safetensors' names of numpy dtypes, by kind and size (the writer accepts more than a load does).
_DTYPE_NAMES = {"f2": "F16", "f4": "F32", "f8": "F64", "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64",
                "u1": "U8", "u2": "U16", "u4": "U32", "u8": "U64", "b1": "BOOL"}
_METADATA_FIELDS = ("format", "version", "state", "checksum")
#: What ``tempfile.mkstemp`` puts after ``.{basename}.``: eight random characters and the suffix.
_TEMPORARY_SUFFIX = re.compile(r"[a-z0-9_]{8}\.tmp")


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


def check_path(path: object) -> str:
    """``path`` (a str or ``os.PathLike``) as a str.

    Raises:
        InputTypeError: anything else (bytes paths included).
    """
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise InputTypeError(f"path must be a str or an os.PathLike of one, got {shown(path)} "
                             f"({type(path).__name__})")
    return name


def write_state(path: str | os.PathLike[str], state: State, tensors: Tensors) -> None:
    """Write ``state`` and ``tensors`` to ``path`` as one snapshot file, atomically.

    Raises:
        InputTypeError: ``path`` is not a str or ``os.PathLike``.
        SnapshotError: ``path`` names no file that can be written: its
            folder is missing, or it is a folder (the ``OSError`` is its
            ``__cause__``).
        OSError: writing failed otherwise (no space, no permission, an I/O
            error). Either way a file already at ``path`` is left exactly as
            it was, and no temporary file stays behind.
    """
    _write(check_path(path), state, tensors)


#: ``OSError``s of a save that mean the path is wrong, not the disk: they become ``SnapshotError``s.
_BAD_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _write(path: str, state: State, tensors: Tensors, version: int = VERSION) -> None:
    """Write a snapshot file (tests call this with a tampered ``state`` to prove ``load`` refuses it).

    The temporary file is locked (``flock``) from its creation to its rename,
    so that :func:`_remove_stale_temporaries` of a concurrent save of the same
    target never takes it for the leftover of a killed one.
    """
    metadata = {"format": FORMAT, "version": str(version), "state": _canonical(state)}
    metadata["checksum"] = _checksum(metadata, tensors)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except _BAD_PATH_ERRORS as error:
        raise _bad_path(path, folder, error) from error
    try:
        _lock(handle)
        _remove_stale_temporaries(folder, os.path.basename(path), temporary)
        with os.fdopen(handle, "wb", closefd=False) as out:
            _serialize(out, metadata, tensors)
        os.fsync(handle)  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        os.close(handle)
        if isinstance(error, _BAD_PATH_ERRORS):
            raise _bad_path(path, folder, error) from error
        raise
    os.close(handle)  # drops the lock
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)  # ... and the rename itself survives a crash
    finally:
        os.close(handle)


def _bad_path(path: str, folder: str, error: OSError) -> SnapshotIOError:
    """The ``SnapshotIOError`` of a save to a path that cannot hold a file, saying what to do."""
    if not os.path.isdir(folder):
        hint = f"the folder {folder!r} does not exist; create it first (os.makedirs)"
    elif os.path.isdir(path):
        hint = "that is a folder; name a file inside it"
    else:
        hint = str(error)
    return _io_error(f"cannot save a snapshot to {path!r}: {hint} (nothing was written)", path, error)


def _io_error(message: str, path: str, cause: OSError) -> SnapshotIOError:
    bad = SnapshotIOError(message)
    bad.errno, bad.filename = cause.errno, path
    return bad


def _serialize(out: BinaryIO, metadata: dict[str, str], tensors: Tensors) -> None:
    """Write the safetensors layout: header length, JSON header (space-padded to 8 bytes), tensors.

    NOTE: written here, not by ``safetensors.numpy.save_file``: that one
    writes its own ``.tmpXXXXXX`` file beside the target and renames it over
    the name it is given, so a killed save left files no later save could
    tell from anyone else's, and the locked inode was not the one written.
    Tensors go widest dtype first, then by name, as safetensors orders them
    (aligned data); ``load`` reads the file with safetensors itself.
    """
    arrays = {name: np.ascontiguousarray(array, array.dtype.newbyteorder("<"))
              for name, array in tensors.items()}
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        array = arrays[name]
        header[name] = {"dtype": _DTYPE_NAMES[f"{array.dtype.kind}{array.dtype.itemsize}"],
                        "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(struct.pack("<Q", len(text)) + text)
    for name in order:
        out.write(arrays[name].reshape(-1).view(np.uint8).data)


def _lock(handle: int) -> None:
    """Hold an exclusive ``flock`` on our own temporary file until it is closed (best effort)."""
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without locks: no cleanup either
            fcntl.flock(handle, fcntl.LOCK_EX)


def _remove_stale_temporaries(folder: str, basename: str, own: str) -> None:
    """Remove the temporary files killed saves of the same target left behind (best effort).

    A candidate is named ``.{basename}.XXXXXXXX.tmp`` (``mkstemp``'s eight
    characters), is a plain file, was last written at least
    ``STALE_TEMPORARY_AGE_S`` ago, and nobody holds its lock: a live save holds
    its own from creation to rename, and the kernel drops the lock of a killed
    one. The age covers a save between its ``mkstemp`` and its ``flock``.
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        return
    prefix = f".{basename}."
    try:
        names = [name for name in os.listdir(folder)
                 if name.startswith(prefix) and _TEMPORARY_SUFFIX.fullmatch(name, len(prefix))]
    except OSError:
        return
    for name in names:
        candidate = os.path.join(folder, name)
        if candidate == own:
            continue
        try:
            handle = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already (its save finished), or not ours to open
        try:
            found = os.fstat(handle)
            if not stat.S_ISREG(found.st_mode) or time.time() - found.st_mtime < STALE_TEMPORARY_AGE_S:
                continue
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a live save holds it
            if os.stat(candidate, follow_symlinks=False).st_ino == found.st_ino:
                os.unlink(candidate)
        except OSError:
            continue
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


def read_state(path: str | os.PathLike[str], max_bytes: int) -> tuple[object, Tensors, int]:
    """The state (parsed JSON, not yet validated), the tensors, and the bytes reading them took.

    The bytes counted are the tensors' and ``JSON_BYTES_PER_BYTE`` a header
    byte; the file is refused before its header is parsed when they pass
    ``max_bytes``.

    Raises:
        InputTypeError: ``path`` is not a str or ``os.PathLike``.
        SnapshotError: the file is truncated, damaged, nested too deeply, of
            another format or version, or would take more than ``max_bytes``.
        ImportError: safetensors is missing (the ``snapshot`` extra).
    """
    metadata, tensors, num_bytes = _read_counted(check_path(path), max_bytes)
    state = _parse(metadata["state"], "the snapshot's state")
    return state, tensors, num_bytes


def _parse(text: str | bytes, what: str) -> Any:
    """``json.loads(text)``, its errors (too deep a nesting included) as ``SnapshotError``."""
    try:
        return json.loads(text)
    except RecursionError:
        fail(f"{what} is nested too deeply to read (JSON arrays or objects within each other near "
             f"{sys.getrecursionlimit()} deep; a snapshot's are a few deep)")
    except ValueError as error:  # UnicodeDecodeError is a ValueError
        fail(f"{what} is not valid JSON: {error}")


def _read(path: str) -> tuple[dict[str, str], Tensors]:
    """The metadata and tensors of ``path``, checked, with no limit (tests read files to tamper with)."""
    metadata, tensors, _ = _read_counted(path, None)
    return metadata, tensors


def _read_counted(path: str, max_bytes: int | None) -> tuple[dict[str, str], Tensors, int]:
    """The metadata, tensors and cost of ``path``, each header field checked against the file first."""
    numpy_api = safetensors_numpy()
    header, file_size, header_size = _header(path, max_bytes)
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        fail(f"{path!r} is not a pagedkv snapshot (no format {FORMAT!r} in its metadata)")
    if metadata.get("version") != str(VERSION):
        fail(f"{path!r} is snapshot version {shown(metadata.get('version'))}; this pagedkv reads version "
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
    return metadata, tensors, payload + JSON_BYTES_PER_BYTE * header_size


def _header(path: str, max_bytes: int | None) -> tuple[dict[str, Any], int, int]:
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
            num_bytes = file_size - 8 - header_size + JSON_BYTES_PER_BYTE * header_size
            if max_bytes is not None and num_bytes > max_bytes:
                fail(f"reading {path!r} needs up to {num_bytes:,} bytes ({file_size - 8 - header_size:,} "
                     f"of tensors, {JSON_BYTES_PER_BYTE} a byte of its {header_size:,}-byte header once "
                     f"parsed), more than the {max_bytes:,} bytes max_bytes= allows; pass a larger "
                     "max_bytes= to allow it")
            raw_header = handle.read(header_size)
    except OSError as error:
        raise _io_error(f"cannot read snapshot {path!r}: {error}", path, error) from error
    header = _parse(raw_header, f"the header of {path!r}")
    if not isinstance(header, dict):
        fail(f"{path!r} has a damaged header: not a JSON object")
    return header, file_size, header_size


def _tensor_span(name: str, entry: object, payload: int) -> tuple[int, int, str]:
    """``(start, end, name)`` of a header entry whose declared size fits the file."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        fail(f"tensor {name!r} has a damaged header entry")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _TENSOR_DTYPES:
        fail(f"tensor {name!r} has dtype {shown(dtype)}; snapshots hold only {sorted(_TENSOR_DTYPES)}")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        fail(f"tensor {name!r} has a bad shape {shown(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(n) for n in offsets)):
        fail(f"tensor {name!r} has bad data offsets {shown(offsets)}")
    start, end = offsets
    size = math.prod(shape) * np.dtype(_TENSOR_DTYPES[dtype]).itemsize
    if not 0 <= start <= end <= payload or end - start != size:
        fail(f"tensor {name!r} declares shape {shape} ({size} bytes) at [{start}, {end}) but the "
             f"file holds {payload} payload bytes (truncated, or sizes that cannot be true)")
    return start, end, name
