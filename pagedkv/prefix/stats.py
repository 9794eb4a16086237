"""Prefix-cache hit rates: since the start (or the last reset), and over the most recent requests.

Both, as vLLM reports them (``PrefixCachingMetrics`` for the recent rate): the cumulative rate
says how the cache has done, the recent one how it does now. A *request* is one
``add_sequence`` with a prompt; its queries are the prompt's tokens and its hits the tokens
found cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.counts import check_count

__all__ = ["RECENT_REQUESTS", "HitWindow", "PrefixStats"]

#: Requests the recent hit rate covers by default (vLLM's ``max_recent_requests``).
RECENT_REQUESTS = 1000


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Prefix-cache lookups of one manager.

    Attributes:
        num_requests: prompts looked up since the start or the last reset (a
            loaded snapshot starts counting again).
        num_queries: their tokens.
        num_hits: their tokens found cached.
        hit_rate: ``num_hits / num_queries`` (0.0 with no query).
        num_recent_requests: the most recent requests counted below (at most the window).
        recent_hit_rate: the hit rate over those.
    """

    num_requests: int
    num_queries: int
    num_hits: int
    hit_rate: float
    num_recent_requests: int
    recent_hit_rate: float


class HitWindow:
    """The hits of the last ``max_requests`` requests, and how many requests there were.

    The cumulative token counts are not kept here: they are the manager's
    ``prefix_queries`` / ``prefix_hits`` counters (which snapshots save), and
    ``stats`` takes them.

    Invariants:
        * the window holds at most ``max_requests`` entries;
        * its sums equal the sums of its entries.

    Example:
        >>> window = HitWindow(max_requests=2)
        >>> for queries, hits in [(10, 0), (10, 10), (10, 5)]:
        ...     window.record(queries, hits)
        >>> stats = window.stats(num_queries=30, num_hits=15)  # the cumulative counts are the manager's
        >>> stats.hit_rate, stats.recent_hit_rate, stats.num_recent_requests
        (0.5, 0.75, 2)
    """

    def __init__(self, max_requests: int = RECENT_REQUESTS) -> None:
        self.max_requests = check_count("max_requests", max_requests)
        self._recent: deque[tuple[int, int]] = deque()
        self._recent_queries = self._recent_hits = 0
        self._requests = 0

    def record(self, num_queries: int, num_hits: int) -> None:
        """Count one request of ``num_queries`` tokens, ``num_hits`` of them cached."""
        self._requests += 1
        recent = self._recent
        if len(recent) == self.max_requests:
            old_queries, old_hits = recent.popleft()
            self._recent_queries -= old_queries
            self._recent_hits -= old_hits
        recent.append((num_queries, num_hits))
        self._recent_queries += num_queries
        self._recent_hits += num_hits

    def reset(self) -> None:
        """Forget every request."""
        self._recent.clear()
        self._recent_queries = self._recent_hits = 0
        self._requests = 0

    def stats(self, num_queries: int, num_hits: int) -> PrefixStats:
        """The rates now, with the cumulative ``num_queries`` and ``num_hits`` tokens."""
        return PrefixStats(
            num_requests=self._requests,
            num_queries=num_queries,
            num_hits=num_hits,
            hit_rate=num_hits / num_queries if num_queries else 0.0,
            num_recent_requests=len(self._recent),
            recent_hit_rate=self._recent_hits / self._recent_queries if self._recent_queries else 0.0,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        recent = self._recent
        if len(recent) > self.max_requests:
            raise AssertionError(f"{len(recent)} recent requests, window {self.max_requests}")
        sums = (sum(q for q, _ in recent), sum(h for _, h in recent))
        if (self._recent_queries, self._recent_hits) != sums:
            raise AssertionError("the window's sums disagree with its entries")
