"""Page maps: who holds each block of the pool at one step of a paged simulation.

:func:`capture_page_maps` runs the paged policy and takes a :class:`PageMap` at chosen
steps; :func:`page_map_text` draws one for the terminal (``pagedkv viz``),
:mod:`pagedkv.simulate.plots` as PNGs. No vLLM counterpart (a teaching view of the
pool); the legend, a worked example and the arrays: docs/simulate.md, "Page maps".
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv import SequenceState
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.workload import Workload

__all__ = ["FREE", "SHARED", "PageMap", "capture_page_maps", "page_map_text", "take_page_map"]

#: ``owner`` of a free block.
FREE = -1
#: ``owner`` of a block several requests share (prefix caching).
SHARED = -2

_LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class PageMap:
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


def take_page_map(engine: PagedEngine) -> PageMap:
    """The page map of ``engine``'s pool as it is now (arrays of its own)."""
    manager = engine.manager
    allocator = manager.pool.allocator
    bs = manager.pool.block_size
    num_blocks = manager.pool.num_blocks
    owner = np.full(num_blocks, FREE, np.int64)
    # Bit ``o`` of ``live_masks[b]``: offset ``o`` of block ``b`` is live for some table.
    live_masks = [0] * num_blocks
    full = (1 << bs) - 1
    for seq_id in manager.seq_ids:
        if manager.state(seq_id) is not SequenceState.RUNNING:
            continue
        request_id = engine.seq_owner[seq_id]
        table = manager.block_table(seq_id)
        for block_id in table.block_ids:
            held = owner[block_id]
            owner[block_id] = request_id if held in (FREE, request_id) else SHARED
        whole, masks = table.live_blocks()
        for block_id in whole:
            live_masks[block_id] = full
        for block_id, mask in masks.items():
            live_masks[block_id] |= mask
    num_live = np.array([mask.bit_count() for mask in live_masks], np.int64)
    num_refs = np.array([allocator.ref_count(b) for b in range(num_blocks)], np.int64)
    cached_free = np.zeros(num_blocks, np.bool_)
    cached_free[allocator.cached_free_block_ids()] = True
    return PageMap(engine.step, bs, owner, num_refs, num_live, cached_free)


def capture_page_maps(
    workload: Workload,
    config: SimConfig,
    steps: Sequence[int] | None = None,
    *,
    max_page_maps: int = 400,
) -> tuple[list[PageMap], PolicyResult]:
    """Run the paged policy and take page maps of the pool.

    Args:
        workload: the requests.
        config: the simulation settings.
        steps: the steps to map; None takes every step (thinned to at most
            ``max_page_maps`` evenly spaced ones after the run).
        max_page_maps: the most page maps kept when ``steps`` is None.

    Returns:
        The page maps in step order, and the run's result.
    """
    wanted = None if steps is None else set(steps)
    taken: list[PageMap] = []

    def observe(engine: PagedEngine) -> None:
        if wanted is None or engine.step in wanted:
            taken.append(take_page_map(engine))

    result = PagedEngine(workload, config).run(observer=observe)
    if wanted is None and len(taken) > max_page_maps:
        keep = np.linspace(0, len(taken) - 1, max_page_maps).round().astype(int)
        taken = [taken[i] for i in sorted(set(keep.tolist()))]
    return taken, result


def _labels(page_map: PageMap) -> dict[int, str]:
    """A letter per request present: ``request_id % 26``, the same in every page map.

    If two requests present share that letter, the page map letters its
    requests in order instead (still cycling after 26).
    """
    requests = sorted({int(r) for r in page_map.owner if r >= 0})
    labels = {request_id: _LETTERS[request_id % 26] for request_id in requests}
    if len(set(labels.values())) < len(labels):
        labels = {request_id: _LETTERS[i % 26] for i, request_id in enumerate(requests)}
    return labels


def page_map_text(page_map: PageMap, width: int = 64, *, legend: bool = True) -> str:
    """A page map as text, ``width`` blocks per row.

    Args:
        page_map: from :func:`take_page_map` or :func:`capture_page_maps`.
        width: blocks per row.
        legend: append the legend and the letter of each request.
    """
    labels = _labels(page_map)
    cells, fills = [], []
    bs = page_map.block_size
    for block_id in range(page_map.num_blocks):
        owner = int(page_map.owner[block_id])
        if owner == FREE:
            cells.append("+" if page_map.cached_free[block_id] else ".")
            fills.append(" ")
            continue
        if owner == SHARED:
            cells.append("#")
        else:
            letter = labels[owner]
            cells.append(letter.upper() if page_map.num_refs[block_id] > 1 else letter)
        fills.append("=" if page_map.num_live[block_id] == bs else "-")
    num_blocks = page_map.num_blocks
    used = int((page_map.owner != FREE).sum())
    shared = int((page_map.num_refs > 1).sum())
    cached = int(page_map.cached_free.sum())
    live = int(page_map.num_live.sum())
    lines = [
        f"step {page_map.step}: {num_blocks} blocks x {bs} slots; {used} used ({shared} shared), "
        f"{cached} cached free, {num_blocks - used - cached} free; {live} live tokens = "
        f"{100 * live / (num_blocks * bs):.1f}%"
    ]
    for start in range(0, num_blocks, width):
        end = min(start + width, num_blocks)
        ruler = [" "] * (end - start + 4)
        for i in range(start + (-start) % 10, end, 10):
            ruler[i - start : i - start + len(str(i))] = str(i)
        ones = "".join(str(i % 10) for i in range(start, end))
        lines += [
            f"  block  {''.join(ruler)}".rstrip(),
            f"         {ones}",
            f"  owner  {''.join(cells[start:end])}",
            f"  fill   {''.join(fills[start:end])}".rstrip(),
        ]
    if labels:
        shown = " ".join(f"{letter}=#{request_id}" for request_id, letter in list(labels.items())[:26])
        lines.append(f"  requests {shown}")
    if legend:
        lines.append(
            "  a-z: a request's block (one letter per request); A-Z: shared by its samples (forks);\n"
            "  #: shared by several requests (prefix cache); +: cached free; .: free;"
            " fill: = full, - partly filled"
        )
    return "\n".join(lines)
