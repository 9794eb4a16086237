"""Extra keys: what besides token ids decides whether two blocks may be shared.

Three kinds, each hashed with its tag, so ``"x"`` as a salt and as an adapter never collide:
``salt`` (a tenant) and ``adapter`` (a LoRA id) are mixed into every block's key;
``multimodal`` is one value for the whole sequence or items ``(identifier, offset, length)``,
each mixed only into the blocks its placeholder tokens overlap. vLLM:
``generate_block_hash_extra_keys`` in ``kv_cache_utils.py``. The encoding and a drawing:
"Multimodal inputs" in docs/prefix_caching.md.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from functools import lru_cache

from pagedkv.errors import ConfigError, InputTypeError

__all__ = ["EXTRA_KEY_KINDS", "ExtraKeys", "block_tails", "decode_extra_keys", "encode_extra_keys", "field"]

#: Kinds of extra keys; each is hashed with its tag so kinds never collide.
EXTRA_KEY_KINDS = ("salt", "adapter", "multimodal")

Scalar = str | bytes | int
#: ``{"salt": tenant, "adapter": id, "multimodal": hash or [(hash, offset, length), ...]}``.
ExtraKeys = Mapping[str, Scalar | Sequence[tuple[Scalar, int, int]]]


def field(tag: bytes, data: bytes) -> bytes:
    """``tag``, the length of ``data`` as 8 little-endian bytes, then ``data``."""
    return tag + struct.pack("<Q", len(data)) + data


def _scalar(kind: str, value: object) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
        raise InputTypeError(f"extra key {kind!r} must be str, bytes or int, got {value!r}")
    if isinstance(value, str):
        return b"s" + value.encode("utf-8")
    if isinstance(value, bytes):
        return b"b" + value
    return b"i" + str(value).encode("ascii")


def _items(value: Sequence[object]) -> bytes:
    """The ``R`` field of multimodal items, sorted by offset (validated)."""
    items = []
    for item in value:
        if not isinstance(item, tuple) or len(item) != 3:
            raise InputTypeError(f"a multimodal item must be (identifier, offset, length), got {item!r}")
        identifier, offset, length = item
        for name, number, least in (("offset", offset, 0), ("length", length, 1)):
            if isinstance(number, bool) or not isinstance(number, int):
                raise InputTypeError(f"multimodal item {item!r}: {name} must be an int, got {number!r}")
            if number < least:
                raise ConfigError(f"multimodal item {item!r}: {name} must be >= {least}, got {number}")
        items.append((offset, length, _scalar("multimodal", identifier)))
    items.sort()
    return field(b"R", b"".join(field(b"M", struct.pack("<QQ", o, n) + data) for o, n, data in items))


def encode_extra_keys(extra_keys: ExtraKeys | None) -> bytes:
    """Encode a sequence's extra keys as tagged, length-prefixed bytes.

    Args:
        extra_keys: ``{"salt": ..., "adapter": ..., "multimodal": ...}``; each
            value a str, bytes or int, and ``multimodal`` also a list of
            ``(identifier, offset, length)`` items.

    Raises:
        ConfigError: an unknown kind, or an item's offset < 0 or length < 1.
        InputTypeError: not a mapping, a kind that is not a str, or a value of another type.

    >>> encode_extra_keys({"salt": "a"}) != encode_extra_keys({"adapter": "a"})
    True
    """
    if not extra_keys:
        return b""
    if not isinstance(extra_keys, Mapping):
        raise InputTypeError(f"extra_keys must be a dict of kind to value, got {extra_keys!r}")
    for kind in extra_keys:  # before sorting: kinds of mixed types cannot be sorted
        if not isinstance(kind, str):
            raise InputTypeError(f"extra key kind must be a str, one of {EXTRA_KEY_KINDS}, got {kind!r}")
        if kind not in EXTRA_KEY_KINDS:
            raise ConfigError(f"extra key kind must be one of {EXTRA_KEY_KINDS}, got {kind!r}")
    parts, items = [], b""
    for kind in sorted(extra_keys):
        value = extra_keys[kind]
        if kind == "multimodal" and isinstance(value, (list, tuple)):
            items = _items(value)
            continue
        data = _scalar(kind, value)
        parts.append(field(b"X", field(b"K", kind.encode("ascii")) + field(b"V", data)))
    return b"".join(parts) + items


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, tag: bytes) -> bytes:
        data, at = self.data, self.at
        if data[at : at + 1] != tag:
            raise ValueError(f"extra keys: expected field {tag!r} at byte {at}")
        (size,) = struct.unpack_from("<Q", data, at + 1)
        self.at = at + 9 + size
        return data[at + 9 : self.at]


def _value(data: bytes) -> Scalar:
    tag, body = data[:1], data[1:]
    return body.decode("utf-8") if tag == b"s" else body if tag == b"b" else int(body)


@lru_cache(maxsize=256)
def _split(extras: bytes) -> tuple[bytes, tuple[tuple[int, int, bytes], ...]]:
    """``(whole-sequence part, ((offset, end, item field), ...))`` of encoded extra keys.

    Bytes that are not an encoding with items (opaque extras) are all whole-sequence.
    """
    try:
        return _parse(extras)
    except (ValueError, struct.error):
        return extras, ()


def _parse(extras: bytes) -> tuple[bytes, tuple[tuple[int, int, bytes], ...]]:
    reader = _Reader(extras)
    while reader.at < len(extras) and extras[reader.at : reader.at + 1] == b"X":
        reader.take(b"X")
    start = reader.at
    if start == len(extras):
        return extras, ()
    body = _Reader(reader.take(b"R"))
    items = []
    while body.at < len(body.data):
        item_at = body.at
        item = body.take(b"M")
        offset, length = struct.unpack_from("<QQ", item)
        items.append((offset, offset + length, body.data[item_at : body.at]))
    if body.at != len(body.data) or reader.at != len(extras):
        raise ValueError("extra keys: bytes after the items")
    return extras[:start], tuple(items)


def decode_extra_keys(encoded: bytes) -> dict[str, object]:
    """The extra keys that ``encode_extra_keys`` encoded (its inverse).

    >>> decode_extra_keys(encode_extra_keys({"adapter": 7, "multimodal": [("img", 4, 2)]}))
    {'adapter': 7, 'multimodal': [('img', 4, 2)]}
    """
    whole, items = _split(encoded)
    decoded: dict[str, object] = {}
    reader = _Reader(whole)
    while reader.at < len(whole):
        inner = _Reader(reader.take(b"X"))
        kind = inner.take(b"K").decode("ascii")
        decoded[kind] = _value(inner.take(b"V"))
    if items:
        decoded["multimodal"] = [
            (_value(item[9 + 16 :]), offset, end - offset) for offset, end, item in items
        ]
    return decoded


def block_tails(extras: bytes, first_block: int, num_blocks: int, block_size: int) -> list[bytes] | bytes:
    """What each of ``num_blocks`` blocks from logical block ``first_block`` mixes into its key.

    One ``bytes`` for all of them when no multimodal item is given per range
    (the common case: no list is built); else one per block: the whole-sequence
    part and the items overlapping that block.

    >>> tails = block_tails(encode_extra_keys({"multimodal": [("img", 4, 2)]}), 0, 3, 4)
    >>> [len(tail) > 0 for tail in tails]
    [False, True, False]
    """
    if not extras:
        return extras
    whole, items = _split(extras)
    if not items:
        return whole
    tails = []
    for logical_block in range(first_block, first_block + num_blocks):
        lo, hi = logical_block * block_size, (logical_block + 1) * block_size
        tails.append(whole + b"".join(item for start, end, item in items if start < hi and end > lo))
    return tails
