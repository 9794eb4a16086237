"""Routers: which replica of a cluster serves the next request.

* :class:`RoundRobin`: replicas in turn, blind to everything;
* :class:`LeastLoaded`: the replica with the fewest requests in flight (the
  load signal every serving engine exports as a metric);
* :class:`PrefixAware`: the replica whose prefix cache holds the longest run
  of the prompt's leading blocks, learned **only from the replicas' KV
  events** (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, as
  llm-d and Dynamo route), never by looking into a replica, traded
  against load.

The prefix index does not know the manager's hash function. It names each
stored block by its own chain key, ``key(block) = hash((key(parent),
token_ids))``, learned from the event's ``parent_block_hash`` and
``token_ids``, and computes the same chain over a new prompt (Python's
hash of a tuple of ints is fixed across runs; a 64-bit collision would
only misroute, never change an output)::

    prompt blocks     [b0][b1][b2][b3]
    replica 0 holds    k0  k1                 -> 2 blocks
    replica 1 holds    k0  k1  k2             -> 3 blocks: route to replica 1

>>> router = RoundRobin()
>>> [router.choose([], [0, 0, 0]) for _ in range(4)]
[0, 1, 2, 0]
>>> LeastLoaded().choose([], [3, 1, 2])
1
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["ROUTERS", "LeastLoaded", "PrefixAware", "RoundRobin", "Router", "make_router"]


class Router:
    """Chooses a replica for each request; learns from the replicas' KV events if it wants them.

    Attributes:
        name: the router's name in reports.
        wants_events: the cluster must drain every replica's KV events into ``observe``.
    """

    name = "router"
    wants_events = False

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a request with ``prompt``, given each replica's requests in flight."""
        raise NotImplementedError

    def observe(self, replica: int, events: Sequence[Any]) -> None:
        """Take in KV events a replica emitted (oldest first)."""


class RoundRobin(Router):
    """Replicas in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The next replica in turn."""
        replica = self._next % len(loads)
        self._next += 1
        return replica


class LeastLoaded(Router):
    """The replica with the fewest requests in flight (the lowest index on a tie)."""

    name = "least-loaded"

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The least loaded replica."""
        return min(range(len(loads)), key=loads.__getitem__)


class PrefixAware(Router):
    """Route to the longest cached prefix, known from KV events alone (see the module docstring).

    Args:
        block_size: the replicas' block size (events carry it too; checked).
        load_weight: cached blocks one request in flight is worth: the
            replica with the most ``cached blocks - load_weight x requests in
            flight`` wins (ties: the less loaded). Without it every request
            sharing a system prompt would pile onto the first replica that
            cached it.

    Invariants (``check_invariants``):
        * ``_keys[r]`` maps exactly the block hashes replica ``r`` reported
          stored and not yet removed to their chain keys;
        * ``_held[r][key]`` counts the block hashes mapped to ``key``.
    """

    name = "prefix-aware"
    wants_events = True

    def __init__(self, block_size: int, *, load_weight: float = 2.0) -> None:
        self.block_size = block_size
        self.load_weight = load_weight
        self._keys: list[dict[bytes, Hashable]] = []
        self._held: list[dict[Hashable, int]] = []

    def _replica(self, replica: int) -> tuple[dict[bytes, Hashable], dict[Hashable, int]]:
        while len(self._keys) <= replica:
            self._keys.append({})
            self._held.append({})
        return self._keys[replica], self._held[replica]

    def observe(self, replica: int, events: Sequence[Any]) -> None:
        """Index ``BlockStored``, drop ``BlockRemoved``, forget all on ``AllBlocksCleared``.

        Raises:
            ConfigError: an event's block size is not the router's (nothing is indexed).
        """
        bs = self.block_size
        for event in events:
            if isinstance(event, BlockStored) and event.block_size != bs:
                raise ConfigError(
                    f"replica {replica} stores blocks of {event.block_size} tokens, the router expects {bs}"
                )
        keys, held = self._replica(replica)
        for event in events:
            if isinstance(event, BlockStored):
                parent: Hashable = None
                if event.parent_block_hash is not None:
                    parent = keys.get(event.parent_block_hash)
                tokens = event.token_ids
                for index, block_hash in enumerate(event.block_hashes):
                    key: Hashable = hash((parent, tuple(tokens[index * bs : (index + 1) * bs])))
                    keys[block_hash] = key
                    held[key] = held.get(key, 0) + 1
                    parent = key
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = keys.pop(block_hash, None)
                    if key is not None:
                        held[key] -= 1
                        if not held[key]:
                            del held[key]
            elif isinstance(event, AllBlocksCleared):
                keys.clear()
                held.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a replica's key counts disagree with its stored blocks."""
        for replica, (keys, held) in enumerate(zip(self._keys, self._held)):
            counts: dict[Hashable, int] = {}
            for key in keys.values():
                counts[key] = counts.get(key, 0) + 1
            if counts != held:
                raise AssertionError(f"replica {replica}'s block counts disagree with its stored blocks")

    def chain(self, prompt: Sequence[int]) -> list[Hashable]:
        """The router's key of each full block of ``prompt``, chained as ``observe`` keys them."""
        bs = self.block_size
        keys: list[Hashable] = []
        parent: Hashable = None
        for start in range(0, len(prompt) - bs + 1, bs):
            parent = hash((parent, tuple(prompt[start : start + bs])))
            keys.append(parent)
        return keys

    def num_cached_blocks(
        self, replica: int, prompt: Sequence[int], chain: list[Hashable] | None = None
    ) -> int:
        """Leading full blocks of ``prompt`` that ``replica`` reported cached (``chain``: their keys)."""
        _, held = self._replica(replica)
        keys = self.chain(prompt) if chain is None else chain
        return next((count for count, key in enumerate(keys) if key not in held), len(keys))

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The replica with the best cached blocks less weighted load (ties: less loaded, lower index).

        The prompt's chain is computed once and looked up in every replica's index.
        """
        weight, chain = self.load_weight, self.chain(prompt)
        scores = [self.num_cached_blocks(r, prompt, chain) - weight * loads[r] for r in range(len(loads))]
        return max(range(len(loads)), key=lambda r: (scores[r], -loads[r], -r))


#: Router names for the command line.
ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


def make_router(name: str, block_size: int) -> Router:
    """A fresh router by name.

    Raises:
        ConfigError: an unknown name.
    """
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(block_size)
    raise ConfigError(f"unknown router {name!r}; expected one of {', '.join(ROUTERS)}")
