"""Prefix caching: full blocks addressed by a hash of everything before and in them.

A full block's key chains its parent's key, its token ids and the sequence's tagged extra
keys, so equal keys mean equal prefixes; every field is length-prefixed and tagged, so no two
inputs encode alike. Hashes: ``"sha256"`` (the default, collision resistant) or
``"xxh3_128"`` (the ``xxhash`` extra; only when every prompt is trusted). vLLM:
``hash_block_tokens`` in ``kv_cache_utils.py`` and ``BlockPool``'s cached-block map; SGLang:
``mem_cache/radix_cache.py``. Drawings, the hash choice and its measurements:
docs/prefix_caching.md.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from numbers import Integral
from typing import cast

import numpy as np

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.prefix.events import KVEventBuffer
from pagedkv.prefix.keys import block_tails

__all__ = [
    "HASH_KEY_SIZES",
    "ROOT_KEY",
    "PrefixCache",
    "block_keys",
    "check_hash_algorithm",
    "check_token_ids",
    "hash_function",
    "pack_token_ids",
    "token_bytes",
]

#: The parent key of block 0.
ROOT_KEY = b"pagedkv-prefix-root-v1"


HashFunction = Callable[[bytes], bytes]


#: The block hashes, by name, and the size of the keys each makes.
HASH_KEY_SIZES = {"sha256": 32, "xxh3_128": 16}


def check_hash_algorithm(name: object) -> str:
    """Validate a block hash's name (without importing it); return it.

    Raises:
        ConfigError: not one of ``HASH_KEY_SIZES``.
    """
    if not isinstance(name, str) or name not in HASH_KEY_SIZES:
        raise ConfigError(f"hash_algorithm must be 'sha256' or 'xxh3_128', got {name!r}")
    return name


def hash_function(name: str) -> HashFunction:
    """The block hash called ``name``: ``"sha256"`` or ``"xxh3_128"``.

    Raises:
        ConfigError: an unknown name.
        ImportError: ``"xxh3_128"`` without the ``xxhash`` extra installed.
    """
    check_hash_algorithm(name)
    if name == "sha256":
        sha256 = hashlib.sha256
        return lambda data: sha256(data).digest()
    try:
        import xxhash
    except ImportError as error:
        raise ImportError(
            'hash_algorithm="xxh3_128" needs the xxhash package: pip install "pagedkv[xxhash]"'
        ) from error
    xxh3 = xxhash.xxh3_128_digest
    return lambda data: bytes(xxh3(data))


def pack_token_ids(value: object, what: str) -> tuple[list[int], bytes]:
    """``value`` as a new list of (plain int) token ids and as ``token_bytes`` of it, validated once.

    The fast path takes a list: ``array("Q")`` packs it in one pass of C code
    (refusing floats, strings, negative ids and anything that is not an
    integer), the high byte of every packed id says whether one is past
    int64, and only the elements packed as 0 or 1 have their type read, to
    refuse bools. Anything else, or any failure, takes the general path,
    whose errors it shares.

    ``what`` says what was expected, for the error ("prompt must be a sequence of token ids").

    Raises:
        InputTypeError: not a sequence (a str or bytes included), or an id is
            not an int in ``0 .. 2**63 - 1``.

    >>> token_ids, packed = pack_token_ids([1, 258], "ids")
    >>> token_ids, packed == token_bytes([1, 258]), len(packed)
    ([1, 258], True, 16)
    """
    if value.__class__ is list:
        packed = _pack_list(value)
        if packed is not None:
            return packed.tolist(), packed.tobytes()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not hasattr(value, "__len__"):
        raise InputTypeError(f"{what}, got {value!r}")
    # numpy ints become ints; bools and anything else stay for token_bytes to refuse.
    token_ids = [int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in value]
    return token_ids, token_bytes(token_ids)


def check_token_ids(value: object, what: str) -> None:
    """Refuse ``value`` unless :func:`pack_token_ids` would take it (without building the list).

    Raises:
        InputTypeError: as :func:`pack_token_ids`.
    """
    if value.__class__ is not list or _pack_list(value) is None:
        pack_token_ids(value, what)


def _pack_list(value: list[object]) -> array[int] | None:
    """A list of valid token ids packed as unsigned 64-bit ints, or None.

    None sends the caller to the general path, which says what is wrong.

    NOTE: "Q" packs several times faster than "q" in CPython and refuses
    negative ids; its bytes equal "q"'s below 2**63. One reduction over the
    packed ids read as int64 finds both other cases: an id of 2**63 or more
    reads as negative, and bools pack as 0 and 1, so only when the smallest
    id is 0 or 1 are those elements' types read.
    """
    try:
        packed = array("Q", cast("list[int]", value))
    except (TypeError, OverflowError):
        return None
    if packed:
        signed = np.frombuffer(packed, np.int64)
        smallest = signed.item(signed.argmin())  # no ufunc set-up: a quarter of min()'s cost
        if smallest < 0:
            return None  # an id of 2**63 or more
        if smallest <= 1:
            zeros_and_ones = np.flatnonzero(signed <= 1).tolist()
            if any(value[index].__class__ is not int for index in zeros_and_ones):
                return None
    return packed


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes.

    Raises:
        InputTypeError: an id is not an int (bools included) or is negative or too large.
    """
    if bool in set(map(type, token_ids)):  # one C-level pass; bools are ints to array()
        raise InputTypeError("token ids must be ints, got a bool")
    try:
        packed = array("q", token_ids)
    except (TypeError, OverflowError) as error:
        raise InputTypeError(f"token ids must be ints in int64 range: {error}") from error
    if packed and min(packed) < 0:
        raise InputTypeError(
            f"token ids must be in 0 .. 2**63 - 1, got {min(packed)}: a negative id is no token "
            "(mark an image's placeholder tokens with extra_keys, not with negative ids)"
        )
    return packed.tobytes()


