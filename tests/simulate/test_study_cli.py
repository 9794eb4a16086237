"""``pagedkv simulate`` for the serving study: --rates, --policies with schedulers, --replicas, errors."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main

SMALL = ["--num-requests", "30", "--blocks", "64", "--block-size", "4", "--max-model-len", "256"]


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["simulate", *args, "--json", "--quiet"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_rate_sweep_json_carries_every_plotted_figure(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        capsys, "--workload", "alpaca", *SMALL, "--rates", "5,50", "--policies", "paged,contiguous-oracle"
    )
    points = data["rate_sweep"]
    assert isinstance(points, list) and len(points) == 4
    for point in points:
        latency = point["latency"]
        assert {"normalised_mean", "normalised_p99", "ttft_mean", "tokens_per_s"} <= set(latency)
        assert {"num_preemptions", "num_recomputed_tokens", "swap_bytes", "rate", "system"} <= set(point)
    assert set(data["sustained_rates"]) == {"paged", "contiguous-oracle"}  # type: ignore[arg-type]
    assert data["config"]["cost"]["name"] == "opt-13b-a100"  # type: ignore[index]


def test_check_invariants_passes_under_every_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        capsys, "--workload", "alpaca", *SMALL, "--request-rate", "40", "--policies", "schedulers",
        "--check-invariants", "--swap-space", "256MB", "--max-num-batched-tokens", "64",
    )  # fmt: skip
    policies = data["policies"]
    assert isinstance(policies, dict)
    assert sorted(policies) == sorted(
        f"paged:{name}" for name in ("greedy", "watermark", "swap", "vllm-v1", "reserve-growth")
    )
    assert all(result["num_finished"] == 30 for result in policies.values())
    assert policies["paged:swap"]["num_swapped_out_blocks"] > 0


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "prefix-aware"])
def test_replicas_with_check_invariants(capsys: pytest.CaptureFixture[str], router: str) -> None:
    data = run_json(
        capsys, "--workload", "chat", "--num-requests", "8", "--turns", "2", "--prefix-len", "40",
        "--blocks", "96", "--block-size", "8", "--prefix-caching", "--replicas", "2", "--routers", router,
        "--check-invariants", "--request-rate", "3",
    )  # fmt: skip
    (result,) = data["routers"]  # type: ignore[misc]
    assert result["router"] == router and result["num_finished"] == 16
    assert len(result["replicas"]) == 2 and "routing_us" in result["timing"]


def test_the_text_report_shows_time_and_latency(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "alpaca", *SMALL, "--request-rate", "20", "--quiet"]) == 0
    out = capsys.readouterr().out
    for label in (
        "model time (cost model)",
        "TTFT mean / p50 / p99, s",
        "normalised latency",
        "swap traffic",
    ):
        assert label in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rates", "1,x"], "--rates: 'x' is not a number of requests per second > 0"),
        (["--rates", "nan"], "--rates: 'nan' is not a number of requests per second > 0"),
        (["--rates", "1", "--sweep"], "--rates and --sweep are two studies"),
        (["--rates", "1", "--request-rate", "2"], "--rates sets the request rate itself"),
        (["--scheduler", "fifo"], "--scheduler: unknown scheduler 'fifo'; expected greedy, watermark"),
        (["--policies", "paged:fifo"], "--policies: unknown scheduler 'fifo' in 'paged:fifo'"),
        (["--cost-model", "tpu"], "--cost-model: unknown preset 'tpu'; expected opt-13b-a100"),
        (["--swap-space", "lots"], "--swap-space: not a memory size: 'lots'"),
        (["--replicas", "2", "--routers", "random"], "--routers: unknown router 'random'"),
        (
            ["--workload", "chat", "--turns", "1", "--prefix-len", "5000"],
            "system_prompt_len 5000 leaves no room",
        ),
    ],
)
def test_bad_study_flags_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["simulate", "--workload", "alpaca", *SMALL, *args, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_given_cost_parameters_change_the_model_time(capsys: pytest.CaptureFixture[str]) -> None:
    base = run_json(capsys, "--workload", "alpaca", *SMALL, "--policies", "paged")
    slow = run_json(
        capsys, "--workload", "alpaca", *SMALL, "--policies", "paged", "--memory-bandwidth", "1e11"
    )
    assert slow["policies"]["paged"]["model_s"] > 5 * base["policies"]["paged"]["model_s"]  # type: ignore[index]
    assert slow["config"]["cost"]["name"] == "opt-13b-a100 (changed)"  # type: ignore[index]


def test_the_rate_sweep_bar_goes_to_stderr_only(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--workload", "alpaca", *SMALL, "--rates", "5,50", "--policies", "paged"]
    assert main([*args, "--progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert "rate sweep" in captured.err and "2/2 runs" in captured.err
    json.loads(captured.out)  # stdout stays clean JSON
    assert main([*args, "--progress", "--quiet", "--json"]) == 0
    assert capsys.readouterr().err == ""
