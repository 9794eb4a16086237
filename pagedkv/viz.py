"""Pictures of the pool: text page maps for the terminal, PNGs with the ``plot`` extra.

A *page map* shows every block of the pool at one step of a simulation: which
request holds it, whether several sequences share it, whether it is a cached
free block a prefix hit can take back, or free. Six Alpaca-like requests with
two samples each and a shared 8-token system prompt, on 24 blocks of 4 slots:

>>> from pagedkv.simulate import Budget, SimConfig, synthetic
>>> workload = synthetic("alpaca", 6, seed=0, n=2, num_prefix_groups=1, prefix_len=8)
>>> config = SimConfig(Budget(96), block_size=4, enable_prefix_caching=True)
>>> snapshots, _ = capture(workload, config, [0, 4])
>>> for snap in snapshots:
...     print(page_map_text(snap, legend=False))
step 0: 24 blocks x 4 slots; 22 used (22 shared), 0 cached free, 2 free; 81 live tokens = 84.4%
  block  0         10        20
         012345678901234567890123
  owner  ##AAAAABBBBCCCCCCDDDDD..
  fill   ======-===-==========-
  requests a=#0 b=#1 c=#2 d=#3
step 4: 24 blocks x 4 slots; 17 used (9 shared), 7 cached free, 0 free; 60 live tokens = 62.5%
  block  0         10        20
         012345678901234567890123
  owner  ##AAAAaBBBb+++++++bbaaab
  fill   ===========       ----==
  requests a=#0 b=#1

``a``-``z``: a request's block (one letter per request, ``request_id % 26``);
``A``-``Z``: shared by that request's samples (forks); ``#``: shared by
several requests (the system prompt, through the prefix cache); ``+``: cached
free; ``.``: free. Fill: ``=`` full, ``-`` partly filled. At step 4 requests
2 and 3 were preempted: their blocks are cached free, and the samples of
requests 0 and 1 have diverged (copy-on-write) into blocks of their own.

PNG figures (``pip install "pagedkv[plot]"``, :mod:`pagedkv.simulate.plots`):
the page map over time, memory occupancy of the paged and the contiguous
policy over time, and a block-size sweep. ``pagedkv viz --all --out
docs/images`` regenerates the tutorial's. Snapshots come from
:mod:`pagedkv.simulate.snapshot`; this module re-exports both.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from pathlib import Path

from pagedkv.errors import ConfigError
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.plots import (
    MissingExtraError,
    plot_occupancy,
    plot_page_map,
    plot_sweep,
    pyplot,
    tutorial_figures,
)
from pagedkv.simulate.snapshot import FREE, SHARED, PoolSnapshot, capture, snapshot
from pagedkv.simulate.workload import Workload

__all__ = [
    "FREE",
    "SHARED",
    "MissingExtraError",
    "PoolSnapshot",
    "capture",
    "page_map_text",
    "plot_occupancy",
    "plot_page_map",
    "plot_sweep",
    "run_viz",
    "snapshot",
    "tutorial_figures",
]

_LETTERS = string.ascii_lowercase


# ------------------------------------------------------------------- text


def _labels(snap: PoolSnapshot) -> dict[int, str]:
    """A letter per request present: ``request_id % 26``, the same in every snapshot.

    If two requests present share that letter, the snapshot letters its
    requests in order instead (still cycling after 26).
    """
    requests = sorted({int(r) for r in snap.owner if r >= 0})
    labels = {request_id: _LETTERS[request_id % 26] for request_id in requests}
    if len(set(labels.values())) < len(labels):
        labels = {request_id: _LETTERS[i % 26] for i, request_id in enumerate(requests)}
    return labels


def page_map_text(snap: PoolSnapshot, width: int = 64, *, legend: bool = True) -> str:
    """A text page map of one snapshot, ``width`` blocks per row.

    Args:
        snap: from :func:`snapshot` or :func:`capture`.
        width: blocks per row.
        legend: append the legend and the letter of each request.
    """
    labels = _labels(snap)
    cells, fills = [], []
    bs = snap.block_size
    for block_id in range(snap.num_blocks):
        owner = int(snap.owner[block_id])
        if owner == FREE:
            cells.append("+" if snap.cached_free[block_id] else ".")
            fills.append(" ")
            continue
        if owner == SHARED:
            cells.append("#")
        else:
            letter = labels[owner]
            cells.append(letter.upper() if snap.num_refs[block_id] > 1 else letter)
        fills.append("=" if snap.num_live[block_id] == bs else "-")
    used = int((snap.owner != FREE).sum())
    shared = int((snap.num_refs > 1).sum())
    cached = int(snap.cached_free.sum())
    live = int(snap.num_live.sum())
    capacity = snap.num_blocks * bs
    lines = [
        f"step {snap.step}: {snap.num_blocks} blocks x {bs} slots; {used} used ({shared} shared), "
        f"{cached} cached free, {snap.num_blocks - used - cached} free; {live} live tokens = "
        f"{100 * live / capacity:.1f}%"
    ]
    for start in range(0, snap.num_blocks, width):
        end = min(start + width, snap.num_blocks)
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


# -------------------------------------------------------------------- CLI


def _auto_steps(num_steps: int) -> list[int]:
    """Four moments: the first step, two in the middle, near the end."""
    return sorted({0, num_steps // 4, num_steps // 2, max(0, num_steps - 2)})


def run_viz(args: argparse.Namespace) -> int:
    """Run ``pagedkv viz``; return the exit status (2 on bad input or a missing extra)."""
    from pagedkv.simulate.command import stdout_closed

    try:
        return _run_viz(args)
    except BrokenPipeError:
        return stdout_closed()


def _run_viz(args: argparse.Namespace) -> int:
    from pagedkv.simulate.command import build_config, build_workload, parse_list
    from pagedkv.simulate.config import BudgetError
    from pagedkv.simulate.workload import WorkloadError

    try:
        if args.all:
            tutorial_figures(args.out)
            return 0
        workload = build_workload(args)
        config, _ = build_config(args)
        if args.png:
            return _png(args, workload, config)
        steps = parse_list(args.steps, name="--steps", minimum=0) if args.steps else None
        if steps is None:
            num_steps = PagedEngine(workload, config).run().num_steps
            steps = _auto_steps(num_steps)
        snapshots, result = capture(workload, config, steps)
    except (WorkloadError, BudgetError, ConfigError, MissingExtraError) as error:
        print(f"pagedkv viz: error: {error}", file=sys.stderr)
        return 2
    stats = workload.stats()
    print(
        f"pagedkv viz: {stats['source']}, seed {stats['seed']}; {config.num_blocks} blocks x "
        f"{config.block_size} slots, prefix caching {'on' if config.enable_prefix_caching else 'off'}; "
        f"the run took {result.num_steps} steps\n"
    )
    for index, snap in enumerate(snapshots):
        print(page_map_text(snap, args.width, legend=index == len(snapshots) - 1))
        print()
    missing = sorted(set(steps) - {snap.step for snap in snapshots})
    if missing:
        print(f"(no step {', '.join(map(str, missing))}: the run ended after step {result.num_steps - 1})")
    return 0


def _png(args: argparse.Namespace, workload: Workload, config: SimConfig) -> int:
    from pagedkv.simulate.report import run_policy, sweep

    kinds = ["pagemap", "occupancy", "sweep"] if args.png == "all" else args.png.split(",")
    unknown = sorted(set(kinds) - {"pagemap", "occupancy", "sweep"})
    if unknown:
        raise ConfigError(f"--png: unknown picture {unknown[0]!r}; expected pagemap, occupancy, sweep or all")
    pyplot()
    out = Path(args.out)
    for kind in kinds:
        if kind == "pagemap":
            snapshots, _ = capture(workload, config)
            path = plot_page_map(snapshots, out / "pagemap.png")
        elif kind == "occupancy":
            paged = run_policy("paged", workload, config)
            contiguous = run_policy("contiguous", workload, config)
            path = plot_occupancy(paged, contiguous, out / "occupancy.png")
        else:
            rows = sweep(workload, config, [1, 2, 4, 8, 16, 32, 64, 128, 256])
            path = plot_sweep(rows, out / "block_size_sweep.png")
        print(f"wrote {os.fspath(path)}")
    return 0
