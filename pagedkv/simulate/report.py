"""Run policies over one workload, sweep block sizes and windows, and print what was found.

>>> from pagedkv.simulate import Budget, SimConfig, synthetic
>>> report = simulate(synthetic("alpaca", 30, seed=0), SimConfig(Budget(512), block_size=8))
>>> sorted(report.results)
['contiguous', 'paged']
>>> report.results["paged"].occupancy_mean > report.results["contiguous"].occupancy_mean
True
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from pagedkv.errors import ConfigError
from pagedkv.simulate.baseline import RESERVE_RULES, ContiguousEngine
from pagedkv.simulate.config import ModelShape, SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.scheduler import parse_system, with_scheduler
from pagedkv.simulate.workload import Workload

__all__ = [
    "POLICIES",
    "Report",
    "SweepRow",
    "format_report",
    "format_sweep",
    "no_progress",
    "run_policy",
    "simulate",
    "stderr_progress",
    "sweep",
]

#: Every policy name: the paged one and the contiguous baselines.
POLICIES = ("paged", *RESERVE_RULES)

ProgressFactory = Callable[[str, int], Progress | None]


def no_progress(label: str, total: int) -> Progress | None:
    """A factory of no progress bar at all (the default)."""
    return None


def stderr_progress(
    stream: TextIO | None = None, *, num_runs: int | None = None, what: str = "policy"
) -> ProgressFactory:
    """A factory of progress bars on ``stream`` (stderr by default), one bar per run.

    With ``num_runs``, each bar says which run it is: ``"policy 2 of 4: contiguous"``
    (``what`` names a run: ``"policy"``, ``"run"``).
    """
    num_made = 0

    def make(label: str, total: int) -> Progress:
        nonlocal num_made
        num_made += 1
        if num_runs is not None:
            label = f"{what} {num_made} of {num_runs}: {label}"
        return Progress(label, total, stream=stream or sys.stderr)

    return make


def run_policy(
    policy: str,
    workload: Workload,
    config: SimConfig,
    *,
    progress: ProgressFactory = no_progress,
) -> PolicyResult:
    """Simulate one policy (``"paged:NAME"``: the paged policy under scheduler NAME).

    Raises:
        ConfigError: an unknown policy or scheduler.
        BudgetError, WorkloadError: the budget or the workload does not fit the policy.
    """
    name = policy
    policy, scheduler = parse_system(name)
    bar = progress(name, len(workload.requests))
    if policy == "paged":
        if scheduler is not None:
            config = with_scheduler(config, scheduler)
        result = PagedEngine(workload, config).run(progress=bar)
        result.policy = name
        return result
    if policy in RESERVE_RULES:
        engine = ContiguousEngine(
            workload,
            config.budget,
            policy=policy,
            max_size=config.max_size,
            max_num_seqs=config.max_num_seqs,
            sample_every=config.sample_every,
            cost=config.cost,
        )
        return engine.run(progress=bar)
    raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


@dataclass
class Report:
    """The results of several policies on one workload and budget.

    Attributes:
        workload: the workload's stats (``Workload.stats()``).
        config: the simulation's settings, as plain values.
        results: ``policy -> PolicyResult``, in the order they ran.
    """

    workload: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, PolicyResult] = field(default_factory=dict)

    def as_dict(self, *, timing: bool = True) -> dict[str, Any]:
        """Everything as JSON-ready values; wall-clock fields only under ``"timing"``."""
        data: dict[str, Any] = {
            "workload": self.workload,
            "config": self.config,
            "policies": {name: result.as_dict() for name, result in self.results.items()},
        }
        if timing:
            data["timing"] = {name: result.timing() for name, result in self.results.items()}
        return data


def describe_config(config: SimConfig, model: ModelShape | None = None) -> dict[str, Any]:
    """The settings of a simulation as plain values (for reports)."""
    data: dict[str, Any] = {
        "budget_tokens": config.budget.num_tokens,
        "budget_bytes": config.budget.num_bytes,
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "max_size": config.max_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "max_num_seqs": config.max_num_seqs,
        "sample_every": config.sample_every,
        "watermark": config.watermark,
        "beam_replace_prob": config.beam_replace_prob,
        "seed": config.seed,
        "scheduler": config.scheduler,
        "preempt_mode": config.preempt_mode,
        "num_host_blocks": config.num_host_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "chunked_prefill": config.chunked_prefill,
        "growth_reserve_steps": config.growth_reserve_steps,
        "cost": config.cost.describe(),
    }
    if model is not None:
        data["model"] = dataclasses.asdict(model) | {"bytes_per_token": model.bytes_per_token}
    return data


def simulate(
    workload: Workload,
    config: SimConfig,
    policies: Sequence[str] = ("paged", "contiguous"),
    *,
    model: ModelShape | None = None,
    progress: ProgressFactory = no_progress,
) -> Report:
    """Run each policy over ``workload`` under ``config``'s budget.

    Raises:
        ConfigError: an unknown policy.
        BudgetError, WorkloadError: the budget or workload does not fit.
    """
    for policy in policies:
        parse_system(policy)
    report = Report(workload.stats(), describe_config(config, model))
    for policy in policies:
        report.results[policy] = run_policy(policy, workload, config, progress=progress)
    return report


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _rows(result: PolicyResult) -> list[tuple[str, str]]:
    paged = result.policy.startswith("paged")
    latency = result.latency
    rows = [
        ("memory holding live tokens, mean", _pct(result.occupancy_mean)),
        ("  peak", _pct(result.occupancy_peak)),
        ("  mean while requests waited", _pct(result.occupancy_loaded_mean)),
        ("reserved or held but empty, mean", _pct(result.unfilled_mean)),
        ("  of it never to be filled", "-" if paged else _pct(result.never_used_mean)),
        ("  waste inside the memory taken", _pct(result.waste_of_used_mean)),
        ("external fragmentation, mean", "-" if paged else _pct(result.external_fragmentation_mean)),
        ("free, mean", _pct(result.free_mean)),
        ("sequences running, mean", f"{result.num_seqs_mean:.1f}"),
        ("  peak", f"{result.num_seqs_peak}"),
        ("scheduler", result.scheduler or "-"),
        ("preemptions", f"{result.num_preemptions}"),
        ("recomputed tokens", f"{result.num_recomputed_tokens:,}"),
        ("  of the prefill tokens", _pct(result.num_recomputed_tokens / max(1, result.num_prefill_tokens))),
        ("swap traffic", f"{result.swap_bytes / 1e9:,.1f} GB" if paged else "-"),
        ("prefix cache hit rate", _pct(result.prefix_hit_rate) if paged else "-"),
        ("blocks saved by sharing, mean", f"{result.blocks_saved_mean:.1f}" if paged else "-"),
        ("  memory saved by sharing", _pct(result.sharing_saving_mean) if paged else "-"),
        (
            "finished / aborted / rejected",
            f"{result.num_finished} / {result.num_aborted} / {result.num_rejected}",
        ),
        ("steps (forward passes)", f"{result.num_steps:,}"),
        ("generated tokens per step", f"{result.generated_tokens_per_step:.1f}"),
        ("model time (cost model)", f"{result.model_s:,.1f} s"),
        ("  of it copying swapped KV", f"{result.swap_s:,.1f} s"),
        ("throughput, requests / s", f"{latency.requests_per_s:.2f}"),
        ("  output tokens / s", f"{latency.tokens_per_s:,.0f}"),
        (
            "TTFT mean / p50 / p99, s",
            f"{latency.ttft_mean:.2f} / {latency.ttft_p50:.2f} / {latency.ttft_p99:.2f}",
        ),
        ("TPOT mean / p99, ms", f"{1000 * latency.tpot_mean:.1f} / {1000 * latency.tpot_p99:.1f}"),
        (
            "normalised latency mean / p50 / p99, s/token",
            f"{latency.normalised_mean:.3f} / {latency.normalised_p50:.3f} / {latency.normalised_p99:.3f}",
        ),
        ("wall time", f"{result.wall_s:.2f} s"),
        ("simulated tokens per second", f"{result.timing()['simulated_tokens_per_s']:,.0f}"),
        ("  per CPU second", f"{result.timing()['simulated_tokens_per_cpu_s']:,.0f}"),
    ]
    return rows


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{cell:>{width}}" for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_report(report: Report) -> str:
    """The report as a text table: one column per policy."""
    stats, config = report.workload, report.config
    lines = [
        f"workload: {stats['source']}, seed {stats['seed']}: {stats['num_requests']:,} requests, "
        f"{stats['num_sequences']:,} sequences; mean prompt {stats['mean_prompt_len']} and output "
        f"{stats['mean_output_len']} tokens",
    ]
    memory = f"memory: {config['budget_tokens']:,} token slots"
    if config.get("budget_bytes") is not None and "model" in config:
        model = config["model"]
        memory = (
            f"memory: {config['budget_bytes'] / 2**30:.2f} GiB = {config['budget_tokens']:,} token slots at "
            f"{model['bytes_per_token']:,} bytes per token ({model['num_layers']} layers x "
            f"{model['num_kv_heads']} kv heads x {model['head_dim']} x 2 x {model['dtype_bytes']} bytes)"
        )
    lines.append(memory)
    paged = f"paged: {config['num_blocks']:,} blocks of {config['block_size']}"
    if config["max_size"] is not None:
        paged += f", window {config['max_size']}"
    paged += f", prefix caching {'on' if config['enable_prefix_caching'] else 'off'}"
    lines.append(paged + "\n")
    names = list(report.results)
    columns = [_rows(report.results[name]) for name in names]
    rows = [[label] + [column[i][1] for column in columns] for i, (label, _) in enumerate(columns[0])]
    lines.append(table(["", *names], rows))
    for name, result in report.results.items():
        if result.num_rejected:
            lines.append(
                f"note: {name} rejected {result.num_rejected} requests: their reservations are larger than "
                f"the whole memory (it reserves up to max_model_len={stats['max_model_len']}; "
                "give more memory or a smaller --max-model-len)"
            )
        if result.num_aborted:
            lines.append(
                f"note: {name} aborted {result.num_aborted} requests that outgrew the whole memory "
                "running alone"
            )
    return "\n".join(lines)


@dataclass
class SweepRow:
    """One point of a sweep: the settings and the paged policy's result there."""

    block_size: int
    max_size: int | None
    result: PolicyResult

    def as_dict(self) -> dict[str, Any]:
        """Settings and deterministic measurements."""
        return {"block_size": self.block_size, "max_size": self.max_size, **self.result.as_dict()}


