"""The host tier: a bounded pool of block-sized host buffers, keyed by prefix key, with an eviction policy.

vLLM: the OffloadingConnector's CPU backend (``LRUOffloadingManager`` /
``ARCOffloadingManager``); SGLang: HiCache's host pool. Two policies: ``"lru"``
and ``"s3fifo"`` (Yang et al., SOSP'23: a small probation queue keeps blocks
read once from pushing out blocks read again; no list move on a hit).
benchmarks/bench_tiers.py measures their hit rates.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
import numpy.typing as npt

from pagedkv.counts import check_count
from pagedkv.errors import ConfigError
from pagedkv.tiers.codec import Payload

__all__ = ["HOST_POLICIES", "HostTier", "LRUPolicy", "S3FIFOPolicy"]

#: The eviction policies a host tier takes.
HOST_POLICIES = ("lru", "s3fifo")


class LRUPolicy:
    """Least recently used first. ``admit`` / ``touch`` / ``victim`` / ``discard`` over keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def admit(self, key: bytes) -> None:
        """Take a new key (the caller made room)."""
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        """``key`` was read."""
        self._order.move_to_end(key)

    def victim(self) -> bytes:
        """Remove and return the key to evict."""
        return self._order.popitem(last=False)[0]

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (deleted by the caller)."""
        self._order.pop(key, None)

    def keys(self) -> set[bytes]:
        """The keys held."""
        return set(self._order)


class S3FIFOPolicy:
    """S3-FIFO: a small FIFO (a tenth) for new keys, a main FIFO, and a ghost FIFO of keys evicted from small.

    A key read while in small moves to main when it reaches the head; one never
    read leaves (into ghost). A key admitted while in ghost goes straight to
    main. Main gives each key as many second chances as reads (at most 3).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._small_capacity = max(1, capacity // 10)
        self._small: deque[bytes] = deque()
        self._main: deque[bytes] = deque()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._reads: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def admit(self, key: bytes) -> None:
        """Take a new key (the caller made room)."""
        self._reads[key] = 0
        if key in self._ghost:  # evicted from small not long ago: read again, so it earns main
            del self._ghost[key]
            self._main.append(key)
        else:
            self._small.append(key)

    def touch(self, key: bytes) -> None:
        """``key`` was read."""
        self._reads[key] = min(self._reads[key] + 1, 3)

    def victim(self) -> bytes:
        """Remove and return the key to evict."""
        reads = self._reads
        while True:
            if self._small and (len(self._small) >= self._small_capacity or not self._main):
                key = self._small.popleft()
                if key not in reads:
                    continue  # discarded earlier
                if reads[key]:
                    reads[key] = 0
                    self._main.append(key)
                    continue
                self._ghost[key] = None
                while len(self._ghost) > self.capacity:
                    self._ghost.popitem(last=False)
                del reads[key]
                return key
            key = self._main.popleft()
            if key not in reads:
                continue
            if reads[key]:
                reads[key] -= 1
                self._main.append(key)
                continue
            del reads[key]
            return key

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (deleted by the caller); its queue entry is skipped later."""
        self._reads.pop(key, None)

    def keys(self) -> set[bytes]:
        """The keys held."""
        return set(self._reads)


class HostTier:
    """At most ``num_blocks`` block payloads in host memory, keyed by prefix key.

    Storage is one array ``(num_blocks, block_nbytes)`` of bytes; a key owns a
    row (a *slot*) until the policy evicts it::

        keys:   k7 -> 0   k2 -> 2          free slots: [1, 3]
        pages:  | k7's bytes | - | k2's bytes | - |

    Not thread-safe: :class:`~pagedkv.tiers.tiered.TieredStore` holds a lock around it.

    Invariants:
        * the policy holds exactly the keyed keys;
        * keyed slots and free slots are disjoint and together ``0 .. num_blocks - 1``.

    >>> host = HostTier(block_nbytes=2, num_blocks=1)
    >>> host.put(b"a", b"xy")
    []
    >>> host.put(b"b", b"zw")  # full: "a" is evicted, and handed back to spill
    [(b'a', b'xy')]
    >>> host.get(b"b"), host.get(b"a")
    (b'zw', None)
    """

    def __init__(self, *, block_nbytes: int, num_blocks: int, policy: str = "lru") -> None:
        """A host tier of ``num_blocks`` slots of ``block_nbytes`` bytes, evicting by ``policy``.

        Raises:
            ConfigError, InputTypeError: a size is not an int >= 1, or ``policy`` is not in ``HOST_POLICIES``.
        """
        self.block_nbytes = check_count("block_nbytes", block_nbytes)
        self.num_blocks = check_count("num_blocks", num_blocks)
        if policy not in HOST_POLICIES:
            raise ConfigError(f"policy must be one of {HOST_POLICIES}, got {policy!r}")
        self.policy_name = policy
        self._policy: LRUPolicy | S3FIFOPolicy = (
            LRUPolicy(num_blocks) if policy == "lru" else S3FIFOPolicy(num_blocks)
        )
        self._pages: npt.NDArray[np.uint8] = np.empty((num_blocks, block_nbytes), np.uint8)
        self._slot_of: dict[bytes, int] = {}
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        #: Payloads evicted to make room.
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def put(self, key: bytes, payload: Payload) -> list[tuple[bytes, bytes]]:
        """Hold ``payload`` under ``key``; return the ``(key, payload)`` pairs evicted for room.

        A key already held keeps its payload (the same key means the same bytes).

        Raises:
            ConfigError: the payload is not ``block_nbytes`` long.
        """
        data = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
        if data.shape != (self.block_nbytes,):
            raise ConfigError(f"a host payload of {data.size} bytes, expected {self.block_nbytes}")
        if key in self._slot_of:
            return []
        evicted = []
        if not self._free_slots:
            victim = self._policy.victim()
            slot = self._slot_of.pop(victim)
            evicted.append((victim, self._pages[slot].tobytes()))
            self._free_slots.append(slot)
            self.num_evictions += 1
        slot = self._free_slots.pop()
        self._pages[slot] = data
        self._slot_of[key] = slot
        self._policy.admit(key)
        return evicted

    def get(self, key: bytes) -> bytes | None:
        """A copy of ``key``'s payload (counted as a read by the policy), or None."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        self._policy.touch(key)
        payload: bytes = self._pages[slot].tobytes()
        return payload

    def delete(self, key: bytes) -> None:
        """Drop ``key``'s payload, if held."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._policy.discard(key)
            self._free_slots.append(slot)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if self._policy.keys() != set(self._slot_of):
            raise AssertionError("the policy's keys differ from the keyed slots")
        slots = sorted([*self._slot_of.values(), *self._free_slots])
        if slots != list(range(self.num_blocks)):
            raise AssertionError(f"slots {slots} are not each of 0 .. {self.num_blocks - 1} once")
