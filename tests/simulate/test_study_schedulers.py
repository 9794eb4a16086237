"""Schedulers as choices: every preset on the real manager, invariants every step, what each bounds."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.simulate import Budget, PagedEngine, SimConfig, synthetic
from pagedkv.simulate.ratesweep import rate_sweep, sustained_rates
from pagedkv.simulate.report import run_policy
from pagedkv.simulate.scheduler import SCHEDULERS, parse_system, with_scheduler

#: A host pool of 64 blocks of 4 at OPT-13B's 819,200 bytes per token.
SWAP_SPACE = 64 * 4 * 819_200


def tight(name: str, *, prefix: bool = False, n: int = 1, budget: int | None = None) -> SimConfig:
    config = SimConfig(Budget(256), block_size=4, check_every_step=True, enable_prefix_caching=prefix)
    overrides = {} if budget is None else {"max_num_batched_tokens": budget}
    return with_scheduler(config, name, swap_space_bytes=SWAP_SPACE, **overrides)


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize(("prefix", "n", "sampling"), [(False, 1, "parallel"), (True, 3, "beam")])
def test_every_scheduler_keeps_the_invariants_under_pressure(
    name: str, prefix: bool, n: int, sampling: str
) -> None:
    # 20 requests fill the 256 tokens many times over: every scheduler but reserve-growth
    # preempts 13-46 times, swap moves hundreds of blocks, beams hit the prefix cache and
    # greedy aborts a beam group (40 requests took twice as long and aborted none).
    workload = synthetic(
        "alpaca", 20, seed=1, n=n, sampling=sampling, num_prefix_groups=2, prefix_len=12,
        request_rate=50.0, max_model_len=256,
    )  # fmt: skip
    result = PagedEngine(
        workload, tight(name, prefix=prefix, n=n, budget=32 if name == "vllm-v1" else None)
    ).run()
    assert result.num_finished + result.num_aborted == 20
    assert result.num_preemptions > 0 or name == "reserve-growth"
    assert result.latency.num_requests == result.num_finished
    if name == "swap":
        assert result.num_swapped_out_blocks > 0
        assert result.num_swapped_in_blocks == result.num_swapped_out_blocks  # everything came back
        assert result.swap_bytes == 2 * result.num_swapped_out_blocks * 4 * 819_200


def test_swap_recomputes_nothing_when_the_host_has_room() -> None:
    workload = synthetic("alpaca", 40, seed=1, request_rate=50.0, max_model_len=256)
    greedy = PagedEngine(workload, tight("greedy")).run()
    swap = PagedEngine(workload, tight("swap")).run()
    assert greedy.num_recomputed_tokens > 0
    assert swap.num_recomputed_tokens == 0 and swap.swap_s > 0


def test_thrash_bounding_schedulers_preempt_less_than_greedy() -> None:
    # 60 requests (seeds 0-3: greedy 77-94, watermark 46-58, reserve-growth 26-33 preemptions).
    workload = synthetic("sharegpt", 60, seed=0, max_model_len=1024)
    config = SimConfig(Budget(2048), block_size=16)
    counts = {name: run_policy(f"paged:{name}", workload, config).num_preemptions for name in SCHEDULERS}
    assert counts["greedy"] > 0
    assert counts["reserve-growth"] < counts["watermark"] < counts["greedy"]


def test_the_token_budget_and_chunked_prefill_hold_every_step() -> None:
    # Plenty of memory, so nothing is preempted: every step computes at most the budget.
    workload = synthetic("sharegpt", 12, seed=2, max_model_len=1024)
    config = with_scheduler(SimConfig(Budget(20_000), block_size=16), "vllm-v1", max_num_batched_tokens=64)
    engine = PagedEngine(workload, config)
    per_step: list[int] = []
    last = [0]

    def observe(engine: PagedEngine) -> None:
        done = engine.result.num_prefill_tokens + engine.result.num_decode_tokens
        per_step.append(done - last[0])
        last[0] = done

    result = engine.run(observer=observe)
    assert result.num_preemptions == 0 and result.num_finished == 12
    assert max(per_step) == 64  # the budget is used, never passed
    longest = max(r.prompt_len for r in workload.requests)
    assert longest > 64  # so that prompt was fed in chunks over several steps
    assert result.latency.ttft_p99 > result.latency.tpot_p99


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"preempt_mode": "swap"}, "preempt_mode 'swap' needs num_host_blocks >= 1"),
        ({"preempt_mode": "evict"}, "preempt_mode must be 'recompute' or 'swap', got 'evict'"),
        ({"chunked_prefill": True}, "chunked_prefill needs a token budget"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be None or an int >= 1, got 0"),
        ({"growth_reserve_steps": -1}, "growth_reserve_steps must be an int >= 0, got -1"),
    ],
)
def test_bad_scheduler_knobs_raise_config_errors(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SimConfig(Budget(256), block_size=4, **fields)  # type: ignore[arg-type]


def test_unknown_scheduler_names_are_refused_and_the_config_is_untouched() -> None:
    config = SimConfig(Budget(256), block_size=4)
    with pytest.raises(ConfigError, match="unknown scheduler 'fifo'; expected one of greedy, watermark"):
        with_scheduler(config, "fifo")
    with pytest.raises(ConfigError, match="unknown scheduler 'fifo' in 'paged:fifo'"):
        parse_system("paged:fifo")
    with pytest.raises(ConfigError, match="unknown policy 'contiguous:swap'"):
        parse_system("contiguous:swap")
    assert config.scheduler == "greedy" and config.watermark == 0.01


def test_the_paged_manager_sustains_higher_rates_than_every_reservation() -> None:
    config = SimConfig(Budget(4096), block_size=16)
    points = rate_sweep(
        "sharegpt", 150, config, [0.25, 0.5, 1.0], ["paged", "contiguous", "contiguous-oracle"],
        workload_options={"max_model_len": 1024},
    )  # fmt: skip
    sustained = sustained_rates(points, slo=0.03)
    # measured: paged 1.0, oracle 0.5, max length 0.25 requests/s
    assert sustained["paged"] > sustained["contiguous-oracle"] > sustained["contiguous"]
    paged = [p.result.latency.normalised_mean for p in points if p.system == "paged"]
    assert paged[-1] > paged[0]  # latency grows with the rate


def test_a_second_preset_keeps_the_caller_s_knobs_and_drops_the_first_preset_s() -> None:
    # report.run_policy("paged:NAME") applies NAME on top of the --scheduler preset the
    # command line already applied: only the presets' knobs may change, never the caller's.
    from pagedkv.simulate import Budget, SimConfig, with_scheduler

    base = SimConfig(Budget(8192), block_size=16)
    once = with_scheduler(base, "greedy", watermark=0.05)
    twice = with_scheduler(with_scheduler(base, "vllm-v1", watermark=0.05), "greedy")
    assert (twice.max_num_seqs, twice.watermark, twice.chunked_prefill) == (None, 0.05, False)
    assert twice == once
    swap = with_scheduler(base, "swap", swap_space_bytes=2**20)
    assert with_scheduler(swap, "swap").num_host_blocks == swap.num_host_blocks
    capped = SimConfig(Budget(8192), block_size=16, max_num_seqs=7)
    assert with_scheduler(with_scheduler(capped, "vllm-v1"), "greedy").max_num_seqs == 7
