"""Snapshots of the pool during a paged simulation: who holds each block, shared, cached, free.

:func:`capture` runs the paged policy and takes a :class:`PoolSnapshot` at
chosen steps; ``pagedkv.viz`` draws them as text, ``pagedkv.simulate.plots``
as PNGs.

>>> from pagedkv.simulate import Budget, Request, SimConfig, Workload
>>> snaps, _ = capture(Workload((Request(0, 6, 2, n=2),)), SimConfig(Budget(16), block_size=4), [0])
>>> snaps[0].owner.tolist(), snaps[0].num_refs.tolist(), snaps[0].num_live.tolist()
([0, 0, -1, -1], [2, 2, 0, 0], [4, 2, 0, 0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv.manager import SequenceState
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.workload import Workload

__all__ = ["FREE", "SHARED", "PoolSnapshot", "capture", "snapshot"]

#: ``owner`` of a free block.
FREE = -1
#: ``owner`` of a block several requests share (prefix caching).
SHARED = -2


@dataclass(frozen=True)
class PoolSnapshot:
    """Every block of a pool at one step.

    Attributes:
        step: the simulation step.
        block_size: slots per block.
        owner: ``(num_blocks,)`` request id holding each block, ``FREE`` or ``SHARED``.
        num_refs: ``(num_blocks,)`` ref counts (sequences holding each block).
        num_live: ``(num_blocks,)`` live token slots in each block.
        cached_free: ``(num_blocks,)`` whether a free block is still cached.
    """

    step: int
    block_size: int
    owner: npt.NDArray[np.int64]
    num_refs: npt.NDArray[np.int64]
    num_live: npt.NDArray[np.int64]
    cached_free: npt.NDArray[np.bool_]

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self.owner)


def snapshot(engine: PagedEngine) -> PoolSnapshot:
    """The pool of ``engine``'s manager as it is now (a copy)."""
    manager = engine.manager
    allocator = manager.pool.allocator
    bs = manager.pool.block_size
    num_blocks = manager.pool.num_blocks
    owner = np.full(num_blocks, FREE, np.int64)
    num_live = np.zeros(num_blocks, np.int64)
    for seq_id in manager.seq_ids:
        if manager.state(seq_id) is not SequenceState.RUNNING:
            continue
        request_id = engine.seq_owner[seq_id]
        table = manager.block_table(seq_id)
        for index, block_id in enumerate(table.block_ids):
            base = (table.first_block_index + index) * bs
            live = min(bs, table.num_tokens - base) - max(0, table.window_start - base)
            num_live[block_id] = max(num_live[block_id], live)
            held = owner[block_id]
            owner[block_id] = request_id if held in (FREE, request_id) else SHARED
    num_refs = np.array([allocator.ref_count(b) for b in range(num_blocks)], np.int64)
    cached_free = np.zeros(num_blocks, np.bool_)
    cached_free[allocator.cached_free_block_ids()] = True
    return PoolSnapshot(engine.step, bs, owner, num_refs, num_live, cached_free)


def capture(
    workload: Workload,
    config: SimConfig,
    steps: Sequence[int] | None = None,
    *,
    max_snapshots: int = 400,
) -> tuple[list[PoolSnapshot], PolicyResult]:
    """Run the paged policy and take snapshots of the pool.

    Args:
        workload: the requests.
        config: the simulation settings.
        steps: the steps to snapshot; None takes every step (thinned to at
            most ``max_snapshots`` evenly spaced ones after the run).
        max_snapshots: the most snapshots kept when ``steps`` is None.

    Returns:
        The snapshots in step order, and the run's result.
    """
    wanted = None if steps is None else set(steps)
    taken: list[PoolSnapshot] = []

    def observe(engine: PagedEngine) -> None:
        if wanted is None or engine.step in wanted:
            taken.append(snapshot(engine))

    result = PagedEngine(workload, config).run(observer=observe)
    if wanted is None and len(taken) > max_snapshots:
        keep = np.linspace(0, len(taken) - 1, max_snapshots).round().astype(int)
        taken = [taken[i] for i in sorted(set(keep.tolist()))]
    return taken, result
