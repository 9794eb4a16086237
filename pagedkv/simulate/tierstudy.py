"""The host-tier study: one workload served with a host tier of each size below the device prefix cache.

Each run drives the real manager with a real :class:`pagedkv.tiers.HostTier`
(``SimConfig.num_host_tier_blocks``); a host hit costs its copy at
``cost.host_bandwidth`` instead of its prefill. Counterpart: vLLM's CPU
offloading and SGLang's HiCache host tier (``pagedkv simulate --host-tier-sweep``;
docs/study.md, section 6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.report import table
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.workload import Workload

__all__ = ["DEFAULT_HOST_TIER_SIZES", "TierPoint", "TierStudy", "format_tier_study", "tier_study"]

#: Host-tier sizes in blocks ``--host-tier-sweep default`` runs (0: no host tier).
DEFAULT_HOST_TIER_SIZES = (0, 500, 1000, 2000, 3000, 4000)


@dataclass(frozen=True, slots=True)
class TierPoint:
    """One run: the host tier's size in blocks and what the run measured."""

    num_host_tier_blocks: int
    result: PolicyResult

    def as_dict(self, config: SimConfig) -> dict[str, Any]:
        """Hit rates (device, host, total), TTFT and the load time as JSON-ready values."""
        result, latency = self.result, self.result.latency
        bytes_per_block = config.block_size * config.cost.shape.bytes_per_token
        return {
            "num_host_tier_blocks": self.num_host_tier_blocks,
            "host_tier_bytes": self.num_host_tier_blocks * bytes_per_block,
            "device_hit_rate": round(result.device_hit_rate, 6),
            "host_hit_rate": round(result.tier_hit_rate, 6),
            "hit_rate": round(result.prefix_hit_rate, 6),
            "ttft_mean": round(latency.ttft_mean, 6),
            "ttft_p50": round(latency.ttft_p50, 6),
            "ttft_p99": round(latency.ttft_p99, 6),
            "num_tier_loaded_blocks": result.num_tier_loaded_blocks,
            "tier_load_s": round(result.tier_load_s, 6),
            "num_prefill_tokens": result.num_prefill_tokens,
            "model_s": round(result.model_s, 6),
        }


@dataclass
class TierStudy:
    """The runs of :func:`tier_study`, smallest host tier first."""

    workload: dict[str, Any]
    config: SimConfig
    points: list[TierPoint]

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values; wall-clock fields only under ``"timing"``."""
        config = self.config
        return {
            "workload": self.workload,
            "budget_tokens": config.budget.num_tokens,
            "budget_bytes": config.budget.num_bytes,
            "block_size": config.block_size,
            "host_tier_policy": config.host_tier_policy,
            "cost": config.cost.describe(),
            "host_tier": [point.as_dict(config) for point in self.points],
            "timing": [point.result.timing() for point in self.points],
        }


def tier_study(
    workload: Workload, config: SimConfig, sizes: Sequence[int], *, progress: Progress | None = None
) -> TierStudy:
    """Serve ``workload`` under ``config`` with a host tier of each of ``sizes`` blocks (0: none).

    Raises:
        ConfigError: prefix caching is off, a window is set, or a size is not an int >= 0.
    """
    if not config.enable_prefix_caching:
        raise ConfigError("the host-tier study keeps prefix-cached blocks: turn prefix caching on")
    configs = [dataclasses.replace(config, num_host_tier_blocks=size) for size in sorted(set(sizes))]
    points = []
    for run_config in configs:  # every size checked (by SimConfig) before the first run
        size = run_config.num_host_tier_blocks
        points.append(TierPoint(size, PagedEngine(workload, run_config).run()))
        if progress is not None:
            progress.update(len(points), f"{size} host blocks")
    if progress is not None:
        progress.close(len(points))
    return TierStudy(workload.stats(), config, points)


def format_tier_study(study: TierStudy) -> str:
    """The study as text: per host-tier size, hit rates and time to first token."""
    config = study.config
    bytes_per_block = config.block_size * config.cost.shape.bytes_per_token
    stats = study.workload
    lines = [
        f"host tier: {stats['source']}, seed {stats['seed']}: {stats['num_requests']:,} requests; "
        f"{config.num_blocks:,} device blocks of {config.block_size}, prefix caching on, "
        f"host tier {config.host_tier_policy}; cost model {config.cost.name}, host loads at "
        f"{config.cost.host_bandwidth / 1e9:g} GB/s\n"
    ]
    headers = ["host blocks", "host GiB", "hit device", "hit host", "hit total",
               "TTFT mean s", "p50", "p99", "loads s"]  # fmt: skip
    rows = []
    for point in study.points:
        result, latency = point.result, point.result.latency
        rows.append(
            [
                f"{point.num_host_tier_blocks:,}",
                f"{point.num_host_tier_blocks * bytes_per_block / 2**30:,.1f}",
                f"{100 * result.device_hit_rate:.1f}%", f"{100 * result.tier_hit_rate:.1f}%",
                f"{100 * result.prefix_hit_rate:.1f}%", f"{latency.ttft_mean:.3f}", f"{latency.ttft_p50:.3f}",
                f"{latency.ttft_p99:.3f}", f"{result.tier_load_s:.2f}",
            ]
        )  # fmt: skip
    lines.append(table(headers, rows))
    first, last = study.points[0].result.latency, study.points[-1].result.latency
    if len(study.points) > 1 and last.ttft_mean > 0:
        lines.append(
            f"\nlargest host tier against the smallest: mean TTFT {first.ttft_mean / last.ttft_mean:.2f}x "
            f"lower, p99 {first.ttft_p99 / last.ttft_p99 if last.ttft_p99 else 0:.2f}x"
        )
    return "\n".join(lines)
