"""Tiers below the device pool chained into one: the host tier, then stores, found by prefix key.

vLLM: the OffloadingConnector's manager (lookup, store, load, ``BlockStored.medium``);
SGLang: HiCache's controller (host pool, storage backend, write-through / write-back);
LMCache: its storage manager over local CPU, disk and remote backends.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.prefix.events import BlockRemoved, BlockStored, KVEvent
from pagedkv.tiers.codec import BlockLayout, Payload, RefusedValueError, decode_block, encode_block, store_key
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.store import KVStore, StoreError

__all__ = ["MEDIUM_CPU", "WRITE_POLICIES", "TieredStore"]

#: The medium KV events name for the host tier (vLLM's ``"CPU"``).
MEDIUM_CPU = "CPU"
#: When blocks reach the stores: when the device evicts them (and the host spills
#: them), or as soon as they are keyed.
WRITE_POLICIES = ("write_back", "write_through")



class TieredStore:
    """The host tier (optional), then each store in turn, holding block payloads by prefix key.

    Reads (``find``, ``fetch``) walk the tiers in order and stop at a prompt's
    first missing block, for a hit must be a run of consecutive blocks from the
    first (a key proves its whole prefix). A store that fails or answers with
    a value that does not check is a miss, counted; it never raises here::

        write_back:     device evicts -> host -> (host evicts) -> stores
        write_through:  block keyed   -> host and stores at once

    Thread-safe: the host tier and the counters sit behind one lock; store
    calls run outside it, so a slow store never stalls a host hit.

    Invariants:
        * the host tier's invariants hold;
        * ``num_refused`` counts every value that failed its checks, and no
          such value was ever returned.

    >>> layout = BlockLayout("m", 4, 1, 2, 1, "float32", None, None, 0, 2)
    >>> tiers = TieredStore(layout, host=HostTier(block_nbytes=2, num_blocks=4))
    >>> tiers.offer(b"k0", b"ab")
    >>> tiers.find([b"k0", b"k1"]), tiers.fetch([b"k0"])
    (['CPU'], [b'ab'])
    """

    def __init__(
        self,
        layout: BlockLayout,
        *,
        host: HostTier | None = None,
        stores: Sequence[KVStore] = (),
        write_policy: str = "write_back",
        max_events: int = 10_000,
    ) -> None:
        """Chain ``host`` (if any) and ``stores`` (in read order) for blocks of ``layout``.

        Raises:
            ConfigError: an unknown ``write_policy``, no tier at all, or a host
                tier whose block size is not the layout's.
            InputTypeError: a store lacks ``put`` / ``get`` / ``exists`` / ``delete`` / ``medium``.
        """
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if host is None and not stores:
            raise ConfigError("a TieredStore needs a host tier, a store, or both")
        if host is not None and host.block_nbytes != layout.block_nbytes:
            raise ConfigError(
                f"host tier of {host.block_nbytes}-byte blocks, the layout's are {layout.block_nbytes}"
            )
        for store in stores:
            if not isinstance(store, KVStore):
                raise InputTypeError(f"a store needs put, get, exists, delete and medium; got {store!r}")
        self.layout = layout
        self.host = host
        self.stores = list(stores)
        self.write_policy = write_policy
        self._lock = threading.Lock()
        self._events: deque[KVEvent] = deque()
        self.max_events = max_events
        #: Blocks offered, hits per medium, prompts' first missing blocks, values refused,
        #: store calls that failed, host blocks spilled to the stores, events dropped.
        self.num_offered = 0
        self.num_hits: dict[str, int] = {}
        self.num_misses = 0
        self.num_refused = 0
        self.num_store_errors = 0
        self.num_spilled = 0
        self.num_dropped_events = 0

    # ---------------------------------------------------------------- writes

    def offer(self, prefix_key: bytes, payload: Payload) -> None:
        """The device evicts the block ``prefix_key``: keep it (host, or straight to the stores).

        Under ``write_through`` the stores hold it already; the host takes a copy if it has none.
        """
        _check_prefix_key(prefix_key)
        with self._lock:
            self.num_offered += 1
        if self.host is None:
            if self.write_policy == "write_back":
                self._put_stores([(prefix_key, _as_bytes(payload))])
            return
        spilled = self._put_host(self.host, prefix_key, payload)
        if self.write_policy == "write_back":
            self._put_stores(spilled)

    def write_through(self, prefix_key: bytes, payload: Payload) -> None:
        """The block ``prefix_key`` was just keyed: under ``write_through``, store it everywhere now.

        Does nothing under ``write_back``.
        """
        _check_prefix_key(prefix_key)
        if self.write_policy != "write_through":
            return
        if self.host is not None:
            self._put_host(self.host, prefix_key, payload)  # what the host evicts is in the stores already
        self._put_stores([(prefix_key, _as_bytes(payload))])

    def _put_host(self, host: HostTier, prefix_key: bytes, payload: Payload) -> list[tuple[bytes, bytes]]:
        with self._lock:
            if prefix_key in host:
                return []
            evicted = host.put(prefix_key, payload)
            self._event(_stored(prefix_key, self.layout.block_size, MEDIUM_CPU))
            for key, _ in evicted:
                self._event(BlockRemoved(block_hashes=[key], medium=MEDIUM_CPU))
            self.num_spilled += len(evicted) if self.stores and self.write_policy == "write_back" else 0
        return evicted

    def _put_stores(self, blocks: list[tuple[bytes, bytes]]) -> None:
        for prefix_key, payload in blocks:
            key = store_key(self.layout, prefix_key)
            value = encode_block(self.layout, prefix_key, payload)
            for store in self.stores:
                try:
                    store.put(key, value)
                except StoreError:
                    with self._lock:
                        self.num_store_errors += 1
                    continue
                with self._lock:
                    self._event(_stored(prefix_key, self.layout.block_size, store.medium))

    # ---------------------------------------------------------------- reads

    def find(self, keys: Sequence[bytes]) -> list[str]:
        """The medium of each of the longest run of ``keys``, from the first, that some tier holds.

        Changes nothing but the error counts; a store may drop a block between
        ``find`` and ``fetch``, so ``fetch`` may return fewer.
        """
        mediums: list[str] = []
        for prefix_key in keys:
            _check_prefix_key(prefix_key)
            medium = self._where(prefix_key)
            if medium is None:
                break
            mediums.append(medium)
        return mediums

    def _where(self, prefix_key: bytes) -> str | None:
        if self.host is not None:
            with self._lock:
                if prefix_key in self.host:
                    return MEDIUM_CPU
        key = store_key(self.layout, prefix_key)
        for store in self.stores:
            try:
                if store.exists(key):
                    return store.medium
            except StoreError:
                with self._lock:
                    self.num_store_errors += 1
        return None

    def fetch(self, keys: Sequence[bytes]) -> list[bytes]:
        """Payloads of the longest run of ``keys``, from the first, that some tier returns and that check.

        A block found in a store is copied into the host tier (it is likely
        read again soon). Every value returned passed its checks.
        """
        payloads: list[bytes] = []
        for prefix_key in keys:
            _check_prefix_key(prefix_key)
            found = self._fetch_one(prefix_key)
            if found is None:
                with self._lock:
                    self.num_misses += 1
                break
            payloads.append(found)
        return payloads

    def _fetch_one(self, prefix_key: bytes) -> bytes | None:
        if self.host is not None:
            with self._lock:
                payload = self.host.get(prefix_key)
                if payload is not None:
                    self._hit(MEDIUM_CPU)
                    return payload
        key = store_key(self.layout, prefix_key)
        for store in self.stores:
            payload = self._fetch_from(store, key, prefix_key)
            if payload is None:
                continue
            with self._lock:
                self._hit(store.medium)
            if self.host is not None:
                spilled = self._put_host(self.host, prefix_key, payload)
                if self.write_policy == "write_back":
                    self._put_stores(spilled)
            return payload
        return None

    def _fetch_from(self, store: KVStore, key: bytes, prefix_key: bytes) -> bytes | None:
        try:
            value = store.get(key)
        except StoreError:
            with self._lock:
                self.num_store_errors += 1
            return None
        if value is None:
            return None
        try:
            return bytes(decode_block(self.layout, prefix_key, value))
        except RefusedValueError:
            with self._lock:
                self.num_refused += 1
            return None

    def _hit(self, medium: str) -> None:
        self.num_hits[medium] = self.num_hits.get(medium, 0) + 1

    # ---------------------------------------------------------------- events

    def _event(self, event: KVEvent) -> None:
        """Buffer ``event`` (the lock held); the oldest go when full, counted."""
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.num_dropped_events += 1
        self._events.append(event)

    def drain_events(self) -> list[KVEvent]:
        """The tiers' ``BlockStored`` / ``BlockRemoved`` events since the last drain, oldest first.

        Each names its tier in ``medium`` (``"CPU"``, ``"DISK"``, ``"REDIS"``).
        A store's own evictions are not seen (a server drops values silently).
        """
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if self.host is not None:
            with self._lock:
                self.host.check_invariants()


def _check_prefix_key(prefix_key: object) -> None:
    if not isinstance(prefix_key, bytes):
        raise InputTypeError(f"a prefix key must be bytes, got {prefix_key!r} ({type(prefix_key).__name__})")


def _as_bytes(payload: Payload) -> bytes:
    return payload.tobytes() if isinstance(payload, np.ndarray) else bytes(payload)


def _stored(prefix_key: bytes, block_size: int, medium: str) -> BlockStored:
    """A tier's ``BlockStored``: the tiers know keys, not token ids or parents (left empty / None)."""
    return BlockStored(block_hashes=[prefix_key], parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)
