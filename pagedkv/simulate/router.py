"""Routers: which replica of a cluster serves the next request.

:class:`RoundRobin`, :class:`LeastLoaded`, and :class:`PrefixAware`, which learns each
replica's cached blocks only from its KV events, as llm-d's and Dynamo's KV-aware
routers do. How the prefix index walks a prompt: docs/simulate.md, "Routers".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["ROUTERS", "LeastLoaded", "PrefixAware", "RoundRobin", "Router", "make_router"]

#: Where a stored block is filed: its parent's hash (None at a sequence's start), its tokens' hash.
Edge = tuple[bytes | None, int]


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
        * ``_edges[r]`` maps exactly the block hashes replica ``r`` reported
          stored and not yet removed, each to its edge ``(parent hash, hash
          of its token ids)`` as its last ``BlockStored`` gave them;
        * ``_children[r][edge]`` is the set of those hashes whose edge is
          ``edge``, never empty.
    """

    name = "prefix-aware"
    wants_events = True

    def __init__(self, block_size: int, *, load_weight: float = 2.0) -> None:
        self.block_size = block_size
        self.load_weight = load_weight
        self._edges: list[dict[bytes, Edge]] = []
        self._children: list[dict[Edge, set[bytes]]] = []

    def _replica(self, replica: int) -> tuple[dict[bytes, Edge], dict[Edge, set[bytes]]]:
        while len(self._edges) <= replica:
            self._edges.append({})
            self._children.append({})
        return self._edges[replica], self._children[replica]

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
        edges, children = self._replica(replica)
        for event in events:
            if isinstance(event, BlockStored):
                parent, tokens = event.parent_block_hash, event.token_ids
                for index, block_hash in enumerate(event.block_hashes):
                    _forget(edges, children, block_hash)  # stored again: its last event wins
                    edge = (parent, hash(tuple(tokens[index * bs : (index + 1) * bs])))
                    edges[block_hash] = edge
                    children.setdefault(edge, set()).add(block_hash)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    _forget(edges, children, block_hash)
            elif isinstance(event, AllBlocksCleared):
                edges.clear()
                children.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a replica's edges and children disagree."""
        for replica, (edges, children) in enumerate(zip(self._edges, self._children)):
            filed: dict[Edge, set[bytes]] = {}
            for block_hash, edge in edges.items():
                filed.setdefault(edge, set()).add(block_hash)
            if filed != children:
                raise AssertionError(f"replica {replica}'s children disagree with its stored blocks")

    def chain(self, prompt: Sequence[int]) -> list[int]:
        """The hash of each full block's token ids of ``prompt``, as ``observe`` files them."""
        bs = self.block_size
        return [hash(tuple(prompt[start : start + bs])) for start in range(0, len(prompt) - bs + 1, bs)]

    def num_cached_blocks(self, replica: int, prompt: Sequence[int], chain: list[int] | None = None) -> int:
        """Leading full blocks of ``prompt`` that ``replica`` reported cached (``chain``: ``chain(prompt)``).

        The walk keeps every hash its step found: blocks of the same tokens
        under the same parent may differ in extra keys (an adapter), which
        the router does not see.
        """
        _, children = self._replica(replica)
        tokens_hashes = self.chain(prompt) if chain is None else chain
        found: Collection[bytes | None] = (None,)
        for count, tokens_hash in enumerate(tokens_hashes):
            if len(found) == 1:  # the common step: one block found, looked up without a new set
                found = children.get((next(iter(found)), tokens_hash), ())
            else:
                found = {child for parent in found for child in children.get((parent, tokens_hash), ())}
            if not found:
                return count
        return len(tokens_hashes)

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The replica with the best cached blocks less weighted load (ties: less loaded, lower index).

        The prompt's chain is computed once and walked in every replica's index.
        """
        weight, chain = self.load_weight, self.chain(prompt)
        scores = [self.num_cached_blocks(r, prompt, chain) - weight * loads[r] for r in range(len(loads))]
        return max(range(len(loads)), key=lambda r: (scores[r], -loads[r], -r))


def _forget(edges: dict[bytes, Edge], children: dict[Edge, set[bytes]], block_hash: bytes) -> None:
    """Drop ``block_hash`` from one replica's index, if it is there."""
    edge = edges.pop(block_hash, None)
    if edge is None:
        return
    siblings = children[edge]
    siblings.discard(block_hash)
    if not siblings:
        del children[edge]


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
