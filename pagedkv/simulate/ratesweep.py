"""The PagedAttention paper's headline experiment: normalised latency against request rate.

Owns :func:`rate_sweep`, :func:`sustained_rates` and their table: every system (paged with
a scheduler, or a contiguous reservation rule) serves the same Poisson requests at each rate.
Models the paper's Figure 12 and vLLM's ``benchmark_serving --request-rate``. The systems,
the sustained rate and an example: docs/simulate.md, "The rate sweep"; results: docs/study.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.baseline import RESERVE_RULES
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.report import run_policy, table
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.scheduler import parse_system
from pagedkv.simulate.synthetic import synthetic

__all__ = [
    "DEFAULT_RATES",
    "RatePoint",
    "format_rate_sweep",
    "rate_sweep",
    "sustained_rates",
]

#: Rates (requests per model second) swept by default, per dataset: around
#: where the preset's paged system saturates.
DEFAULT_RATES: dict[str, tuple[float, ...]] = {
    "sharegpt": (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0),
    "alpaca": (20.0, 40.0, 60.0, 80.0, 100.0, 120.0, 140.0, 160.0, 180.0, 200.0),
}


@dataclass
class RatePoint:
    """One system at one request rate."""

    rate: float
    system: str
    result: PolicyResult

    def as_dict(self) -> dict[str, Any]:
        """The rate, the system and its deterministic measurements (latency included)."""
        return {"rate": self.rate, "system": self.system, **self.result.as_dict()}


def rate_sweep(
    dataset: str,
    num_requests: int,
    config: SimConfig,
    rates: Sequence[float],
    systems: Sequence[str] = ("paged", *RESERVE_RULES),
    *,
    seed: int = 0,
    workload_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> list[RatePoint]:
    """Serve ``num_requests`` synthetic requests at every rate with every system.

    Args:
        dataset: ``"sharegpt"`` or ``"alpaca"``.
        num_requests: requests per run.
        config: memory, block size, cost model and the default scheduler.
        rates: requests per model second.
        systems: names as :func:`parse_system` reads them.
        seed: the workload's seed (the same requests at every rate).
        workload_options: more :func:`~pagedkv.simulate.synthetic` arguments.
        progress: a bar counting runs (``len(rates) x len(systems)``).

    Raises:
        ConfigError: an unknown system, or a rate that is not > 0.
    """
    for name in systems:
        parse_system(name)
    for rate in rates:
        if not rate > 0:
            raise ConfigError(f"a request rate must be > 0 requests per second, got {rate!r}")
    points = []
    for rate in rates:
        workload = synthetic(dataset, num_requests, seed=seed, request_rate=rate, **(workload_options or {}))
        for name in systems:
            points.append(RatePoint(rate, name, run_policy(name, workload, config)))
            if progress is not None:
                progress.update(len(points), f"{name} at {rate:g}/s")
    if progress is not None:
        progress.close(len(points))
    return points


def sustained_rates(points: Sequence[RatePoint], slo: float) -> dict[str, float]:
    """Per system, the highest rate whose mean normalised latency is within ``slo`` s/token (0 if none)."""
    best: dict[str, float] = {}
    for point in points:
        best.setdefault(point.system, 0.0)
        if point.result.latency.normalised_mean <= slo:
            best[point.system] = max(best[point.system], point.rate)
    return best


def format_rate_sweep(points: Sequence[RatePoint], slo: float) -> str:
    """The sweep as a text table (one row per rate and system), then each system's sustained rate."""
    headers = [
        "rate/s", "system", "norm s/tok", "p50", "p99", "TTFT s", "TPOT ms", "req/s", "tok/s",
        "preempt", "recomputed", "swap GB", "seqs mean",
    ]  # fmt: skip
    rows = []
    for point in points:
        result, latency = point.result, point.result.latency
        rows.append(
            [
                f"{point.rate:g}",
                point.system,
                f"{latency.normalised_mean:.3f}",
                f"{latency.normalised_p50:.3f}",
                f"{latency.normalised_p99:.3f}",
                f"{latency.ttft_mean:.2f}",
                f"{1000 * latency.tpot_mean:.1f}",
                f"{latency.requests_per_s:.2f}",
                f"{latency.tokens_per_s:,.0f}",
                f"{result.num_preemptions:,}",
                f"{result.num_recomputed_tokens:,}",
                f"{result.swap_bytes / 1e9:.1f}",
                f"{result.num_seqs_mean:.1f}",
            ]
        )
    lines = [table(headers, rows), ""]
    sustained = sustained_rates(points, slo)
    lines.append(f"sustained rate (highest rate with mean normalised latency <= {slo:g} s per output token):")
    first = points[0].system if points else ""
    reference = sustained.get(first, 0.0)
    for system, rate in sustained.items():
        note = ""
        if not rate:
            note = "  (none of the rates swept)"
        elif system != first and reference:
            note = f"  ({first} sustains {reference / rate:.1f}x this)"
        lines.append(f"  {system:<22} {rate:g} requests/s{note}")
    return "\n".join(lines)
