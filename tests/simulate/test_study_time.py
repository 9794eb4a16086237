"""The cost model, the clock and latency: hand-computed times, Poisson arrivals, errors."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from pagedkv.errors import ConfigError
from pagedkv.simulate import Budget, Request, SimConfig, Workload, synthetic
from pagedkv.simulate.baseline import ContiguousEngine
from pagedkv.simulate.cost import COST_PRESETS, CostModel
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.latency import summarize
from pagedkv.simulate.shape import ModelShape
from pagedkv.simulate.workload import WorkloadError

#: Every step costs exactly one model second: no bandwidth or FLOP limit to speak of.
UNIT = CostModel(memory_bandwidth=1e30, peak_flops=1e30, host_bandwidth=1e30, step_overhead_s=1.0)


def test_step_time_is_the_documented_roofline() -> None:
    shape = ModelShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # 32 bytes per token
    cost = CostModel(
        shape=shape, num_params=100, weight_dtype_bytes=1, memory_bandwidth=1000.0, peak_flops=10_000.0,
        step_overhead_s=0.5, host_bandwidth=64.0,
    )  # fmt: skip
    # memory: (100 weight bytes + 10 tokens x 32) / 1000 = 0.42 s
    # beats compute: (2 x 100 params x 3 tokens + 4 x 2 layers x 4 d_model x 5 pairs) / 1e4 = 0.076 s
    assert cost.step_time(3, 10, 5) == pytest.approx(0.5 + 0.42)
    # compute-bound: 2 x 100 x 100 / 1e4 = 2 s > memory (100 + 0) / 1000
    assert cost.step_time(100, 0) == pytest.approx(0.5 + 2.0)
    # swap traffic adds 2 tokens x 32 bytes / 64 bytes per s = 1 s
    assert cost.step_time(3, 10, 5, swapped_tokens=2) == pytest.approx(0.5 + 0.42 + 1.0)
    assert cost.step_time(0, 0) == 0.5  # an idle step: the overhead only


def test_grouped_query_heads_widen_the_attention_flops() -> None:
    preset = COST_PRESETS["llama-3-8b-h100"]
    assert preset.d_model == 32 * 128
    assert dataclasses.replace(preset, num_q_heads=None).d_model == 8 * 128


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("num_params", 0, "num_params must be a number > 0, got 0"),
        ("memory_bandwidth", -1.0, "memory_bandwidth must be a number > 0"),
        ("peak_flops", float("nan"), "peak_flops must be a number > 0"),
        ("host_bandwidth", True, "host_bandwidth must be a number > 0"),
        ("step_overhead_s", -0.1, "step_overhead_s must be a number >= 0, got -0.1"),
        ("weight_dtype_bytes", 0, "weight_dtype_bytes must be an int >= 1"),
    ],
)
def test_bad_cost_parameters_raise_config_errors(field: str, value: object, fragment: str) -> None:
    preset = COST_PRESETS["opt-13b-a100"]
    before = dataclasses.asdict(preset)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        dataclasses.replace(preset, **{field: value})
    assert dataclasses.asdict(preset) == before


def test_one_request_timeline_by_hand() -> None:
    # prompt 4, output 2, one model second per step:
    #   step 0 prefill (first token at t=1), steps 1 and 2 decode; freed at the end of step 2 (t=3).
    workload = Workload((Request(0, prompt_len=4, output_len=2),), max_model_len=8)
    config = SimConfig(Budget(64), block_size=4, cost=UNIT, check_every_step=True)
    for result in (
        PagedEngine(workload, config).run(),
        ContiguousEngine(workload, config.budget, cost=UNIT).run(),
    ):
        latency = result.latency
        assert (result.model_s, latency.ttft_mean, latency.e2e_mean) == (3.0, 1.0, 3.0)
        assert (latency.tpot_mean, latency.normalised_mean) == (1.0, 1.5)
        assert latency.requests_per_s == pytest.approx(1 / 3)


def test_an_idle_engine_jumps_to_the_next_arrival() -> None:
    # The second request arrives at t=100 when nothing runs: it waits one step, not 100.
    workload = Workload(
        (Request(0, 4, 1, arrival_s=0.0), Request(1, 4, 1, arrival_s=100.0)), max_model_len=16
    )
    config = SimConfig(Budget(64), block_size=4, cost=UNIT, check_every_step=True)
    paged = PagedEngine(workload, config).run()
    contiguous = ContiguousEngine(workload, config.budget, cost=UNIT).run()
    for result in (paged, contiguous):
        assert result.num_steps == 4
        assert result.model_s == 102.0
        assert result.latency.e2e_p50 == 2.0 and result.latency.ttft_mean == 1.0


def test_poisson_rates_scale_one_draw() -> None:
    slow = synthetic("sharegpt", 50, seed=3, request_rate=1.0)
    fast = synthetic("sharegpt", 50, seed=3, request_rate=4.0)
    assert [(r.prompt_len, r.output_len) for r in slow.requests] == [
        (r.prompt_len, r.output_len) for r in fast.requests
    ]
    for a, b in zip(slow.requests, fast.requests):
        assert a.arrival_s == pytest.approx(4 * b.arrival_s)  # type: ignore[operator]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(slow.requests, slow.requests[1:])]  # type: ignore[operator]
    assert all(gap >= 0 for gap in gaps)
    with pytest.raises(WorkloadError, match="request_rate must be > 0 requests per second, got 0"):
        synthetic("sharegpt", 5, request_rate=0)


def test_latency_summary_matches_a_plain_python_oracle() -> None:
    records = [(0.1 * i, 0.1 * i + 0.5 + 0.01 * i, 0.1 * i + 3.0 + 0.2 * (i % 7), 10 + i) for i in range(41)]
    latency = summarize(records, num_generated_tokens=999)
    normalised = [(finish - arrival) / tokens for arrival, _, finish, tokens in records]
    assert latency.normalised_mean == pytest.approx(sum(normalised) / len(normalised))
    assert latency.normalised_p50 == pytest.approx(statistics.median(normalised))
    ttft = sorted(first - arrival for arrival, first, _, _ in records)
    assert latency.ttft_p90 == pytest.approx(statistics.quantiles(ttft, n=10, method="inclusive")[-1])
    span = max(r[2] for r in records) - min(r[0] for r in records)
    assert latency.tokens_per_s == pytest.approx(999 / span)
    assert summarize([], num_generated_tokens=0).num_requests == 0


def test_results_carry_time_in_as_dict() -> None:
    workload = synthetic("alpaca", 20, seed=0, request_rate=20.0)
    data = PagedEngine(workload, SimConfig(Budget(512), block_size=8)).run().as_dict()
    assert data["model_s"] > 0 and data["latency"]["num_requests"] == 20
    assert set(data["latency"]) >= {"ttft_p99", "tpot_mean", "normalised_p50", "requests_per_s"}


def test_the_clock_check_catches_a_record_out_of_order() -> None:
    from pagedkv.simulate.clock import Clock

    clock = Clock(UNIT)
    clock.end_step(1, 1)
    clock.end_step(1, 1)
    clock.record(arrival_s=0.0, first_step=0, finish_step=1, num_output_tokens=1)
    clock.check_invariants()
    # planted: this request arrived after its first token
    clock.record(arrival_s=5.0, first_step=0, finish_step=1, num_output_tokens=1)
    with pytest.raises(AssertionError, match=r"a request arrived 5\.0, first token 1\.0"):
        clock.check_invariants()