def sweep(
    workload: Workload,
    config: SimConfig,
    block_sizes: Sequence[int],
    windows: Sequence[int | None] = (None,),
    *,
    baseline: str | None = "contiguous",
    progress: ProgressFactory = no_progress,
) -> list[SweepRow]:
    """Run the paged policy at every (block size, window); the same budget in token slots.

    With ``baseline``, a contiguous run per window is added (block size 0 in the rows).

    Raises:
        BudgetError: a block size leaves the budget without room for a prompt.
    """
    rows = []
    for window in windows:
        for block_size in block_sizes:
            point = dataclasses.replace(config, block_size=block_size, max_size=window)
            result = run_policy("paged", workload, point, progress=progress)
            rows.append(SweepRow(block_size, window, result))
        if baseline is not None:
            point = dataclasses.replace(config, max_size=window)
            rows.append(SweepRow(0, window, run_policy(baseline, workload, point, progress=progress)))
    return rows


def format_sweep(
    rows: Sequence[SweepRow], extra_columns: tuple[Sequence[str], Sequence[Sequence[str]]] | None = None
) -> str:
    """The sweep as a text table, one row per point (``extra_columns``: headers and one cell list per row)."""
    headers = [
        "block_size",
        "window",
        "live mean",
        "empty mean",
        "waste/taken",
        "seqs mean",
        "seqs peak",
        "preempt",
        "prefix hit",
        "steps",
        "gen tok/step",
        "sim tok/s",
        "per cpu s",
    ]
    body = []
    for row in rows:
        result = row.result
        body.append(
            [
                str(row.block_size) if row.block_size else result.policy,
                "none" if row.max_size is None else str(row.max_size),
                _pct(result.occupancy_mean),
                _pct(result.unfilled_mean),
                _pct(result.waste_of_used_mean),
                f"{result.num_seqs_mean:.1f}",
                str(result.num_seqs_peak),
                str(result.num_preemptions),
                _pct(result.prefix_hit_rate),
                f"{result.num_steps:,}",
                f"{result.generated_tokens_per_step:.1f}",
                f"{result.timing()['simulated_tokens_per_s']:,.0f}",
                f"{result.timing()['simulated_tokens_per_cpu_s']:,.0f}",
            ]
        )
    if extra_columns is not None:
        headers += list(extra_columns[0])
        body = [cells + list(extra) for cells, extra in zip(body, extra_columns[1], strict=True)]
    return table(headers, body)
