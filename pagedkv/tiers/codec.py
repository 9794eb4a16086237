"""How a block leaves the pool as bytes and comes back: its layout, its store key, its framed value.

A block is read whole (every layer's keys and values, then their scales) into
one contiguous buffer, as vLLM's OffloadingConnector copies it (its finding:
up to 4x better time-to-first-token than a piece per layer). A store key names
the layout and the chained prefix key, and a stored value repeats both in a
header checked on every read, with a checksum over the payload, as LMCache's
chunk metadata does: a value of another model, layout or prefix, a short one
or a flipped bit is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pagedkv.counts import check_count
from pagedkv.errors import ConfigError, InputTypeError, PagedKVError

if TYPE_CHECKING:
    from pagedkv.memory.pool import KVPool

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "BlockLayout",
    "RefusedValueError",
    "decode_block",
    "encode_block",
    "load_block",
    "read_block",
    "store_key",
]

#: The first bytes of every stored block value.
MAGIC = b"PKVB"
#: The value format's version; another version is refused.
VERSION = 1
# magic, version, checksum kind, prefix key size, layout digest, payload size
_HEADER = struct.Struct("<4sHBB16sQ")
#: Bytes of the fixed header (the prefix key and the checksum follow it).
HEADER_SIZE = _HEADER.size
_CHECKSUM_SIZE = 16


class RefusedValueError(PagedKVError, ValueError):
    """A stored value is not the block asked for: short, damaged, or of another layout or prefix."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Everything that decides what a block's bytes mean, so no two models share a store key.

    Attributes:
        model_id: the caller's name for the model and its weights (and tenant,
            if tenants must never share pages); part of every key.
        block_size, num_kv_heads, head_dim, num_layers: the pool's shape.
        dtype: the compute dtype's name (``"float32"``).
        key_dtype, value_dtype: storage formats (``"int8"``...), or None.
        group: the KV-cache group (0 for a manager with one group).
        block_nbytes: bytes of one block's payload (every layer, scales included).

    >>> layout = BlockLayout("m", 4, 1, 2, 1, "float32", None, None, 0, 64)
    >>> other = BlockLayout("other", 4, 1, 2, 1, "float32", None, None, 0, 64)
    >>> len(layout.digest), layout.digest == other.digest
    (16, False)
    """

    model_id: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: str
    key_dtype: str | None
    value_dtype: str | None
    group: int
    block_nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InputTypeError(f"model_id must be a non-empty str naming the model, got {self.model_id!r}")
        for name in ("block_size", "num_kv_heads", "head_dim", "num_layers", "block_nbytes"):
            check_count(name, getattr(self, name))
        check_count("group", self.group, minimum=0)

    @classmethod
    def of_pool(cls, pool: KVPool, model_id: str, group: int = 0) -> BlockLayout:
        """The layout of ``pool``'s blocks, for the model ``model_id``."""
        nbytes = sum(piece.nbytes for piece in _pieces(pool, 0))
        return cls(model_id, pool.block_size, pool.num_kv_heads, pool.head_dim, pool.num_layers,
                   pool.dtype.name, pool.key_dtype, pool.value_dtype, group, nbytes)

    @property
    def digest(self) -> bytes:
        """16 bytes naming this layout: equal digests mean the same model and block bytes."""
        fields = (self.model_id, self.block_size, self.num_kv_heads, self.head_dim, self.num_layers,
                  self.dtype, self.key_dtype, self.value_dtype, self.group, self.block_nbytes)
        return hashlib.blake2b(repr(fields).encode("utf-8"), digest_size=16).digest()


def store_key(layout: BlockLayout, prefix_key: bytes) -> bytes:
    """The store key of the block whose chained prefix key is ``prefix_key``, for ``layout``.

    >>> layout = BlockLayout("m", 4, 1, 2, 1, "float32", None, None, 0, 64)
    >>> store_key(layout, b"\\x01\\x02")[:11], store_key(layout, b"\\x01\\x02")[-4:]
    (b'pagedkv/v1/', b'0102')
    """
    if not isinstance(prefix_key, bytes):
        raise InputTypeError(f"a prefix key must be bytes, got {prefix_key!r}")
    return b"pagedkv/v1/" + layout.digest.hex().encode("ascii") + b"/" + prefix_key.hex().encode("ascii")


# ---------------------------------------------------------------- checksums

def _blake2b(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM_SIZE).digest()


def _checksums() -> dict[int, Callable[[bytes | memoryview], bytes]]:
    found: dict[int, Callable[[bytes | memoryview], bytes]] = {1: _blake2b}
    try:
        import xxhash
    except ImportError:
        return found
    found[2] = lambda data: bytes(xxhash.xxh3_128_digest(data))
    return found


#: Checksum kind (stored in the header) -> function. NOTE: xxh3_128 (the xxhash
#: extra) when installed: several times faster than blake2b; a reader without it
#: refuses such a value as a miss, never reads it unchecked.
_CHECKSUM_OF = _checksums()
_WRITE_CHECKSUM = max(_CHECKSUM_OF)


Payload = bytes | memoryview | npt.NDArray[np.uint8]


