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

PNG figures (``pip install "pagedkv[plot]"``): the page map over time, memory
occupancy of the paged and the contiguous policy over time, and a block-size
sweep. ``pagedkv viz --all --out docs/images`` regenerates the tutorial's.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.manager import SequenceState
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.result import PolicyResult
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
]

#: ``owner`` of a free block.
FREE = -1
#: ``owner`` of a block several requests share (prefix caching).
SHARED = -2

_LETTERS = string.ascii_lowercase


class MissingExtraError(PagedKVError, ImportError):
    """An optional dependency (an *extra*) is not installed."""


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


# ------------------------------------------------------------------ plots


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError('PNG output needs matplotlib: pip install "pagedkv[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_FREE_RGB = (1.0, 1.0, 1.0)
_CACHED_RGB = (0.78, 0.78, 0.78)
_SHARED_RGB = (0.0, 0.0, 0.0)


def _request_colors(plt: Any) -> npt.NDArray[np.float64]:
    """18 request colours: tab20 without its two greys (grey means cached free)."""
    cmap = plt.get_cmap("tab20")
    colors = np.array([cmap(i)[:3] for i in range(20) if i not in (14, 15)])
    # tab20 alternates dark and light shades; take the dark ones first so that
    # requests with neighbouring ids differ in hue.
    return np.concatenate([colors[0::2], colors[1::2]])


def plot_page_map(snapshots: Sequence[PoolSnapshot], path: str | Path, *, title: str = "") -> Path:
    """A PNG of the page map over time: one row per snapshot, one column per block.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no snapshots.
    """
    if not snapshots:
        raise ConfigError("no snapshots to plot")
    plt = _pyplot()
    from matplotlib.patches import Patch

    colors = _request_colors(plt)
    num_blocks = snapshots[0].num_blocks
    image = np.ones((len(snapshots), num_blocks, 3))
    for row, snap in enumerate(snapshots):
        owned = snap.owner >= 0
        rgb = colors[snap.owner[owned] % len(colors)]
        forked = snap.num_refs[owned] > 1
        rgb[forked] *= 0.55
        image[row, owned] = rgb
        image[row, snap.owner == SHARED] = _SHARED_RGB
        image[row, (snap.owner == FREE) & snap.cached_free] = _CACHED_RGB
    figure, axes = plt.subplots(figsize=(10, 6.2), constrained_layout=True)
    steps = [snap.step for snap in snapshots]
    axes.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, num_blocks - 0.5, steps[-1] + 0.5, steps[0] - 0.5),
    )
    axes.set_xlabel(f"block id (pool of {num_blocks} blocks x {snapshots[0].block_size} token slots)")
    axes.set_ylabel("simulation step (time runs down)")
    axes.set_title(title or "Page map over time: which request holds each block")
    handles = [
        Patch(facecolor=colors[0], edgecolor="0.3", label="held by one sequence (a colour per request)"),
        Patch(facecolor=colors[0] * 0.55, edgecolor="0.3", label="shared by a request's forks (darker)"),
        Patch(facecolor=_SHARED_RGB, edgecolor="0.3", label="shared by several requests (prefix cache)"),
        Patch(facecolor=_CACHED_RGB, edgecolor="0.3", label="cached free (a prefix hit can take it back)"),
        Patch(facecolor=_FREE_RGB, edgecolor="0.3", label="free"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return _save(plt, figure, path)


def plot_occupancy(
    paged: PolicyResult, contiguous: PolicyResult, path: str | Path, *, title: str = ""
) -> Path:
    """A PNG of memory over time, paged vs contiguous: live tokens, reserved-but-empty, free.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(
        3, 1, figsize=(10, 8.2), sharex=True, constrained_layout=True, height_ratios=[3, 3, 2]
    )
    last = max(paged.series.steps[-1] if paged.series.steps else 0, contiguous.series.steps[-1])
    for ax, result in zip(axes[:2], (paged, contiguous)):
        series = result.series
        steps = np.array(series.steps)
        live = 100 * np.array(series.live)
        unfilled = 100 * np.array(series.unfilled)
        never = 100 * np.array(series.never_used)
        later = unfilled - never
        layers = [live, later, never]
        labels = ["live tokens", "reserved for tokens not written yet", "reserved, never to be used"]
        palette = ["#2e7d32", "#ffb74d", "#e53935"]
        if result.policy == "paged":
            layers, labels, palette = (
                [live, unfilled],
                ["live tokens", "empty slots of held blocks"],
                [
                    "#2e7d32",
                    "#ffb74d",
                ],
            )
        ax.stackplot(steps, *layers, labels=labels, colors=palette, linewidth=0)
        ax.set_xlim(0, last)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of KV memory")
        ax.set_title(
            f"{result.policy}: live tokens fill {100 * result.occupancy_mean:.1f}% of memory on average "
            f"({100 * result.occupancy_loaded_mean:.1f}% while requests wait); "
            f"done in {result.num_steps:,} steps",
            fontsize=10,
        )
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
        ax.grid(alpha=0.3)
    for result, color in ((paged, "#1565c0"), (contiguous, "#6d4c41")):
        axes[2].plot(
            result.series.steps, result.series.num_seqs, color=color, label=result.policy, linewidth=1
        )
    axes[2].set_ylabel("sequences running")
    axes[2].set_xlabel("simulation step (one forward pass each)")
    axes[2].legend(loc="upper right", fontsize=8)
    axes[2].grid(alpha=0.3)
    figure.suptitle(title or "KV memory over time: paged blocks vs contiguous up-front reservation")
    return _save(plt, figure, path)


def plot_sweep(rows: Sequence[Any], path: str | Path, *, title: str = "") -> Path:
    """A PNG of a block-size sweep (rows from :func:`pagedkv.simulate.sweep`).

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no paged rows.
    """
    paged = [row for row in rows if row.block_size]
    baseline = [row for row in rows if not row.block_size]
    if not paged:
        raise ConfigError("the sweep has no paged rows to plot")
    plt = _pyplot()
    sizes = [row.block_size for row in paged]
    results = [row.result for row in paged]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7.2), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(
        sizes,
        [100 * r.occupancy_loaded_mean for r in results],
        "o-",
        color="#2e7d32",
        label="live tokens (mean while requests wait)",
    )
    ax.plot(
        sizes,
        [100 * r.waste_of_used_mean for r in results],
        "s-",
        color="#e53935",
        label="empty slots in held blocks (% of held)",
    )
    if baseline:
        ax.axhline(
            100 * baseline[0].result.occupancy_loaded_mean,
            color="#6d4c41",
            linestyle="--",
            label=f"{baseline[0].result.policy}: live tokens",
        )
    ax.set_ylabel("% of KV memory")
    ax.set_title("memory: small blocks waste less", fontsize=10)
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    ax.plot(sizes, [r.num_seqs_mean for r in results], "o-", color="#1565c0", label="mean")
    ax.set_ylabel("sequences running (mean)")
    ax.set_title("batch size the memory allows", fontsize=10)
    if baseline:
        ax.axhline(
            baseline[0].result.num_seqs_mean, color="#6d4c41", linestyle="--", label=baseline[0].result.policy
        )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    ax.plot(sizes, [100 * r.prefix_hit_rate for r in results], "o-", color="#6a1b9a")
    ax.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    ax.set_title("sharing: only full blocks can be shared", fontsize=10)
    ax.set_ylim(0, 100)
    ax = axes[1, 1]
    ax.plot(sizes, [r.timing()["simulated_tokens_per_cpu_s"] / 1e3 for r in results], "o-", color="#00838f")
    ax.set_ylabel("simulated k tokens per CPU second")
    ax.set_title("this simulator's bookkeeping speed (higher is cheaper)", fontsize=10)
    ax.set_ylim(bottom=0)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (token slots per block)")
        ax.grid(alpha=0.3)
    figure.suptitle(title or "The block-size trade-off (same memory at every point)")
    return _save(plt, figure, path)


def _save(plt: Any, figure: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# -------------------------------------------------------------- tutorial


def tutorial_figures(out_dir: str | Path, *, log: Any = print) -> list[Path]:
    """Write the tutorial's figures (fixed settings, see ``docs/tutorial.md``) into ``out_dir``.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    _pyplot()
    from pagedkv.simulate import Budget, ModelShape, SimConfig, parse_bytes, run_policy, sweep, synthetic

    out = Path(out_dir)
    written = []
    # 1. The page map over time: Alpaca-like requests arriving, two system prompts, prefix caching.
    workload = synthetic("alpaca", 30, seed=0, num_prefix_groups=2, prefix_len=12, arrival_rate=0.4)
    config = SimConfig(Budget.from_blocks(96, 4), block_size=4, enable_prefix_caching=True)
    snapshots, _ = capture(workload, config)
    written.append(
        plot_page_map(
            snapshots,
            out / "pagemap.png",
            title="Page map over time: 30 Alpaca-like requests arriving, 2 system "
            "prompts, prefix caching (96 blocks x 4)",
        )
    )
    log(f"wrote {written[-1]}")
    # 1b. Forks: parallel sampling n=4.
    workload = synthetic("alpaca", 16, seed=0, n=4, sampling="beam")
    config = SimConfig(Budget.from_blocks(96, 4), block_size=4)
    snapshots, _ = capture(workload, config)
    written.append(
        plot_page_map(
            snapshots,
            out / "pagemap_beam.png",
            title="Page map over time: 16 Alpaca-like requests, beam-like search "
            "with 4 beams (96 blocks x 4)",
        )
    )
    log(f"wrote {written[-1]}")
    # 2. Occupancy over time: ShareGPT-like, OPT-13B, 12 GiB.
    workload = synthetic("sharegpt", 300, seed=0)
    config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16)
    paged = run_policy("paged", workload, config)
    contiguous = run_policy("contiguous", workload, config)
    written.append(
        plot_occupancy(
            paged,
            contiguous,
            out / "occupancy.png",
            title="KV memory over time: 300 ShareGPT-like requests, OPT-13B, 12 GiB of KV memory",
        )
    )
    log(f"wrote {written[-1]}")
    # 3. The block-size sweep, with a shared 100-token system prompt and prefix caching.
    workload = synthetic("sharegpt", 300, seed=0, num_prefix_groups=1, prefix_len=100)
    config = SimConfig(
        Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16, enable_prefix_caching=True
    )
    rows = sweep(workload, config, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    written.append(
        plot_sweep(
            rows,
            out / "block_size_sweep.png",
            title="The block-size trade-off: 300 ShareGPT-like requests sharing a "
            "100-token system prompt, 12 GiB",
        )
    )
    log(f"wrote {written[-1]}")
    return written


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
    _pyplot()
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
