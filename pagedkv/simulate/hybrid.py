"""Hybrid models (full and sliding-window layers): the KV memory a request holds, with or without groups.

Owns the hybrid presets, vLLM's split of a model's layers into KV-cache groups
(one pool, every group's page the same size, groups padded to equal layer
counts: ``vllm/v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``),
the bytes a request of ``L`` tokens holds with groups or with uniform
allocation (every layer keeps every token), and the study that serves one
workload under both (``pagedkv simulate --hybrid-model``; docs/study.md, section 5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.counts import ceil_div, window_blocks
from pagedkv.errors import ConfigError
from pagedkv.simulate.config import Budget, SimConfig
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.ratesweep import RatePoint, rate_sweep, sustained_rates
from pagedkv.simulate.report import table
from pagedkv.simulate.shape import ModelShape
from pagedkv.simulate.synthetic import synthetic
from pagedkv.simulate.workload import Workload

__all__ = [
    "ALLOCATIONS",
    "HYBRID_PRESETS",
    "HYBRID_RATES",
    "MEMORY_LENGTHS",
    "HybridModel",
    "HybridStudy",
    "KVCacheGroup",
    "format_hybrid",
    "hybrid_study",
]

#: How a hybrid model's KV memory is laid out: ``grouped`` (one block table
#: per KV-cache group, window groups free what their window no longer sees) or
#: ``uniform`` (every layer keeps every token, as pagedkv's manager does today).
ALLOCATIONS = ("grouped", "uniform")
#: Context lengths of the memory-per-request table and figure.
MEMORY_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers of one attention type that share a block table (vLLM's ``KVCacheGroupSpec``).

    Attributes:
        window: the sliding window in tokens, or None for full attention.
        num_layers: the model's layers in the group.
        num_padded_layers: the group size every group's page is sized for
            (``num_layers`` plus padding layers that hold memory but no layer).
    """

    window: int | None
    num_layers: int
    num_padded_layers: int

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds in this group (a window frees what it left).

        >>> KVCacheGroup(window=8, num_layers=1, num_padded_layers=1).num_blocks(100, 4)
        3
        """
        num_blocks = ceil_div(num_tokens, block_size)
        if self.window is None:
            return num_blocks
        return min(num_blocks, window_blocks(self.window, block_size))


@dataclass(frozen=True, slots=True)
class HybridModel:
    """A model whose layers mix full attention and sliding windows, and its step-time cost.

    Attributes:
        name: the preset's name.
        layer_windows: per layer, its sliding window in tokens, or None for full attention.
        num_kv_heads: key/value heads per layer.
        head_dim: values per head.
        dtype_bytes: bytes per stored value.
        cost: the step-time roofline (its shape is this model's uniform geometry).

    Invariants: at least one layer; every window >= 1; ``cost.shape`` is
    :attr:`shape`.

    >>> model = HYBRID_PRESETS["gpt-oss-like"]
    >>> [(g.window, g.num_layers, g.num_padded_layers) for g in model.groups()]
    [(None, 18, 18), (128, 18, 18)]
    >>> model.bytes_per_request(8192, 16, "uniform") / model.bytes_per_request(8192, 16, "grouped")
    1.965...
    """

    name: str
    layer_windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    cost: CostModel

    def __post_init__(self) -> None:
        if not self.layer_windows:
            raise ConfigError(f"hybrid model {self.name!r}: needs at least one layer, got none")
        for window in self.layer_windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ConfigError(
                    f"hybrid model {self.name!r}: a window must be None or an int >= 1, got {window!r}"
                )
        if self.cost.shape != self.shape:
            raise ConfigError(
                f"hybrid model {self.name!r}: its cost model's shape {self.cost.shape} "
                f"is not its own {self.shape}"
            )

    @property
    def shape(self) -> ModelShape:
        """The uniform geometry: every layer, every token (raises ConfigError on a bad field)."""
        return ModelShape(len(self.layer_windows), self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def bytes_per_layer_token(self) -> int:
        """Bytes of one token's keys and values in one layer."""
        return self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def groups(self) -> tuple[KVCacheGroup, ...]:
        """vLLM's KV-cache groups: full attention first, then each window, all padded to one size.

        The group size is the fewest layers of any attention type (the "1" of
        a 5:1 pattern), or the most when the counts are within 1.25x of each
        other (vLLM's rule, so 12 + 13 layers become 2 groups of 13); a type
        with more layers is split into ``ceil(count / size)`` groups, the
        last one padded::

            Gemma 3 27B: 52 window + 10 full layers, size 10
            -> full(10) | win(10) win(10) win(10) win(10) win(10) win(2 + 8 padding)
        """
        counts: dict[int | None, int] = {}
        for window in self.layer_windows:
            counts[window] = counts.get(window, 0) + 1
        size = min(counts.values())
        if max(counts.values()) < 1.25 * size:
            size = max(counts.values())
        groups = []
        for window in sorted(counts, key=lambda w: -1 if w is None else w):
            remaining = counts[window]
            while remaining > 0:
                groups.append(KVCacheGroup(window, min(size, remaining), size))
                remaining -= size
        return tuple(groups)

    def num_layer_blocks(self, num_tokens: int, block_size: int, allocation: str) -> int:
        """Blocks x the layers each is sized for, one sequence of ``num_tokens`` (see bytes_per_request)."""
        if allocation == "uniform":
            return ceil_div(num_tokens, block_size) * len(self.layer_windows)
        if allocation == "grouped":
            return sum(g.num_blocks(num_tokens, block_size) * g.num_padded_layers for g in self.groups())
        raise ConfigError(f"unknown allocation {allocation!r}; expected {' or '.join(ALLOCATIONS)}")

    def bytes_per_request(self, num_tokens: int, block_size: int, allocation: str) -> int:
        """KV bytes one sequence of ``num_tokens`` holds at its longest.

        ``uniform``: every layer keeps every token. ``grouped``: per group,
        its blocks x its padded layers x ``block_size`` x bytes per layer-token;
        a window group holds at most ``window_blocks(window, block_size)``.

        Raises:
            ConfigError: an unknown allocation.

        >>> HYBRID_PRESETS["gemma3-27b-like"].bytes_per_request(1024, 16, "uniform")
        520093696
        """
        return (
            self.num_layer_blocks(num_tokens, block_size, allocation)
            * block_size
            * self.bytes_per_layer_token
        )

    def tokens_per_byte(self, workload: Workload, block_size: int, allocation: str) -> float:
        """Token slots per byte of KV memory for ``workload`` (what its requests hold at their longest).

        Uniform allocation costs the same per token at every length, so this
        is exact for it; grouped memory per token falls as a sequence outgrows
        the windows, so it is the workload's own mix: the block-rounded tokens
        of every sequence over the bytes they hold.
        """
        num_tokens = num_bytes = 0
        for request in workload.requests:
            length = request.prompt_len + request.output_len
            num_tokens += request.n * ceil_div(length, block_size) * block_size
            num_bytes += request.n * self.bytes_per_request(length, block_size, allocation)
        return num_tokens / num_bytes

    def describe(self) -> dict[str, Any]:
        """The layout as plain values (for reports)."""
        windows = sorted({w for w in self.layer_windows if w is not None})
        return {
            "name": self.name,
            "num_layers": len(self.layer_windows),
            "num_full_layers": self.layer_windows.count(None),
            "windows": {str(w): self.layer_windows.count(w) for w in windows},
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype_bytes": self.dtype_bytes,
            "bytes_per_layer_token": self.bytes_per_layer_token,
            "groups": [dataclasses.asdict(group) for group in self.groups()],
            "cost": self.cost.describe(),
        }


def _gemma3_27b() -> HybridModel:
    # Gemma 3 27B (config.json): 62 layers, every sixth full ((i + 1) % 6 == 0), the rest window 1024;
    # 16 KV heads of 128, 32 query heads; 27.4 B parameters in bf16 on one H100 SXM.
    windows = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))
    shape = ModelShape(num_layers=62, num_kv_heads=16, head_dim=128, dtype_bytes=2)
    cost = CostModel(
        shape=shape, num_params=27.4e9, memory_bandwidth=3.35e12, peak_flops=989e12,
        host_bandwidth=50e9, num_q_heads=32, name="gemma-3-27b-h100",
    )  # fmt: skip
    return HybridModel("gemma3-27b-like", windows, 16, 128, 2, cost)


