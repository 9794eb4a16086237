"""PNG figures of a simulation (the ``plot`` extra: ``pip install "pagedkv[plot]"``).

Owns :func:`plot_page_map` (the page map over time), :func:`plot_occupancy` (memory over time,
paged vs contiguous) and :func:`pyplot` / :func:`save_figure`, which every figure module draws
with; matplotlib loads on first use (Agg), else :class:`MissingExtraError` names the extra.
The sweep: :mod:`pagedkv.simulate.plots_sweep`; the tutorial's memory figures:
:mod:`pagedkv.simulate.figures`. Models the PagedAttention paper's memory figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.simulate.pagemap import FREE, SHARED, PageMap
from pagedkv.simulate.result import PolicyResult

__all__ = [
    "MissingExtraError",
    "page_map_states",
    "plot_occupancy",
    "plot_page_map",
    "pyplot",
    "save_figure",
]


class MissingExtraError(PagedKVError, ImportError):
    """An optional dependency (an *extra*) is not installed."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend.

    Raises:
        MissingExtraError: matplotlib is not installed (the message names the extra).
    """
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


def plot_page_map(page_maps: Sequence[PageMap], path: str | Path, *, title: str = "") -> Path:
    """A PNG of the page map over time: one row per page map, one column per block.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no page maps.
    """
    if not page_maps:
        raise ConfigError("no page maps to plot")
    plt = pyplot()
    from matplotlib.patches import Patch

    colors = _request_colors(plt)
    num_blocks = page_maps[0].num_blocks
    image = np.ones((len(page_maps), num_blocks, 3))  # (step row, block, rgb)
    for row, page_map in enumerate(page_maps):
        owned = page_map.owner >= 0
        rgb = colors[page_map.owner[owned] % len(colors)]
        forked = page_map.num_refs[owned] > 1
        rgb[forked] *= 0.55
        image[row, owned] = rgb
        image[row, page_map.owner == SHARED] = _SHARED_RGB
        image[row, (page_map.owner == FREE) & page_map.cached_free] = _CACHED_RGB
    present = page_map_states(page_maps)
    figure, axes = plt.subplots(figsize=(10, 6.2), constrained_layout=True)
    steps = [page_map.step for page_map in page_maps]
    axes.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, num_blocks - 0.5, steps[-1] + 0.5, steps[0] - 0.5),
    )
    axes.set_xlabel(f"block id (pool of {num_blocks} blocks x {page_maps[0].block_size} token slots)")
    axes.set_ylabel("simulation step (time runs down)")
    axes.set_title(title or "Page map over time: which request holds each block")
    swatches = {
        "one": (colors[0], "held by one sequence (a colour per request)"),
        "forks": (colors[0] * 0.55, "shared by a request's forks (darker)"),
        "shared": (_SHARED_RGB, "shared by several requests (prefix cache)"),
        "cached free": (_CACHED_RGB, "cached free (a prefix hit can take it back)"),
        "free": (_FREE_RGB, "free"),
    }
    handles = [
        Patch(facecolor=rgb, edgecolor="0.3", label=label)
        for state, (rgb, label) in swatches.items()
        if state in present  # a legend names only what the picture shows
    ]
    figure.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return save_figure(plt, figure, path)


def page_map_states(page_maps: Sequence[PageMap]) -> set[str]:
    """The block states that occur in ``page_maps``, as :func:`plot_page_map` colours them.

    ``"one"`` (held by one sequence), ``"forks"`` (shared by one request's
    forks), ``"shared"`` (several requests), ``"cached free"`` and ``"free"``.

    >>> from pagedkv.simulate import Budget, Request, SimConfig, Workload
    >>> from pagedkv.simulate.pagemap import capture_page_maps
    >>> maps, _ = capture_page_maps(Workload((Request(0, 6, 2, n=2),)), SimConfig(Budget(16), block_size=4))
    >>> sorted(page_map_states(maps))
    ['forks', 'free', 'one']
    """
    present: set[str] = set()
    for page_map in page_maps:
        owned = page_map.owner >= 0
        free = page_map.owner == FREE
        states = {
            "one": bool(np.any(owned & (page_map.num_refs <= 1))),
            "forks": bool(np.any(owned & (page_map.num_refs > 1))),
            "shared": bool(np.any(page_map.owner == SHARED)),
            "cached free": bool(np.any(free & page_map.cached_free)),
            "free": bool(np.any(free & ~page_map.cached_free)),
        }
        present |= {state for state, occurs in states.items() if occurs}
    return present


def plot_occupancy(
    paged: PolicyResult, contiguous: PolicyResult, path: str | Path, *, title: str = ""
) -> Path:
    """A PNG of memory over time, paged vs contiguous: live tokens, reserved-but-empty, free.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    plt = pyplot()
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
    return save_figure(plt, figure, path)


def save_figure(plt: Any, figure: Any, path: str | Path) -> Path:
    """Write ``figure`` to ``path`` (its folder made if missing) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