def block_keys(
    parent: bytes,
    tokens: bytes,
    block_size: int,
    extras: bytes,
    hasher: HashFunction,
    first_block: int = 0,
) -> list[bytes]:
    """Chained keys of every full block in ``tokens`` (int64 bytes), after ``parent``.

    Each key hashes ``field(b"P", parent) + field(b"T", block's tokens) + tail``,
    where the tail is the extra keys that block mixes in (see
    :func:`~pagedkv.prefix.keys.block_tails`); ``first_block`` is the logical
    index of ``tokens``' first block.
    """
    keys = []
    step = 8 * block_size
    token_tag = b"T" + struct.pack("<Q", step)
    num_blocks = len(tokens) // step
    tails = block_tails(extras, first_block, num_blocks, block_size)
    length = _LENGTH.pack
    for i, start in enumerate(range(0, num_blocks * step, step)):
        tail = tails if isinstance(tails, bytes) else tails[i]
        # field(b"P", parent) spelled out: one call less a block
        block = tokens[start : start + step]
        parent = hasher(b"".join((b"P", length(len(parent)), parent, token_tag, block, tail)))
        keys.append(parent)
    return keys


_LENGTH = struct.Struct("<Q")  # extra_keys.field's length prefix


class PrefixCache:
    """The map from block keys to block ids, and each block's own key.

    Invariants:
        * ``key_of[block_of[key]] == key`` for every key, and the two maps
          have the same size;
        * a block has a key iff the allocator marks it cached; a keyed block
          is either in use or waits in the allocator's cached free queue;
          no plain free block has a key;
        * a keyed block is full and holds what its key says: the manager
          never writes into one (``BlockAllocator.must_copy_before_append``),
          so a key is dropped only when its block is reused or about to be
          overwritten by its only holder;
        * with ``events``, every key change is reported to it, so its
          ``keyed_hashes`` are exactly the keys (what a resync replays).

    >>> allocator = BlockAllocator(4)
    >>> cache = PrefixCache(allocator)
    >>> block_id = allocator.allocate_one()
    >>> cache.register(block_id, b"k")
    True
    >>> cache.block_for(b"k"), cache.key_of(block_id)
    (0, b'k')
    >>> allocator.free_one(block_id)  # freed, but still findable by its key
    >>> allocator.num_cached_free_blocks, cache.block_for(b"k")
    (1, 0)
    """

    def __init__(self, allocator: BlockAllocator, *, share_with: PrefixCache | None = None) -> None:
        """Run prefix caching on ``allocator``'s blocks.

        Args:
            allocator: the pool's allocator.
            share_with: another cache on the same allocator whose blocks this
                one's sit beside: a KV-cache group's cache beside the others
                (vLLM keys its one map by ``(hash, group)``; here each group
                has its map and the allocator tells the owner of a block
                evicted for reuse).

        Raises:
            ConfigError: another prefix cache already runs on this allocator
                (two would each drop keys the other owns), or ``share_with``
                runs on another allocator.
        """
        allocator.release_deferred()  # a dropped manager's cache may still be closing
        if share_with is not None:
            shared_group: _CacheGroup = share_with.sharing_group
            if share_with.allocator is not allocator or allocator.on_evict is not shared_group:
                raise ConfigError("share_with must be a running prefix cache on the same allocator")
            group = shared_group
        elif allocator.on_evict is not None:
            raise ConfigError(
                "another prefix cache (another manager with enable_prefix_caching=True) already runs on "
                "this pool; give each prefix-caching manager a pool of its own"
            )
        else:
            group = _CacheGroup()
            allocator.on_evict = group
        group.caches.append(self)
        self._group = group
        self._allocator = allocator
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        #: Cached blocks evicted to be reused since creation.
        self.num_evictions = 0
        #: Where key changes are reported (``kv_events``), or None.
        self.events: KVEventBuffer | None = None
        #: Called with ``(block_id, key)`` when a keyed block is evicted for reuse, before its key
        #: is dropped and while its bytes are intact (the tiers copy them), or None. It runs
        #: under the pool's lock from inside ``allocate``: it must not block and must not raise.
        self.on_evict_key: Callable[[int, bytes], None] | None = None

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator whose blocks this cache keys."""
        return self._allocator

    @property
    def sharing_group(self) -> _CacheGroup:
        """The caches on this allocator (KV-cache groups): the allocator's ``on_evict``."""
        return self._group

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that have a key (in use or cached free)."""
        return len(self._block_of)

    def block_for(self, key: bytes) -> int | None:
        """The block holding ``key``'s contents, or None."""
        return self._block_of.get(key)

    def key_of(self, block_id: int) -> bytes | None:
        """``block_id``'s key, or None when it has none."""
        return self._key_of.get(block_id)

    def longest_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of ``keys``, from the first, that are all cached.

        Raises:
            InputTypeError: ``keys`` is not a list (or tuple) of block keys.
        """
        if keys.__class__ is not list and (isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence)):
            raise InputTypeError(f"keys must be a list of block keys (bytes), got {keys!r}")
        found = []
        block_of = self._block_of
        for key in keys:
            block_id = block_of.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_id: int, key: bytes) -> bool:
        """Give a full, used block its key; False (and no change) if the key is taken.

        A second block with the same contents (two identical prompts admitted
        in one step) stays unkeyed: the first block keeps the key, so the map
        never has two blocks for one key nor a key on the wrong block.

        Raises:
            InputTypeError: ``key`` is not bytes.
            UnknownBlockError, BlockStateError: as the allocator's ``mark_cached``.
        """
        if not isinstance(key, bytes):  # a str would never equal the bytes keys lookups use
            raise InputTypeError(f"a block key must be bytes, got {key!r} ({type(key).__name__})")
        if key in self._block_of or block_id in self._key_of:
            return False
        self._allocator.mark_cached(block_id)
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        return True

    def register_blocks(self, block_ids: Sequence[int | None], keys: Sequence[bytes]) -> list[bool]:
        """:meth:`register` of each ``(block_id, key)`` pair in turn (a None id: False); what each returned.

        All of it or, when the allocator refuses an id (``mark_cached``'s
        errors), none of it.
        """
        block_of, key_of = self._block_of, self._key_of
        stored: list[bool] = []
        new_key_of: dict[int, bytes] = {}
        new_block_of: dict[bytes, int] = {}
        for block_id, key in zip(block_ids, keys):
            taken = key in block_of or key in new_block_of or block_id in key_of or block_id in new_key_of
            if block_id is None or taken:
                stored.append(False)
                continue
            new_key_of[block_id] = key
            new_block_of[key] = block_id
            stored.append(True)
        self._allocator.mark_cached_blocks(list(new_key_of))
        # ---- validated ----
        key_of.update(new_key_of)
        block_of.update(new_block_of)
        return stored

    def forget(self, block_id: int) -> None:
        """Drop ``block_id``'s key, if it has one: its contents are about to change.

        A used block stays used; a cached free block becomes a plain free one.
        """
        key = self._key_of.pop(block_id, None)
        if key is not None:
            del self._block_of[key]
            self._allocator.unmark_cached(block_id)
            if self.events is not None:
                self.events.removed(key)

    def reset(self) -> None:
        """Drop every key (the caller checks that no block is in use)."""
        for block_id in list(self._key_of):
            self._allocator.unmark_cached(block_id)
        self._block_of.clear()
        self._key_of.clear()
        if self.events is not None:
            self.events.cleared()

    def close(self) -> None:
        """Drop every key and stop listening to the allocator, so another prefix cache may run on it.

        Cached free blocks become plain free blocks; used blocks stay used.
        The allocator is free for another cache once every cache sharing it
        (``share_with``) is closed.
        """
        self.reset()
        group = self._group
        if self in group.caches:
            group.caches.remove(self)
        if not group.caches and self._allocator.on_evict is group:
            self._allocator.on_evict = None

    def _export_state(self) -> tuple[list[tuple[int, bytes]], int]:
        """``([(block_id, key), ...] in insertion order, num_evictions)``: the internal snapshot hook.

        Insertion order matters: ``reset`` unmarks blocks in it, which decides
        the order they rejoin the plain free queue.
        """
        return list(self._key_of.items()), self.num_evictions

    def _restore_state(self, keys: list[tuple[int, bytes]], num_evictions: int) -> None:
        """Take the keys of ``_export_state`` back into this empty cache.

        The allocator's own state (cached marks included) is restored first;
        the caller checks ``check_invariants`` after.
        """
        for block_id, key in keys:
            self._block_of[key] = block_id
            self._key_of[block_id] = key
        self.num_evictions = num_evictions

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if len(self._block_of) != len(self._key_of):
            raise AssertionError("key->block and block->key maps differ in size")
        allocator = self._allocator
        for key, block_id in self._block_of.items():
            if self._key_of.get(block_id) != key:
                raise AssertionError(f"block {block_id} is mapped by a key it does not hold")
            if not allocator.is_cached(block_id):
                raise AssertionError(f"keyed block {block_id} is not marked cached")
        keyed = self._group.keyed_block_ids()
        for block_id in range(allocator.num_blocks):
            if allocator.is_cached(block_id) and block_id not in keyed:
                raise AssertionError(f"block {block_id} is marked cached but has no key")
        cached_free = set(allocator.cached_free_block_ids())
        for block_id in cached_free:
            if block_id not in keyed:
                raise AssertionError(f"cached free block {block_id} has no key")
        for block_id in allocator.free_block_ids():
            if block_id in self._key_of:
                raise AssertionError(f"plain free block {block_id} still has a key")
        if self.events is not None and self.events.keyed_hashes != set(self._block_of):
            raise AssertionError("the KV event buffer's keyed hashes differ from the cache's keys")

    def _evicted(self, block_id: int) -> None:
        listener = self.on_evict_key
        if listener is not None:
            listener(block_id, self._key_of[block_id])
        key = self._key_of.pop(block_id)
        del self._block_of[key]
        self.num_evictions += 1
        if self.events is not None:
            self.events.removed(key)


class _CacheGroup:
    """The prefix caches sharing one allocator (KV-cache groups): the allocator's ``on_evict``.

    A block id is keyed in at most one of them; an evicted block is dropped
    by the cache that keyed it.
    """

    __slots__ = ("caches",)

    def __init__(self) -> None:
        self.caches: list[PrefixCache] = []

    def __call__(self, block_id: int) -> None:
        for cache in self.caches:
            if block_id in cache._key_of:
                cache._evicted(block_id)
                return
        raise AssertionError(f"evicted block {block_id} is keyed by no prefix cache of its allocator")

    def keyed_block_ids(self) -> set[int]:
        """Every block id some cache of the group keys."""
        return {block_id for cache in self.caches for block_id in cache._key_of}
