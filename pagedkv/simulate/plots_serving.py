"""PNG figures of the serving study (the ``plot`` extra): latency and preemptions against rate, routers.

:func:`plot_rate_sweep`: normalised latency against request rate, one line per system, one
panel per dataset (the PagedAttention paper's Fig. 12 axes); :func:`plot_schedulers`:
preemptions, recomputed share, latency and throughput against rate, one line per scheduler;
:func:`plot_routers`: a cluster under each router (prefix hits, latency, each replica's
memory, the router's own cost); :func:`serving_figures`: the tutorial's three figures
(``pagedkv viz --png latency,schedulers,routers``, or ``--all``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.simulate.cluster import ClusterResult
from pagedkv.simulate.plots import pyplot, save_figure
from pagedkv.simulate.ratesweep import RatePoint
from pagedkv.simulate.result import PolicyResult

__all__ = ["plot_rate_sweep", "plot_routers", "plot_schedulers", "serving_figures"]

_COLORS = {
    "paged": "#1565c0",
    "contiguous": "#6d4c41",
    "contiguous-pow2": "#ef6c00",
    "contiguous-oracle": "#2e7d32",
}
_LABELS = {
    "paged": "paged (this manager)",
    "contiguous": "reserve max length (Orca (Max))",
    "contiguous-pow2": "reserve power of two (Orca (Pow2))",
    "contiguous-oracle": "reserve exact output (Orca (Oracle))",
}


def _by_system(points: Sequence[RatePoint]) -> dict[str, list[RatePoint]]:
    systems: dict[str, list[RatePoint]] = {}
    for point in points:
        systems.setdefault(point.system, []).append(point)
    return systems


def plot_rate_sweep(
    panels: Mapping[str, Sequence[RatePoint]], path: str | Path, *, title: str = "", y_max: float = 1.0
) -> Path:
    """Normalised latency against request rate: ``{panel title: points}``, one panel each.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no points.
    """
    if not panels or not any(panels.values()):
        raise ConfigError("no rate-sweep points to plot")
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), constrained_layout=True)
    for ax, (name, points) in zip(np.atleast_1d(axes), panels.items()):
        any_off_scale = False
        for system, series in _by_system(points).items():
            rates = np.array([p.rate for p in series])
            latency = np.array([p.result.latency.normalised_mean for p in series])
            label = _LABELS.get(system, system)
            off_scale = latency > y_max
            if off_scale.all():
                label += f": above {y_max:g} at every rate"
            (line,) = ax.plot(rates, latency, "o-", color=_COLORS.get(system), label=label, markersize=4)
            # NOTE: a system whose every point is above y_max would have a legend entry and no line;
            # its points off the scale are drawn as triangles on the top edge instead.
            ax.plot(
                rates[off_scale], np.full(int(off_scale.sum()), y_max), "^",
                color=line.get_color(), markersize=6, clip_on=False, in_layout=False,
            )  # fmt: skip
            any_off_scale |= bool(off_scale.any())
        if any_off_scale:
            ax.plot([], [], "^", color="0.4", label=f"off the scale (above {y_max:g})")
        ax.set_ylim(0, y_max)
        ax.set_xlabel("request rate (requests per model second, Poisson)")
        ax.set_ylabel("normalised latency (s per output token)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(title or "Normalised latency against request rate (same memory for every system)")
    return save_figure(plt, figure, path)


def plot_schedulers(points: Sequence[RatePoint], path: str | Path, *, title: str = "") -> Path:
    """Preemptions, recomputed share of prefill, latency and throughput against rate, per scheduler.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no points.
    """
    if not points:
        raise ConfigError("no scheduler points to plot")
    plt = pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(10.5, 7.6), constrained_layout=True)
    panels: tuple[tuple[Any, str, Callable[[PolicyResult], float]], ...] = (
        (axes[0, 0], "preemptions", lambda r: r.num_preemptions),
        (axes[0, 1], "recomputed share of prefill tokens (%)",
         lambda r: 100 * r.num_recomputed_tokens / max(1, r.num_prefill_tokens)),
        (axes[1, 0], "normalised latency, mean (s per output token)", lambda r: r.latency.normalised_mean),
        (axes[1, 1], "throughput (output tokens per model second)", lambda r: r.latency.tokens_per_s),
    )  # fmt: skip
    for ax, label, value in panels:
        for system, series in _by_system(points).items():
            values = [value(p.result) for p in series]
            ax.plot([p.rate for p in series], values, "o-", label=system, markersize=4)
        ax.set_xlabel("request rate (requests per model second)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(fontsize=8)
    figure.suptitle(title or "Schedulers as choices: the same manager and memory, different decisions")
    return save_figure(plt, figure, path)


def plot_routers(results: Sequence[ClusterResult], path: str | Path, *, title: str = "") -> Path:
    """A cluster under each router: prefix hit rate, latency, per-replica memory, routing cost.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no results.
    """
    if not results:
        raise ConfigError("no router results to plot")
    plt = pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(10.5, 7.4), constrained_layout=True)
    names = [result.router for result in results]
    x = np.arange(len(names))
    bars: list[tuple[Any, str, list[float]]] = [
        (axes[0, 0], "prefix hit rate (% of prompt tokens)", [100 * r.prefix_hit_rate for r in results]),
        (axes[0, 1], "time to first token, mean (model s)", [r.latency.ttft_mean for r in results]),
        (axes[1, 1], "router cost (wall-clock us per decision)", [r.routing_us for r in results]),
    ]
    for ax, label, values in bars:
        ax.bar(x, values, color="#1565c0")
        ax.set_xticks(x, names)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[1, 0]
    num_replicas = len(results[0].replicas)
    width = 0.8 / num_replicas
    for replica in range(num_replicas):
        ax.bar(
            x + (replica - (num_replicas - 1) / 2) * width,
            [100 * r.replicas[replica].occupancy_mean for r in results],
            width,
            label=f"replica {replica}",
        )
    ax.set_xticks(x, names)
    ax.set_ylabel("KV memory holding live tokens, mean (%)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    figure.suptitle(title or f"{num_replicas} replicas behind a router")
    return save_figure(plt, figure, path)


def serving_figures(out_dir: str | Path, kinds: Sequence[str], *, log: Any = print) -> list[Path]:
    """Write the tutorial's serving figures (fixed settings, see ``docs/tutorial.md``).

    Args:
        out_dir: the folder.
        kinds: any of ``"latency"``, ``"schedulers"``, ``"routers"``.
        log: called with a line per file written.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    pyplot()
    from pagedkv.simulate.cluster import run_cluster
    from pagedkv.simulate.config import Budget, ModelShape, SimConfig, parse_bytes
    from pagedkv.simulate.conversations import conversations
    from pagedkv.simulate.ratesweep import DEFAULT_RATES, rate_sweep
    from pagedkv.simulate.scheduler import SCHEDULERS

    out = Path(out_dir)
    config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16)
    baselines = ["paged", "contiguous", "contiguous-pow2", "contiguous-oracle"]
    written = []
    if "latency" in kinds:
        panels = {
            f"{dataset}-like, 2,000 requests, OPT-13B, 12 GiB": rate_sweep(
                dataset, 2000, config, DEFAULT_RATES[dataset], baselines
            )
            for dataset in ("sharegpt", "alpaca")
        }
        written.append(plot_rate_sweep(panels, out / "latency_vs_rate.png"))
        log(f"wrote {written[-1]}")
    if "schedulers" in kinds:
        points = rate_sweep(
            "sharegpt", 1000, config, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0), [f"paged:{name}" for name in SCHEDULERS]
        )
        written.append(
            plot_schedulers(
                points,
                out / "schedulers_vs_rate.png",
                title="Schedulers as choices: 1,000 ShareGPT-like requests, OPT-13B, 12 GiB",
            )
        )
        log(f"wrote {written[-1]}")
    if "routers" in kinds:
        workload = conversations(400, num_turns=4, num_system_prompts=8, system_prompt_len=400, rate=2.0)
        chat = SimConfig(
            Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16, enable_prefix_caching=True
        )
        routers = ["round-robin", "least-loaded", "prefix-aware"]
        results = [run_cluster(workload, chat, 4, name) for name in routers]
        written.append(
            plot_routers(
                results,
                out / "routers.png",
                title="4 replicas, 400 chats of 4 turns under 8 system prompts of 400 tokens, 2 chats/s",
            )
        )
        log(f"wrote {written[-1]}")
    return written