def encode_block(layout: BlockLayout, prefix_key: bytes, payload: Payload) -> bytes:
    """``payload`` (a block's bytes) framed for a store: header, prefix key, checksum, payload.

    Raises:
        ConfigError: the payload is not ``layout.block_nbytes`` long.

    >>> layout = BlockLayout("m", 4, 1, 2, 1, "float32", None, None, 0, 4)
    >>> value = encode_block(layout, b"k", b"abcd")
    >>> bytes(decode_block(layout, b"k", value))
    b'abcd'
    """
    data = memoryview(payload).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    if data.nbytes != layout.block_nbytes:
        raise ConfigError(
            f"a block payload of {data.nbytes} bytes, expected {layout.block_nbytes} for {layout}"
        )
    head = _HEADER.pack(MAGIC, VERSION, _WRITE_CHECKSUM, len(prefix_key), layout.digest, data.nbytes)
    checksum = _CHECKSUM_OF[_WRITE_CHECKSUM](data)
    return b"".join((head, prefix_key, checksum, data))


def decode_block(layout: BlockLayout, prefix_key: bytes, value: bytes) -> memoryview:
    """The payload of ``value`` (a view into it) when it is ``prefix_key``'s block of ``layout``.

    Raises:
        RefusedValueError: the value is short or long, of another format,
            version, layout or prefix key, or its checksum does not match.
    """
    if len(value) < HEADER_SIZE:
        raise RefusedValueError(
            f"a stored value of {len(value)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, kind, key_size, digest, size = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise RefusedValueError(
            f"a stored value of format {magic!r} v{version}, expected {MAGIC!r} v{VERSION}"
        )
    if digest != layout.digest or size != layout.block_nbytes:
        raise RefusedValueError(f"a stored value of another layout ({size} bytes a block), expected {layout}")
    start = HEADER_SIZE + key_size
    if value[HEADER_SIZE:start] != prefix_key:
        raise RefusedValueError(f"a stored value of prefix key {value[HEADER_SIZE:start].hex()}, "
                                f"expected {prefix_key.hex()}")
    end = start + _CHECKSUM_SIZE
    if len(value) != end + size:
        raise RefusedValueError(
            f"a stored value of {len(value)} bytes, expected {end + size} (half-written?)"
        )
    checksum = _CHECKSUM_OF.get(kind)
    if checksum is None:
        raise RefusedValueError(f"a stored value with checksum kind {kind}, which this reader lacks "
                                f"(has {sorted(_CHECKSUM_OF)}; install the xxhash extra)")
    payload = memoryview(value)[end:]
    if checksum(payload) != value[start:end]:
        raise RefusedValueError("a stored value whose checksum does not match its payload (damaged)")
    return payload


# ---------------------------------------------------------------- a block's bytes

def _pieces(pool: KVPool, block_id: int) -> list[npt.NDArray[np.generic]]:
    """Views of every piece of ``block_id``: per layer keys, values, then their scales if stored."""
    pieces: list[npt.NDArray[np.generic]] = []
    for layer in range(pool.num_layers):
        pieces.append(pool.key_pages(layer)[block_id])    # (block_size, num_kv_heads, head_dim)
        pieces.append(pool.value_pages(layer)[block_id])
        if pool.key_dtype is not None:
            pieces.append(pool.key_scales(layer)[:, block_id])   # (num_kv_heads, block_size, num_groups)
        if pool.value_dtype is not None:
            pieces.append(pool.value_scales(layer)[:, block_id])
    return pieces


def read_block(
    pool: KVPool, block_id: int, out: npt.NDArray[np.uint8] | None = None
) -> npt.NDArray[np.uint8]:
    """Block ``block_id`` of ``pool`` as one contiguous byte array (a copy; into ``out`` if given).

    Layers in order, each its keys, its values, then their scales (when stored
    as codes). ``out`` is a ``(block_nbytes,)`` uint8 array (a host slot).

    >>> from pagedkv.memory.pool import KVPool
    >>> pool = KVPool(2, block_size=2, head_dim=2, dtype=np.float32)
    >>> pool.key_pages(0)[1] = 1.0
    >>> read_block(pool, 1).view(np.float32).tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    """
    pieces = _pieces(pool, block_id)
    nbytes = sum(piece.nbytes for piece in pieces)
    buffer = np.empty(nbytes, np.uint8) if out is None else out
    if buffer.shape != (nbytes,):
        raise ConfigError(f"a block buffer of shape {buffer.shape}, expected ({nbytes},)")
    at = 0
    for piece in pieces:
        buffer[at : at + piece.nbytes].view(piece.dtype).reshape(piece.shape)[...] = piece
        at += piece.nbytes
    return buffer


def load_block(pool: KVPool, block_id: int, payload: Payload) -> None:
    """Write ``payload`` (what :func:`read_block` made) into block ``block_id`` of ``pool``.

    Raises:
        ConfigError: the payload's length is not the block's.
    """
    data = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
    pieces = _pieces(pool, block_id)
    nbytes = sum(piece.nbytes for piece in pieces)
    if data.shape != (nbytes,):
        raise ConfigError(f"a block payload of {data.size} bytes, expected {nbytes}")
    at = 0
    for piece in pieces:
        piece[...] = data[at : at + piece.nbytes].view(piece.dtype).reshape(piece.shape)
        at += piece.nbytes
