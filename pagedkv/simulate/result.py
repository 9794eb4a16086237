"""What one policy's simulation measured: :class:`PolicyResult`, and how it is accumulated.

Owns :class:`PolicyResult`, :class:`Series` and :class:`Accumulator`: memory split into live,
reserved-unfilled and free at every measured step, counters, and timing kept apart from the
deterministic fields. Models the PagedAttention paper's memory-waste breakdown (Figure 2).
The split and what occupancy means: docs/simulate.md, "What a run measured".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.simulate.clock import Clock
from pagedkv.simulate.latency import Latency, summarize

__all__ = ["PolicyResult", "Series"]


@dataclass
class Series:
    """Sampled time series for plots: one entry per sampled step.

    Attributes:
        steps: the step numbers.
        live: live token slots / budget.
        unfilled: reserved or held slots holding no token / budget.
        never_used: of ``unfilled``, slots the requests will never fill
            (contiguous over-reservation; 0 for paged).
        num_seqs: sequences running.
        num_used_blocks: paged only: blocks held.
    """

    steps: list[int] = field(default_factory=list)
    live: list[float] = field(default_factory=list)
    unfilled: list[float] = field(default_factory=list)
    never_used: list[float] = field(default_factory=list)
    num_seqs: list[int] = field(default_factory=list)


@dataclass
class PolicyResult:
    """Measurements of one policy over one workload.

    Attributes:
        policy: ``"paged"``, ``"contiguous"``, ``"contiguous-pow2"`` or ``"contiguous-oracle"``.
        num_steps: simulated steps (one forward pass each) until the last request ended.
        num_finished: requests served to the end.
        num_aborted: requests dropped because they alone outgrew the whole memory.
        num_rejected: requests a contiguous policy could never reserve room for.
        num_prefill_tokens: tokens written by prefills (recomputation included).
        num_decode_tokens: tokens written by decode steps.
        num_recomputed_tokens: of the prefill tokens, those re-fed after preemption.
        num_generated_tokens: output tokens of finished requests (every sample).
        generated_tokens_per_step: ``num_generated_tokens / num_steps``: the
            model-free throughput (a step is one forward pass).
        occupancy_mean: mean share of the memory holding live tokens.
        occupancy_peak: the largest share seen.
        occupancy_loaded_mean: the mean over steps when requests were waiting
            (the memory-bound regime the paper measured).
        unfilled_mean: mean share reserved or held but holding no token (waste).
        never_used_mean: of it, reserved room the requests never fill.
        free_mean: mean share not reserved by anyone.
        waste_of_used_mean: mean of unfilled / (live + unfilled): the waste
            inside the memory actually taken (the paper: under 4% for paging).
        external_fragmentation_mean: contiguous: mean share of the memory that
            is free but in holes too small for the waiting request.
        num_seqs_mean, num_seqs_peak: sequences running per step.
        num_requests_mean, num_requests_peak: requests running per step.
        num_preemptions: requests preempted (recompute mode) by the scheduler.
        num_prefix_query_tokens: prompt tokens looked up on first admission.
        num_prefix_hit_tokens: of those, tokens found cached.
        prefix_hit_rate: hits / queries (0 if none).
        num_resumed_reuse_tokens: tokens a preempted request found cached on resume.
        num_tier_hit_tokens: of the hit tokens, those loaded from the host
            tier (``SimConfig.num_host_tier_blocks``) rather than found on device.
        num_tier_loaded_blocks: blocks loaded from the host tier (first
            admissions and re-admissions).
        blocks_saved_mean, blocks_saved_peak: blocks the running sequences'
            tables hold beyond the distinct blocks used (forks, prefix hits).
        sharing_saving_mean: mean of saved / (used + saved): the memory saved
            against the same sequences unshared.
        num_samples: measured steps behind the means.
        scheduler: the paged policy's scheduler (empty for contiguous ones).
        num_swapped_out_blocks, num_swapped_in_blocks: blocks copied to and
            from the host by swap preemption.
        swap_bytes: bytes those copies moved (modeled model's KV bytes).
        model_s: model seconds until the last step ended (the cost model's time).
        busy_s: of it, seconds of steps that computed something.
        swap_s: of it, seconds spent copying KV to and from the host.
        tier_load_s: of it, seconds spent loading blocks from the host tier.
        attention_s: of ``busy_s``, seconds memory-bound steps spent reading
            KV (what a slower attention kernel could stretch).
        latency: what requests saw, in model seconds (:mod:`pagedkv.simulate.latency`).
        wall_s: wall-clock seconds of the run (not deterministic).
        cpu_s: CPU seconds this process spent on it (steadier than wall time
            on a shared machine; not deterministic either).
        series: the sampled time series (not in ``as_dict``).
    """

    policy: str
    num_steps: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_generated_tokens: int = 0
    generated_tokens_per_step: float = 0.0
    occupancy_mean: float = 0.0
    occupancy_peak: float = 0.0
    occupancy_loaded_mean: float = 0.0
    unfilled_mean: float = 0.0
    never_used_mean: float = 0.0
    free_mean: float = 0.0
    waste_of_used_mean: float = 0.0
    external_fragmentation_mean: float = 0.0
    num_seqs_mean: float = 0.0
    num_seqs_peak: int = 0
    num_requests_mean: float = 0.0
    num_requests_peak: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    prefix_hit_rate: float = 0.0
    num_resumed_reuse_tokens: int = 0
    num_tier_hit_tokens: int = 0
    num_tier_loaded_blocks: int = 0
    blocks_saved_mean: float = 0.0
    blocks_saved_peak: int = 0
    sharing_saving_mean: float = 0.0
    num_samples: int = 0
    scheduler: str = ""
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    swap_bytes: int = 0
    model_s: float = 0.0
    busy_s: float = 0.0
    swap_s: float = 0.0
    tier_load_s: float = 0.0
    attention_s: float = 0.0
    latency: Latency = field(default_factory=Latency)
    wall_s: float = field(default=0.0, compare=False)
    cpu_s: float = field(default=0.0, compare=False)
    series: Series = field(default_factory=Series, compare=False, repr=False)

    @property
    def device_hit_rate(self) -> float:
        """Prompt tokens found cached on device / prompt tokens looked up (0 if none)."""
        num_query = self.num_prefix_query_tokens
        return (self.num_prefix_hit_tokens - self.num_tier_hit_tokens) / num_query if num_query else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Prompt tokens loaded from the host tier / prompt tokens looked up (0 if none)."""
        num_query = self.num_prefix_query_tokens
        return self.num_tier_hit_tokens / num_query if num_query else 0.0

    @property
    def num_simulated_tokens(self) -> int:
        """Tokens written to KV memory: prefill (recomputation included) and decode."""
        return self.num_prefill_tokens + self.num_decode_tokens

    def as_dict(self) -> dict[str, Any]:
        """The deterministic fields, rounded for reading (same seed, same dict)."""
        data = asdict(self)
        del data["wall_s"], data["cpu_s"], data["series"]
        data["latency"] = {key: _round(value) for key, value in data["latency"].items()}
        return {key: _round(value) for key, value in data.items()}

    def timing(self) -> dict[str, float]:
        """Wall-clock fields: seconds, and simulated tokens per wall-clock and per CPU second."""
        rate = self.num_simulated_tokens / self.wall_s if self.wall_s > 0 else 0.0
        cpu_rate = self.num_simulated_tokens / self.cpu_s if self.cpu_s > 0 else 0.0
        return {
            "wall_s": round(self.wall_s, 3),
            "simulated_tokens_per_s": round(rate, 1),
            "cpu_s": round(self.cpu_s, 3),
            "simulated_tokens_per_cpu_s": round(cpu_rate, 1),
        }


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


class Accumulator:
    """Sums and peaks of per-step measurements, turned into a :class:`PolicyResult`.

    ``on_step`` takes the cheap counts of every step; ``on_sample`` the memory
    split of a measured step (every step for contiguous policies, every
    ``sample_every`` steps for paged ones); ``record`` steps also go to the series.
    """

    def __init__(self, result: PolicyResult, budget_slots: int) -> None:
        self.result = result
        self._budget = budget_slots
        self._num_steps = 0
        self._sum_seqs = 0
        self._sum_requests = 0
        self._sums = dict.fromkeys(
            ("live", "unfilled", "never_used", "free", "waste", "external", "saved", "saving"), 0.0
        )
        self._num_samples = 0
        self._loaded_sum = 0.0
        self._num_loaded = 0

    def on_step(self, num_seqs: int, num_requests: int) -> None:
        """Count one step's running sequences and requests."""
        result = self.result
        self._num_steps += 1
        self._sum_seqs += num_seqs
        self._sum_requests += num_requests
        if num_seqs > result.num_seqs_peak:
            result.num_seqs_peak = num_seqs
        if num_requests > result.num_requests_peak:
            result.num_requests_peak = num_requests

    def on_sample(
        self,
        step: int,
        *,
        live: int,
        unfilled: int,
        never_used: int = 0,
        external: int = 0,
        blocks_saved: int = 0,
        num_used_blocks: int = 0,
        num_seqs: int = 0,
        loaded: bool = False,
        record: bool = True,
    ) -> None:
        """Add one measured step's memory split (in token slots)."""
        budget = self._budget
        sums = self._sums
        occupancy = live / budget
        sums["live"] += occupancy
        sums["unfilled"] += unfilled / budget
        sums["never_used"] += never_used / budget
        sums["free"] += (budget - live - unfilled) / budget
        sums["waste"] += unfilled / (live + unfilled) if live + unfilled else 0.0
        sums["external"] += external / budget
        sums["saved"] += blocks_saved
        total = blocks_saved + num_used_blocks
        sums["saving"] += blocks_saved / total if total else 0.0
        self._num_samples += 1
        result = self.result
        if occupancy > result.occupancy_peak:
            result.occupancy_peak = occupancy
        if blocks_saved > result.blocks_saved_peak:
            result.blocks_saved_peak = blocks_saved
        if loaded:
            self._loaded_sum += occupancy
            self._num_loaded += 1
        if record:
            series = result.series
            series.steps.append(step)
            series.live.append(occupancy)
            series.unfilled.append(unfilled / budget)
            series.never_used.append(never_used / budget)
            series.num_seqs.append(num_seqs)

    def finish(self, wall_s: float, cpu_s: float = 0.0, clock: Clock | None = None) -> PolicyResult:
        """Fill in the means (and, with ``clock``, the model time and latency) and return the result."""
        result = self.result
        if clock is not None:
            result.model_s = clock.now
            result.busy_s = clock.busy_s
            result.swap_s = clock.transfer_s
            result.tier_load_s = clock.tier_load_s
            result.attention_s = clock.attention_s
            result.latency = summarize(clock.records, num_generated_tokens=result.num_generated_tokens)
        steps, samples = max(1, self._num_steps), max(1, self._num_samples)
        sums = self._sums
        result.num_steps = self._num_steps
        result.num_samples = self._num_samples
        result.num_seqs_mean = self._sum_seqs / steps
        result.num_requests_mean = self._sum_requests / steps
        result.occupancy_mean = sums["live"] / samples
        result.unfilled_mean = sums["unfilled"] / samples
        result.never_used_mean = sums["never_used"] / samples
        result.free_mean = sums["free"] / samples if self._num_samples else 1.0
        result.waste_of_used_mean = sums["waste"] / samples
        result.external_fragmentation_mean = sums["external"] / samples
        result.blocks_saved_mean = sums["saved"] / samples
        result.sharing_saving_mean = sums["saving"] / samples
        result.occupancy_loaded_mean = self._loaded_sum / self._num_loaded if self._num_loaded else 0.0
        result.generated_tokens_per_step = result.num_generated_tokens / steps
        if result.num_prefix_query_tokens:
            result.prefix_hit_rate = result.num_prefix_hit_tokens / result.num_prefix_query_tokens
        result.wall_s = wall_s
        result.cpu_s = cpu_s
        return result
