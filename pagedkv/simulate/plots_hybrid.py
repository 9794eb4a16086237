"""The hybrid-model figure (the ``plot`` extra): KV-cache groups against uniform allocation.

:func:`plot_hybrid` draws memory per request against context length and
latency against request rate for each study; :func:`hybrid_figure` runs the
fixed settings of docs/study.md (``pagedkv viz --png hybrid``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedkv.errors import ConfigError
from pagedkv.simulate.hybrid import ALLOCATIONS, HYBRID_PRESETS, HYBRID_RATES, HybridStudy, hybrid_study
from pagedkv.simulate.plots import pyplot, save_figure

__all__ = ["hybrid_figure", "plot_hybrid"]

_COLORS = {"gemma3-27b-like": "#1565c0", "gpt-oss-like": "#ef6c00"}
_STYLES = {"grouped": "-", "uniform": "--"}


def plot_hybrid(studies: Sequence[HybridStudy], path: str | Path, *, title: str = "") -> Path:
    """Memory per request against context length (all studies), then latency against rate (one panel each).

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: no studies.
    """
    if not studies:
        raise ConfigError("no hybrid studies to plot")
    plt = pyplot()
    figure, axes = plt.subplots(1, 1 + len(studies), figsize=(5.2 * (1 + len(studies)), 4.4))
    memory = axes[0]
    for study in studies:
        rows = study.memory_rows()
        lengths = [row["num_tokens"] for row in rows]
        color = _COLORS.get(study.model.name)
        for allocation in ALLOCATIONS:
            memory.plot(
                lengths, [row[f"{allocation}_bytes"] / 2**30 for row in rows], _STYLES[allocation],
                color=color, marker="o", markersize=3, label=f"{study.model.name}, {allocation}",
            )  # fmt: skip
    memory.set_xscale("log", base=2)
    memory.set_yscale("log")
    memory.set_xlabel("context length (tokens)")
    memory.set_ylabel("KV memory per request (GiB)")
    memory.set_title("Memory per request")
    memory.grid(alpha=0.3, which="both")
    memory.legend(fontsize=8)
    for axis, study in zip(axes[1:], studies, strict=True):
        sustained, peak = study.sustained_rates(), study.peak_throughputs()
        for allocation in study.configs:
            points = [p for p in study.points if p.system == allocation]
            latencies = [p.result.latency.normalised_mean for p in points]
            axis.plot(
                [p.rate for p in points], latencies, _STYLES[allocation],
                color=_COLORS.get(study.model.name), marker="o", markersize=3,
                label=f"{allocation}: sustains {sustained[allocation]:g}/s, at most {peak[allocation]:.2f}/s",
            )  # fmt: skip
        axis.axhline(study.slo, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel("normalised latency (s/token)")
        axis.set_title(f"{study.model.name}: {study.workload['source']}", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title or "KV-cache groups against uniform allocation (every layer keeps every token)")
    figure.tight_layout()
    return save_figure(plt, figure, path)


def hybrid_figure(out_dir: str | Path, *, num_requests: int = 200) -> Path:
    """Write ``hybrid_kv_groups.png``: both presets, 12 GiB, ``longdoc`` requests, blocks of 16.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    pyplot()
    from pagedkv.simulate.config import Budget, SimConfig, parse_bytes

    studies = []
    for name, model in HYBRID_PRESETS.items():
        config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), model.shape), block_size=16)
        workload = ("longdoc", num_requests, {"max_model_len": 32768})
        studies.append(hybrid_study(model, config, HYBRID_RATES[name], workload=workload))
    return plot_hybrid(studies, Path(out_dir) / "hybrid_kv_groups.png")