def _gpt_oss() -> HybridModel:
    # gpt-oss-120b (config.json): 36 layers alternating window 128 and full attention; 8 KV heads of 64,
    # 64 query heads; 5.1 B active parameters per token (MoE), counted at 2 bytes each, on one H100 SXM.
    windows = tuple(128 if i % 2 == 0 else None for i in range(36))
    shape = ModelShape(num_layers=36, num_kv_heads=8, head_dim=64, dtype_bytes=2)
    cost = CostModel(
        shape=shape, num_params=5.1e9, memory_bandwidth=3.35e12, peak_flops=989e12,
        host_bandwidth=50e9, num_q_heads=64, name="gpt-oss-120b-h100",
    )  # fmt: skip
    return HybridModel("gpt-oss-like", windows, 8, 64, 2, cost)


#: The hybrid presets of ``pagedkv simulate --hybrid-model``.
HYBRID_PRESETS: dict[str, HybridModel] = {model.name: model for model in (_gemma3_27b(), _gpt_oss())}
#: Rates swept by default per preset (requests per model second): around where
#: each allocation saturates on 12 GiB of ``longdoc`` requests.
HYBRID_RATES: dict[str, tuple[float, ...]] = {
    "gemma3-27b-like": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2),
    "gpt-oss-like": (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0),
}


