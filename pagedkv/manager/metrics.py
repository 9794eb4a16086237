"""A snapshot of a manager's memory and events, taken in one cheap call.

Block-level usage and token-level occupancy are reported side by side on
purpose: they differ (a block with one live token is "used"), and confusing
them is a known trap (vLLM #57336 saw 66.7% block usage at 36.5% occupancy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pagedkv.blocks.occupancy import count_live_slots
from pagedkv.manager.sequence import SequenceRecord, SequenceState
from pagedkv.memory.vmem import map_budget

if TYPE_CHECKING:
    from pagedkv.memory.pool import KVPool

__all__ = ["COUNTERS", "ManagerMetrics", "collect_metrics"]

#: The event counters every manager keeps (and a snapshot saves).
COUNTERS = ("forks", "copy_on_write", "preemptions", "swaps_out", "swaps_in", "prefix_queries",
            "prefix_hits", "resumed_reuse")


@dataclass(frozen=True, slots=True)
class ManagerMetrics:
    """Counts and ratios of one manager at one moment.

    Attributes:
        num_blocks: blocks in the device pool.
        num_used_blocks: blocks with a ref count of at least one.
        num_free_blocks: blocks ready to be handed out.
        block_size: token slots per block.
        block_usage: ``num_used_blocks / num_blocks``.
        num_live_slots: physical slots holding a live (not evicted) token;
            a slot shared by forks counts once.
        num_live_tokens: live tokens summed over sequences; shared tokens
            count once per sequence, so this can exceed ``num_live_slots``.
        token_occupancy: ``num_live_slots / (num_blocks * block_size)``.
        internal_fragmentation: share of the used blocks' slots that hold no
            live token (empty tails and evicted entries).
        num_sequences: sequences known to the manager (any state).
        num_running: sequences whose blocks are on the device pool.
        num_swapped: sequences whose blocks are on the host pool.
        num_host_used_blocks: host pool blocks in use.
        num_forks: forks since creation.
        num_copy_on_write: shared blocks copied before an append.
        num_preemptions: preemptions (both modes) since creation.
        num_swaps_out: sequences swapped to the host pool.
        num_swaps_in: sequences swapped back.
        num_prefix_queries: prompt tokens looked up in the prefix cache.
        num_prefix_hits: of those, tokens found cached (shared, not computed).
        prefix_hit_rate: ``num_prefix_hits / num_prefix_queries`` (0 if none).
        num_cached_blocks: blocks with a prefix key, in use or free.
        num_cached_free_blocks: free blocks a prefix hit can still take back.
        num_prefix_evictions: cached blocks evicted (key dropped) for reuse.
        num_resumed_reuse_tokens: tokens a recompute-preempted sequence found
            cached on resume; counted apart from hits.
        bytes_per_token: bytes one token slot takes in the device pool: keys
            and values of every layer, quantization scales included
            (``KVPool.bytes_per_token``; 8192 for 8 heads of 128 float32
            values, 2304 with int8 keys and values).
        view_mode: how the device pool reads fragmented tables: ``"views"``
            (mapped page views) or ``"gather"`` (copied into scratch); see
            docs/paging.md.
        num_view_reads: device pool reads served by a mapped view.
        num_gather_reads: reads of a views pool that gathered instead (sinks,
            a padded batch, the map budget, a refused mapping); each read of
            a views pool counts once, here or in ``num_view_reads``. 0 for a
            gather pool, whose reads are not counted.
        num_view_maps: blocks mapped into views since the pool was made.
        num_view_fallbacks: reads the map budget or the kernel refused (they gathered).
        num_mapped_blocks: blocks mapped into the device pool's views now.
        num_map_areas_used: memory areas page views hold now, across every
            pool of the process (the budget is process-wide).
        map_area_limit: the most areas page views may hold
            (``vm.max_map_count`` less a headroom).
        num_tier_hits: prompt tokens loaded from the tiers below the pool
            (``KVCacheManager(tiers=...)``); also counted in ``num_prefix_hits``.
        num_tier_errors: tier store calls that failed (a server down or slow)
            plus stored values refused (damaged, stale, another layout) plus
            prefetches that raised or were not done at admission: each meant
            recompute, never wrong KV.
    """

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    block_usage: float
    num_live_slots: int
    num_live_tokens: int
    token_occupancy: float
    internal_fragmentation: float
    num_sequences: int
    num_running: int
    num_swapped: int
    num_host_used_blocks: int
    num_forks: int
    num_copy_on_write: int
    num_preemptions: int
    num_swaps_out: int
    num_swaps_in: int
    num_prefix_queries: int
    num_prefix_hits: int
    prefix_hit_rate: float
    num_cached_blocks: int
    num_cached_free_blocks: int
    num_prefix_evictions: int
    num_resumed_reuse_tokens: int
    bytes_per_token: int
    view_mode: str
    num_view_reads: int
    num_gather_reads: int
    num_view_maps: int
    num_view_fallbacks: int
    num_mapped_blocks: int
    num_map_areas_used: int
    map_area_limit: int
    # NOTE: kept out of COUNTERS (which a snapshot saves and requires), so old snapshot files load.
    num_tier_hits: int = 0
    num_tier_errors: int = 0

    def as_dict(self) -> dict[str, float | int | str]:
        """The metrics as a plain dict (for JSON)."""
        return asdict(self)


def collect_metrics(
    pool: KVPool,
    host_pool: KVPool | None,
    records: Iterable[SequenceRecord],
    counts: Mapping[str, int],
) -> ManagerMetrics:
    """The metrics of a manager, from its pools, its sequences' records and its counts.

    Args:
        pool: the device pool.
        host_pool: the host pool, or None.
        records: every sequence's record.
        counts: the manager's event counters (:data:`COUNTERS`), plus
            ``cached_blocks`` (blocks with a prefix key), ``prefix_evictions``
            (prefix keys dropped for reuse so far) and, with tiers,
            ``tier_hits`` and ``tier_errors`` (see :class:`ManagerMetrics`).
    """
    states = [record.state for record in records]
    running = [record.table for record in records if record.state is SequenceState.RUNNING]
    counters = counts
    num_cached_blocks = counts["cached_blocks"]
    num_prefix_evictions = counts["prefix_evictions"]
    num_tier_hits = counts.get("tier_hits", 0)
    num_tier_errors = counts.get("tier_errors", 0)
    bs = pool.block_size
    num_live_slots, _ = count_live_slots(running, pool.allocator)
    used = pool.num_used_blocks
    num_queries = counters["prefix_queries"]
    views, budget = pool.view_stats, map_budget()
    return ManagerMetrics(
        num_blocks=pool.num_blocks,
        num_used_blocks=used,
        num_free_blocks=pool.num_free_blocks,
        block_size=bs,
        block_usage=used / pool.num_blocks,
        num_live_slots=num_live_slots,
        num_live_tokens=sum(table.num_live_tokens for table in running),
        token_occupancy=num_live_slots / (pool.num_blocks * bs),
        internal_fragmentation=(1 - num_live_slots / (used * bs)) if used else 0.0,
        num_sequences=len(states),
        num_running=sum(state is SequenceState.RUNNING for state in states),
        num_swapped=sum(state is SequenceState.SWAPPED for state in states),
        num_host_used_blocks=host_pool.num_used_blocks if host_pool is not None else 0,
        num_forks=counters["forks"],
        num_copy_on_write=counters["copy_on_write"],
        num_preemptions=counters["preemptions"],
        num_swaps_out=counters["swaps_out"],
        num_swaps_in=counters["swaps_in"],
        num_prefix_queries=num_queries,
        num_prefix_hits=counters["prefix_hits"],
        prefix_hit_rate=counters["prefix_hits"] / num_queries if num_queries else 0.0,
        num_cached_blocks=num_cached_blocks,
        num_cached_free_blocks=pool.allocator.num_cached_free_blocks,
        num_prefix_evictions=num_prefix_evictions,
        num_resumed_reuse_tokens=counters["resumed_reuse"],
        bytes_per_token=pool.bytes_per_token,
        view_mode=pool.view_mode,
        num_view_reads=views.num_view_reads,
        num_gather_reads=views.num_gather_reads,
        num_view_maps=views.num_maps,
        num_view_fallbacks=views.num_fallbacks,
        num_mapped_blocks=pool.num_mapped_blocks,
        num_map_areas_used=budget.num_used,
        map_area_limit=budget.limit,
        num_tier_hits=num_tier_hits,
        num_tier_errors=num_tier_errors,
    )
