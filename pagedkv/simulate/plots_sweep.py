"""The block-size sweep as a PNG, both sides: memory from the simulation, kernel time as measured.

Owns :func:`plot_sweep` (the ``plot`` extra, as :mod:`pagedkv.simulate.plots`): six panels,
memory beside the measured kernel. Models the PagedAttention paper's block-size figure
(§7.2, Figure 18b). The panel layout: docs/simulate.md, "The kernel side of the block-size sweep".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.kernel import KernelCost
from pagedkv.simulate.plots import pyplot, save_figure
from pagedkv.simulate.report import SweepRow
from pagedkv.simulate.sweep_kernel import kernel_rows

__all__ = ["plot_sweep"]

_METHODS = (("gather", "#e53935", "s-"), ("views", "#1565c0", "o-"), ("contiguous", "#2e7d32", "^--"))


def _log2_axis(ax: Any, sizes: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("block size (token slots per block)")
    ax.grid(alpha=0.3)


def _no_kernel(ax: Any) -> None:
    ax.text(0.5, 0.5, "no kernel cost given\n(--kernel-cost PATH)", ha="center", va="center", fontsize=10)
    ax.set_axis_off()


def _memory_panels(axes: Any, paged: Sequence[SweepRow], baseline: Sequence[SweepRow]) -> None:
    sizes = [row.block_size for row in paged]
    results = [row.result for row in paged]
    base = baseline[0].result if baseline else None
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
    if base is not None:
        ax.axhline(
            100 * base.occupancy_loaded_mean,
            color="#6d4c41",
            linestyle="--",
            label=f"{base.policy}: live tokens",
        )
    ax.set_ylabel("% of KV memory")
    ax.set_title("memory: small blocks waste less", fontsize=10)
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    ax = axes[0, 2]
    ax.plot(sizes, [r.num_seqs_mean for r in results], "o-", color="#1565c0", label="mean")
    if base is not None:
        ax.axhline(base.num_seqs_mean, color="#6d4c41", linestyle="--", label=base.policy)
    ax.set_ylabel("sequences running (mean)")
    ax.set_title("batch size the memory allows", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    ax.plot(sizes, [100 * r.prefix_hit_rate for r in results], "o-", color="#6a1b9a")
    ax.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    ax.set_title("sharing: only full blocks can be shared", fontsize=10)
    ax.set_ylim(0, 100)
    ax = axes[1, 2]
    ax.plot(sizes, [r.timing()["simulated_tokens_per_cpu_s"] / 1e3 for r in results], "o-", color="#00838f")
    ax.set_ylabel("simulated k tokens per CPU second")
    ax.set_title("this simulator's bookkeeping speed (higher is cheaper)", fontsize=10)
    ax.set_ylim(bottom=0)
    for ax in (axes[0, 0], axes[0, 2], axes[1, 0], axes[1, 2]):
        _log2_axis(ax, sizes)


def _kernel_panels(axes: Any, paged: Sequence[SweepRow], kernel: KernelCost) -> None:
    ax = axes[0, 1]
    sizes = kernel.block_sizes
    times = {
        "gather": [p.gather_ms for p in kernel.points],
        "views": [p.view_ms for p in kernel.points],
        "contiguous": [p.contiguous_ms for p in kernel.points],
    }
    for name, color, style in _METHODS:
        ax.plot(sizes, times[name], style, color=color, label=name)
    ax.set_ylabel("ms per attention call (measured)")
    ax.set_title("kernel: attention time per call (CPU, measured)", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, title=kernel.machine, title_fontsize=6)
    _log2_axis(ax, sizes)
    ax = axes[1, 1]
    measured = [row for row in kernel_rows(paged, kernel) if row.point is not None]
    if not measured:
        ax.text(0.5, 0.5, "no block size of the sweep\nwas measured", ha="center", va="center")
        ax.set_axis_off()
        return
    steps = [row.block_size for row in measured]
    factors = [row.step_factors() or (1.0, 1.0) for row in measured]
    ax.plot(steps, [f[0] for f in factors], "s-", color="#e53935", label="gather")
    ax.plot(steps, [f[1] for f in factors], "o-", color="#1565c0", label="views")
    ax.axhline(1.0, color="#2e7d32", linestyle="--", label="contiguous")
    share = sum(row.attention_share for row in measured) / len(measured)
    ax.set_ylabel("step time / with a contiguous kernel")
    ax.set_title(
        f"what-if: KV reads are {100 * share:.0f}% of busy time (cost model),\n"
        "stretched by the CPU's measured ratio",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    _log2_axis(ax, steps)


def plot_sweep(
    rows: Sequence[SweepRow], path: str | Path, *, kernel: KernelCost | None = None, title: str = ""
) -> Path:
    """A PNG of a block-size sweep (rows from :func:`pagedkv.simulate.sweep`), with the kernel side.

    Args:
        rows: the sweep's rows (a baseline row, block size 0, draws a dashed line).
        path: the PNG to write.
        kernel: the measured kernel cost (:mod:`pagedkv.simulate.kernel`);
            None leaves its panels empty, saying so.
        title: the figure's title.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no paged rows.
    """
    paged = [row for row in rows if row.block_size]
    baseline = [row for row in rows if not row.block_size]
    if not paged:
        raise ConfigError("the sweep has no paged rows to plot")
    plt = pyplot()
    figure, axes = plt.subplots(2, 3, figsize=(15, 7.6), constrained_layout=True)
    _memory_panels(axes, paged, baseline)
    if kernel is None:
        _no_kernel(axes[0, 1])
        _no_kernel(axes[1, 1])
    else:
        _kernel_panels(axes, paged, kernel)
    figure.suptitle(title or "The block-size trade-off: memory (same memory at every point) and kernel time")
    return save_figure(plt, figure, path)
