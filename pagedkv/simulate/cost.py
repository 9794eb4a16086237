"""The step-time cost model: turn one simulated step's work into model seconds (a roofline).

The only place that turns counts (tokens computed, context read, blocks swapped) into
time; the counterpart of the analytic step models of vidur / LLMServingSim, not of vLLM.
The formula, its caveats and worked numbers: docs/simulate.md, "The cost model", and
docs/study.md, section 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.errors import ConfigError
from pagedkv.simulate.shape import ModelShape

__all__ = ["COST_PRESETS", "CostModel"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """A roofline step-time model of one model on one accelerator (see the module docstring).

    Attributes:
        shape: the model's KV geometry (bytes per token, layers, ``d_model``).
        num_params: the model's parameters.
        weight_dtype_bytes: bytes per weight (2 for fp16).
        memory_bandwidth: device memory bandwidth, bytes per second.
        peak_flops: dense matrix throughput, FLOP per second.
        step_overhead_s: fixed seconds per step (scheduling, sampling, launches).
        host_bandwidth: device <-> host copy bandwidth, bytes per second (swap).
        num_q_heads: query heads, when fewer KV heads serve them (grouped-query
            attention); None means as many as KV heads.
        name: a label for reports.
    """

    shape: ModelShape = field(default_factory=ModelShape)
    num_params: float = 12.85e9
    weight_dtype_bytes: int = 2
    memory_bandwidth: float = 1.555e12
    peak_flops: float = 312e12
    step_overhead_s: float = 0.002
    host_bandwidth: float = 25e9
    num_q_heads: int | None = None
    name: str = "opt-13b-a100"

    def __post_init__(self) -> None:
        for name in ("num_params", "memory_bandwidth", "peak_flops", "host_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if (
            isinstance(self.weight_dtype_bytes, bool)
            or not isinstance(self.weight_dtype_bytes, int)
            or (self.weight_dtype_bytes < 1)
        ):
            raise ConfigError(f"weight_dtype_bytes must be an int >= 1, got {self.weight_dtype_bytes!r}")
        overhead = self.step_overhead_s
        if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not overhead >= 0:
            raise ConfigError(f"step_overhead_s must be a number >= 0, got {overhead!r}")

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights every step reads once."""
        return self.num_params * self.weight_dtype_bytes

    @property
    def d_model(self) -> int:
        """The attention width: ``num_q_heads x head_dim`` (query heads default to the KV heads)."""
        num_heads = self.num_q_heads if self.num_q_heads is not None else self.shape.num_kv_heads
        return num_heads * self.shape.head_dim

    def step_time(
        self, num_tokens: int, kv_tokens_read: int, num_attention_pairs: int = 0, swapped_tokens: int = 0
    ) -> float:
        """Model seconds of one step that computes ``num_tokens`` (see the module docstring).

        A step that computes nothing (the engine idles between arrivals) costs
        only ``step_overhead_s``.

        >>> CostModel(step_overhead_s=0.001).step_time(0, 0)
        0.001
        """
        if num_tokens == 0 and swapped_tokens == 0:
            return self.step_overhead_s
        kv_bytes, compute_s = self._work(num_tokens, kv_tokens_read, num_attention_pairs)
        memory_s = (self.weight_bytes + kv_bytes) / self.memory_bandwidth
        return self.step_overhead_s + max(memory_s, compute_s) + self.transfer_time(swapped_tokens)

    def attention_read_time(
        self, num_tokens: int, kv_tokens_read: int, num_attention_pairs: int = 0
    ) -> float:
        """Seconds of a step's roofline time that reading the KV cache accounts for.

        A memory-bound step spends ``kv_tokens_read x kv_bytes_per_token /
        memory_bandwidth`` of its time reading KV; a compute-bound step hides
        the read under its FLOPs, so a slower read would not lengthen it (0).
        This is the share a slower paged attention kernel could stretch.

        >>> cost = CostModel()
        >>> round(1000 * cost.attention_read_time(num_tokens=32, kv_tokens_read=32 * 500), 2)
        8.43
        >>> cost.attention_read_time(num_tokens=2048, kv_tokens_read=2048)   # a long prefill: compute-bound
        0.0
        """
        if num_tokens == 0:
            return 0.0
        kv_bytes, compute_s = self._work(num_tokens, kv_tokens_read, num_attention_pairs)
        kv_s = kv_bytes / self.memory_bandwidth
        return 0.0 if self.weight_bytes / self.memory_bandwidth + kv_s < compute_s else kv_s

    def _work(self, num_tokens: int, kv_tokens_read: int, num_attention_pairs: int) -> tuple[float, float]:
        """A step's work for the roofline: the KV bytes it reads, and its FLOPs' time at peak."""
        shape = self.shape
        flops = 2 * self.num_params * num_tokens + 4 * shape.num_layers * self.d_model * num_attention_pairs
        return kv_tokens_read * shape.bytes_per_token, flops / self.peak_flops

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` token slots of KV between device and host."""
        return num_tokens * self.shape.bytes_per_token / self.host_bandwidth

    def describe(self) -> dict[str, float | int | str]:
        """The parameters as plain values (for reports)."""
        return {
            "name": self.name,
            "num_params": self.num_params,
            "weight_bytes": self.weight_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "peak_flops": self.peak_flops,
            "step_overhead_s": self.step_overhead_s,
            "host_bandwidth": self.host_bandwidth,
            "kv_bytes_per_token": self.shape.bytes_per_token,
        }


#: Named settings. ``opt-13b-a100``: OPT-13B (12.85 B parameters, fp16) on one
#: A100 40GB (1,555 GB/s HBM2, 312 TFLOP/s dense fp16, PCIe 4.0 x16 at about
#: 25 GB/s to the host): the PagedAttention paper's single-GPU setting.
#: ``llama-3-8b-h100``: Llama-3-8B (8.03 B, 8 KV heads of 128, 32 layers) on one
#: H100 SXM (3,350 GB/s, 989 TFLOP/s, PCIe 5.0 at about 50 GB/s).
COST_PRESETS: dict[str, CostModel] = {
    "opt-13b-a100": CostModel(),
    "llama-3-8b-h100": CostModel(
        shape=ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2),
        num_params=8.03e9,
        memory_bandwidth=3.35e12,
        peak_flops=989e12,
        step_overhead_s=0.002,
        host_bandwidth=50e9,
        num_q_heads=32,
        name="llama-3-8b-h100",
    ),
}
