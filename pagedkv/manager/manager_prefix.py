"""The prefix-caching part of ``KVCacheManager``'s interface: lookups, KV events, hit rates.

:class:`PrefixCachingCommands` is a mixin: ``KVCacheManager`` inherits these
methods, so they are documented and called as the manager's own; they live
here because they are one concept (what prefix caching offers a scheduler and
a cluster router), apart from the sequence lifecycle in :mod:`pagedkv.manager.manager`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.errors import ConfigError
from pagedkv.locking import locked
from pagedkv.manager.admission import AdmissionPlan, plan_admission
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import PrefixCache
from pagedkv.prefix.events import KVEvent, KVEventBuffer
from pagedkv.prefix.keys import ExtraKeys
from pagedkv.prefix.stats import PrefixStats

__all__ = ["PrefixCachingCommands"]


class PrefixCachingCommands:
    """What a manager with prefix caching offers beyond reserve/write/attend (mixed into the manager)."""

    pool: KVPool
    _sharing: PrefixSharing | None
    _counters: dict[str, int]

    @property
    def prefix_caching(self) -> bool:
        """Whether this manager runs prefix caching (``enable_prefix_caching``)."""
        return self._sharing is not None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The key -> block map of prefix caching (read it; do not change it), or None when off."""
        return self._sharing.cache if self._sharing is not None else None

    @property
    def kv_events(self) -> KVEventBuffer | None:
        """The KV event buffer (read its counts; take events with ``drain_kv_events``), or None when off."""
        return self._sharing.cache.events if self._sharing is not None else None

    @locked
    def drain_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last drain, oldest first (see :mod:`pagedkv.prefix.events`).

        After the buffer overflowed (or ``kv_events.request_resync()``), a
        resync instead: ``AllBlocksCleared``, then every keyed block, parents
        first. Applying every drain in order leaves a consumer's index equal
        to the prefix cache's keys, overflow or not.

        Raises:
            ConfigError: events are off (``kv_events=False``).
        """
        events = self.kv_events
        if events is None:
            raise ConfigError("KV events are off: pass enable_prefix_caching=True, kv_events=True")
        return events.drain()

    @locked
    def lookup(
        self, prompt: Sequence[int], *, extra_keys: ExtraKeys | None = None
    ) -> AdmissionPlan:
        """What admitting ``prompt`` would find cached and take, changing nothing.

        ``add_sequence(seq_id, prompt, extra_keys=...)`` then returns exactly
        ``num_cached_tokens``, and it with one ``reserve`` of the rest of the
        prompt takes exactly ``num_blocks_taken`` blocks, if nothing happens
        in between. The keys computed here are kept for that ``add_sequence``
        (each block is still hashed once).

        >>> from pagedkv import KVPool, KVCacheManager
        >>> manager = KVCacheManager(KVPool(8, block_size=2, head_dim=1), enable_prefix_caching=True)
        >>> plan = manager.lookup([1, 2, 3, 4, 5])
        >>> plan.num_cached_tokens, plan.num_new_blocks, plan.fits
        (0, 3, True)

        Raises:
            InputTypeError, ConfigError: a bad token id or extra key.
        """
        return plan_admission(self._sharing, self.pool.allocator, prompt, extra_keys, self.pool.block_size)

    @locked
    def reset_prefix_cache(self) -> None:
        """Drop every block key; refused while any block is in use.

        Raises:
            ConfigError: prefix caching is off.
            SequenceStateError: blocks are in use (free every sequence first).
        """
        self._prefix_sharing().reset(self.pool.num_used_blocks)

    @locked
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache hit rates: since the start or the last reset, and over the last 1,000 requests.

        Raises:
            ConfigError: prefix caching is off.
        """
        counters = self._counters
        return self._prefix_sharing().stats.stats(counters["prefix_queries"], counters["prefix_hits"])

    @locked
    def reset_prefix_stats(self) -> None:
        """Start the hit counts again: ``prefix_stats`` and the prefix counters of ``metrics``.

        Raises:
            ConfigError: prefix caching is off.
        """
        self._prefix_sharing().stats.reset()
        for name in ("prefix_queries", "prefix_hits", "resumed_reuse"):
            self._counters[name] = 0

    def _prefix_sharing(self) -> PrefixSharing:
        if self._sharing is None:
            raise ConfigError("prefix caching is off for this manager")
        return self._sharing
