"""The host-tier figure (the ``plot`` extra): hit rate and time to first token against host-tier size.

:func:`plot_tiers` draws a :class:`~pagedkv.simulate.tierstudy.TierStudy`;
:func:`tiers_figure` runs the fixed settings of docs/study.md, section 6
(``pagedkv viz --png tiers``).
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.errors import ConfigError
from pagedkv.simulate.plots import pyplot, save_figure
from pagedkv.simulate.tierstudy import DEFAULT_HOST_TIER_SIZES, TierStudy, tier_study

__all__ = ["STUDY_SETTINGS", "plot_tiers", "tiers_figure"]

#: The study's chat workload (``pagedkv simulate --workload chat`` with these flags).
STUDY_SETTINGS = {"num_conversations": 200, "num_system_prompts": 8, "system_prompt_len": 1000,
                  "max_model_len": 4096}  # fmt: skip


def plot_tiers(study: TierStudy, path: str | Path, *, title: str = "") -> Path:
    """Hit rate (device, host, total) and TTFT (mean, p50, p99) against the host tier's size in GiB.

    Raises:
        MissingExtraError: matplotlib is not installed.
        ConfigError: the study has no runs.
    """
    if not study.points:
        raise ConfigError("no host-tier runs to plot")
    plt = pyplot()
    config = study.config
    bytes_per_block = config.block_size * config.cost.shape.bytes_per_token
    sizes = [point.num_host_tier_blocks * bytes_per_block / 2**30 for point in study.points]
    results = [point.result for point in study.points]
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.4))
    device = [100 * r.device_hit_rate for r in results]
    host = [100 * r.tier_hit_rate for r in results]
    hits.stackplot(
        sizes, device, host, labels=["device", "host tier"], colors=["#1565c0", "#ef6c00"], alpha=0.8
    )
    hits.plot(sizes, [100 * r.prefix_hit_rate for r in results], "k-o", markersize=3, label="total")
    hits.set_xlabel("host tier (GiB of KV)")
    hits.set_ylabel("prompt tokens found cached (%)")
    hits.set_title("Prefix hit rate")
    hits.grid(alpha=0.3)
    hits.legend(fontsize=8, loc="lower right")
    for name, style in (("mean", "-o"), ("p50", "--o"), ("p99", ":o")):
        ttft.plot(sizes, [getattr(r.latency, f"ttft_{name}") for r in results], style, markersize=3,
                  color="#2e7d32", label=f"TTFT {name}")  # fmt: skip
    ttft.set_yscale("log")
    ttft.set_xlabel("host tier (GiB of KV)")
    ttft.set_ylabel("time to first token (model s)")
    ttft.set_title(f"Time to first token (host loads at {config.cost.host_bandwidth / 1e9:g} GB/s)")
    ttft.grid(alpha=0.3, which="both")
    ttft.legend(fontsize=8)
    default_title = f"A host tier below {config.num_blocks:,} device blocks: {study.workload['source']}"
    figure.suptitle(title or default_title, fontsize=9)
    figure.tight_layout()
    return save_figure(plt, figure, path)


def tiers_figure(out_dir: str | Path) -> Path:
    """Write ``host_tier.png``: the chat study of docs/study.md (12 GiB, OPT-13B on an A100, blocks of 16).

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    pyplot()
    from pagedkv.simulate.config import Budget, ModelShape, SimConfig, parse_bytes
    from pagedkv.simulate.conversations import conversations

    settings = dict(STUDY_SETTINGS)
    workload = conversations(settings.pop("num_conversations"), seed=0, **settings)
    config = SimConfig(
        Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16, enable_prefix_caching=True
    )
    study = tier_study(workload, config, DEFAULT_HOST_TIER_SIZES)
    return plot_tiers(study, Path(out_dir) / "host_tier.png")
