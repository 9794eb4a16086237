"""The manager's state seen from outside: metrics, invariant checks, and the snapshot hooks.

:class:`ManagerReports` is a mixin of ``KVCacheManager``: these methods read
(or, for a snapshot load, fill) the manager's records, counters and prefix
cache, and live here apart from the commands that change them.
"""

from __future__ import annotations

from typing import NoReturn

from pagedkv.errors import refuse_pickling
from pagedkv.locking import locked
from pagedkv.manager.metrics import ManagerMetrics, collect_metrics
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.manager.sequence import ManagerState, SequenceRecord, SequenceRegistry, SequenceState
from pagedkv.memory.pool import KVPool

__all__ = ["ManagerReports"]


class ManagerReports:
    """Metrics, invariants and the snapshot hooks of a manager (mixed into the manager)."""

    pool: KVPool
    host_pool: KVPool | None
    num_sink_tokens: int
    _seqs: SequenceRegistry
    _sharing: PrefixSharing | None
    _counters: dict[str, int]
    _max_abs_key: list[float]

    # -------------------------------------------------------------- reporting

    @locked
    def metrics(self) -> ManagerMetrics:
        """A snapshot of usage, occupancy, fragmentation and event counts."""
        cache = self._sharing.cache if self._sharing is not None else None
        return collect_metrics(
            self.pool,
            self.host_pool,
            [record.state for record in self._seqs.values()],
            [record.table for record in self._seqs.values() if record.state is SequenceState.RUNNING],
            self._counters,
            num_cached_blocks=cache.num_cached_blocks if cache else 0,
            num_prefix_evictions=cache.num_evictions if cache else 0,
        )

    @locked
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self.pool.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        if self._sharing is not None:
            self._sharing.cache.check_invariants()
            self._sharing.stats.check_invariants()
            self._sharing.check_invariants(self._seqs.values())
        self._seqs.check_invariants(keyed=self._sharing is not None, has_host_pool=self.host_pool is not None)

    # ------------------------------------------------------- internal hooks

    def __reduce__(self) -> NoReturn:
        refuse_pickling(self)

    def _export_state(self) -> ManagerState:
        """Everything of this manager that its configuration and pools do not say (copies).

        With ``_restore_state`` this is the manager's internal hook for
        :mod:`pagedkv.snapshot`; no other module reads its private fields.
        """
        cache = self._sharing.cache if self._sharing is not None else None
        keys, num_evictions = cache._export_state() if cache is not None else ([], 0)
        return ManagerState(
            max_abs_key=list(self._max_abs_key),
            counters=dict(self._counters),
            records=[record.export_state() for record in self._seqs.values()],
            prefix_keys=keys,
            num_prefix_evictions=num_evictions,
        )

    def _restore_state(self, state: ManagerState) -> None:
        """Take ``state`` into this new, empty manager whose pools' allocators are already restored.

        The caller (a snapshot load) has validated ``state`` against the pools.
        """
        if self._sharing is not None:
            self._sharing.cache._restore_state(state.prefix_keys, state.num_prefix_evictions)
        self._max_abs_key = list(state.max_abs_key)
        self._counters.update(state.counters)
        bs = self.pool.block_size
        for record_state in state.records:
            record = SequenceRecord.from_state(record_state, bs, self.num_sink_tokens)
            self._seqs[record.seq_id] = record