@dataclass
class HybridStudy:
    """One hybrid model served under each allocation: memory per request and latency against rate.

    Attributes:
        model: the hybrid model.
        config: the settings shared by every run (its budget in bytes).
        workload: the workload's stats (the lengths every rate serves).
        configs: per allocation, the settings it ran under (its token slots).
        points: the rate sweep; a point's ``system`` is its allocation.
        slo: the normalised latency (s per output token) a sustained rate stays within.
    """

    model: HybridModel
    config: SimConfig
    workload: dict[str, Any]
    configs: dict[str, SimConfig]
    points: list[RatePoint]
    slo: float

    def memory_rows(self, lengths: Sequence[int] = MEMORY_LENGTHS) -> list[dict[str, Any]]:
        """Per context length: bytes per request and requests that fit, under each allocation."""
        block_size = self.config.block_size
        budget = self.config.budget.num_bytes or 0
        rows = []
        for length in lengths:
            row: dict[str, Any] = {"num_tokens": length}
            for allocation in ALLOCATIONS:
                num_bytes = self.model.bytes_per_request(length, block_size, allocation)
                row[f"{allocation}_bytes"] = num_bytes
                row[f"{allocation}_max_requests"] = budget // num_bytes
            row["grouped_saving"] = 1 - row["grouped_bytes"] / row["uniform_bytes"]
            rows.append(row)
        return rows

    def sustained_rates(self) -> dict[str, float]:
        """Per allocation, the highest rate swept within :attr:`slo`."""
        return sustained_rates(self.points, self.slo)

    def peak_throughputs(self) -> dict[str, float]:
        """Per allocation, the most requests per model second served at any rate swept."""
        best: dict[str, float] = {}
        for point in self.points:
            best[point.system] = max(best.get(point.system, 0.0), point.result.latency.requests_per_s)
        return best

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values; wall-clock fields only under ``"timing"``."""
        return {
            "model": self.model.describe(),
            "workload": self.workload,
            "budget_bytes": self.config.budget.num_bytes,
            "block_size": self.config.block_size,
            "scheduler": self.config.scheduler,
            "memory_per_request": self.memory_rows(),
            "allocations": {
                name: {"budget_tokens": config.budget.num_tokens, "num_blocks": config.num_blocks}
                for name, config in self.configs.items()
            },
            "slo": self.slo,
            "rate_sweep": [point.as_dict() for point in self.points],
            "sustained_rates": self.sustained_rates(),
            "peak_throughputs": self.peak_throughputs(),
            "timing": [point.result.timing() for point in self.points],
        }


def hybrid_study(
    model: HybridModel,
    config: SimConfig,
    rates: Sequence[float],
    *,
    allocations: Sequence[str] = ALLOCATIONS,
    workload: tuple[str, int, dict[str, Any]] = ("longdoc", 200, {"max_model_len": 32768}),
    slo: float = 0.1,
    progress: Progress | None = None,
) -> HybridStudy:
    """Serve one workload at every rate under each allocation of ``config``'s memory in bytes.

    Each allocation turns the bytes into the token slots of the real manager's
    pool by :meth:`HybridModel.tokens_per_byte`; from there the paged engine
    (admission, preemption, the cost model) decides how many requests run.

    Args:
        model: the hybrid model (its cost model replaces ``config.cost``).
        config: block size, scheduler, seed and the budget (its bytes are used).
        rates: requests per model second.
        allocations: among :data:`ALLOCATIONS`.
        workload: the synthetic dataset, its number of requests, more
            :func:`~pagedkv.simulate.synthetic.synthetic` arguments.
        slo: for the sustained rates.
        progress: a bar counting runs.

    Raises:
        ConfigError: no budget in bytes, an unknown allocation, a bad rate.
        BudgetError, WorkloadError: the budget or the workload does not fit.
    """
    num_bytes = config.budget.num_bytes
    if num_bytes is None:
        raise ConfigError("the hybrid study needs the memory in bytes (--memory), not in blocks (--blocks)")
    for allocation in allocations:
        if allocation not in ALLOCATIONS:
            raise ConfigError(f"unknown allocation {allocation!r}; expected {' or '.join(ALLOCATIONS)}")
    dataset, num_requests, options = workload
    requests = synthetic(dataset, num_requests, seed=config.seed, **options)
    configs = {}
    for allocation in allocations:
        tokens = int(num_bytes * model.tokens_per_byte(requests, config.block_size, allocation))
        configs[allocation] = dataclasses.replace(config, budget=Budget(tokens, num_bytes), cost=model.cost)
    points = []
    for allocation, run_config in configs.items():
        for point in rate_sweep(dataset, num_requests, run_config, rates, ["paged"], seed=config.seed,
                                workload_options=options):  # fmt: skip
            points.append(RatePoint(point.rate, allocation, point.result))
            if progress is not None:
                progress.update(len(points), f"{allocation} at {point.rate:g}/s")
    if progress is not None:
        progress.close(len(points))
    points.sort(key=lambda point: point.rate)  # stable: allocations in the order given at each rate
    return HybridStudy(model, config, requests.stats(), configs, points, slo)


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB" if num_bytes < 2**30 else f"{num_bytes / 2**30:,.2f} GiB"


def format_hybrid(study: HybridStudy) -> str:
    """The study as text: the groups, memory per request by length, then latency against rate."""
    model, config = study.model, study.config
    groups = " | ".join(
        f"{'full' if g.window is None else f'window {g.window}'}: {g.num_layers}"
        + (f"+{g.num_padded_layers - g.num_layers} pad" if g.num_padded_layers > g.num_layers else "")
        for g in model.groups()
    )
    lines = [
        f"hybrid model {model.name}: {len(model.layer_windows)} layers, {model.num_kv_heads} kv heads x "
        f"{model.head_dim}, {model.bytes_per_layer_token:,} bytes per layer-token; "
        f"cost model {model.cost.name}",
        f"groups (vLLM's layout, {len(model.groups())} groups of "
        f"{model.groups()[0].num_padded_layers} layers): {groups}",
        f"memory: {_size(config.budget.num_bytes or 0)} of KV, blocks of {config.block_size}\n",
    ]
    headers = ["tokens", "uniform", "grouped", "saved", "fit uniform", "fit grouped"]
    rows = [
        [
            f"{row['num_tokens']:,}",
            _size(row["uniform_bytes"]),
            _size(row["grouped_bytes"]),
            f"{100 * row['grouped_saving']:.1f}%",
            f"{row['uniform_max_requests']:,}",
            f"{row['grouped_max_requests']:,}",
        ]
        for row in study.memory_rows()
    ]
    lines += ["memory per request (at its longest):", table(headers, rows), ""]
    stats = study.workload
    lines.append(
        f"serving: {stats['source']}, mean prompt {stats['mean_prompt_len']} and output "
        f"{stats['mean_output_len']} tokens, Poisson arrivals; scheduler {config.scheduler}"
    )
    for name, run_config in study.configs.items():
        lines.append(
            f"  {name}: {run_config.budget.num_tokens:,} token slots ({run_config.num_blocks:,} blocks)"
        )
    headers = [
        "rate/s",
        "allocation",
        "norm s/tok",
        "p99",
        "TTFT s",
        "req/s",
        "tok/s",
        "preempt",
        "seqs mean",
    ]
    rows = []
    for point in study.points:
        result, latency = point.result, point.result.latency
        rows.append(
            [
                f"{point.rate:g}", point.system, f"{latency.normalised_mean:.3f}",
                f"{latency.normalised_p99:.3f}", f"{latency.ttft_mean:.2f}", f"{latency.requests_per_s:.2f}",
                f"{latency.tokens_per_s:,.0f}", f"{result.num_preemptions:,}", f"{result.num_seqs_mean:.1f}",
            ]
        )  # fmt: skip
    lines += ["", table(headers, rows), ""]
    sustained, peak = study.sustained_rates(), study.peak_throughputs()
    lines.append(
        f"sustained rate (highest rate with mean normalised latency <= {study.slo:g} s per output token) "
        "and peak throughput:"
    )
    for name, rate in sustained.items():
        lines.append(f"  {name:<8} {rate:g} requests/s sustained, {peak[name]:.2f} requests/s at most")
    if sustained.get("uniform") and sustained.get("grouped"):
        lines.append(
            f"  grouped / uniform: {sustained['grouped'] / sustained['uniform']:.2f}x the sustained rate, "
            f"{peak['grouped'] / peak['uniform']:.2f}x the peak throughput"
        )
    return "\n".join(lines)
