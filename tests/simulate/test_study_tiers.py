"""The host-tier study (issue 31): a real HostTier below the simulated device prefix cache."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.simulate import Budget, PagedEngine, SimConfig
from pagedkv.simulate.conversations import conversations
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.tierstudy import format_tier_study, tier_study

# Tiny: 24 chats under 2 system prompts of 64 tokens, 96 device blocks of 4 (the cache must evict).
WORKLOAD = conversations(24, num_system_prompts=2, system_prompt_len=64, seed=0, max_model_len=256)
CONFIG = SimConfig(Budget.from_blocks(96, 4), block_size=4, enable_prefix_caching=True, check_every_step=True)


def _run(num_host_tier_blocks: int, **cost: float) -> PagedEngine:
    config = dataclasses.replace(CONFIG, num_host_tier_blocks=num_host_tier_blocks, cost=CostModel(**cost))
    engine = PagedEngine(WORKLOAD, config)
    engine.run()
    return engine


def test_host_tier_turns_device_misses_into_host_hits_and_charges_loads() -> None:
    without, with_host = _run(0).result, _run(2000).result
    assert without.num_tier_hit_tokens == 0 and without.tier_load_s == 0.0
    assert with_host.num_tier_hit_tokens > 0
    assert with_host.prefix_hit_rate > without.prefix_hit_rate
    assert with_host.prefix_hit_rate == pytest.approx(with_host.device_hit_rate + with_host.tier_hit_rate)
    assert with_host.num_prefill_tokens < without.num_prefill_tokens  # loaded, not computed
    # every loaded block is priced at the host bandwidth: 4 slots x bytes per token / 25 GB/s
    cost = CostModel()
    assert with_host.tier_load_s == pytest.approx(cost.transfer_time(4 * with_host.num_tier_loaded_blocks))


def test_host_tier_load_time_scales_with_host_bandwidth() -> None:
    fast, slow = _run(2000, host_bandwidth=50e9).result, _run(2000, host_bandwidth=5e9).result
    assert fast.num_tier_loaded_blocks == slow.num_tier_loaded_blocks  # the memory story is the same
    assert fast.tier_load_s > 0
    assert slow.tier_load_s == pytest.approx(10 * fast.tier_load_s)


def test_host_tier_needs_prefix_caching_and_full_attention() -> None:
    with pytest.raises(ConfigError, match="turn prefix caching on"):
        dataclasses.replace(CONFIG, enable_prefix_caching=False, num_host_tier_blocks=8)
    with pytest.raises(ConfigError, match="leave out the window"):
        dataclasses.replace(CONFIG, max_size=64, num_host_tier_blocks=8)
    with pytest.raises(ConfigError, match="host_tier_policy"):
        dataclasses.replace(CONFIG, num_host_tier_blocks=8, host_tier_policy="arc")


def test_tier_study_rows_per_size_and_text() -> None:
    study = tier_study(WORKLOAD, dataclasses.replace(CONFIG, check_every_step=False), [200, 0, 200])
    assert [point.num_host_tier_blocks for point in study.points] == [0, 200]
    text = format_tier_study(study)
    assert "hit device" in text and "TTFT mean s" in text
    data = study.as_dict()["host_tier"]
    assert data[0]["host_hit_rate"] == 0.0 and data[1]["host_hit_rate"] > 0.0


def test_tier_study_refuses_a_bad_size_before_any_run() -> None:
    with pytest.raises(ConfigError, match="num_host_tier_blocks"):
        tier_study(WORKLOAD, CONFIG, [0, -1])


ARGS = ["simulate", "--workload", "chat", "--prefix-caching", "--num-requests", "24", "--blocks", "96",
        "--max-model-len", "256", "--block-size", "4", "--prefix-len", "64", "--quiet"]  # fmt: skip


def test_cli_host_tier_sweep_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--host-tier-sweep", "0,100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["host_tier"]
    assert [row["num_host_tier_blocks"] for row in rows] == [0, 100]
    wanted = {"device_hit_rate", "host_hit_rate", "hit_rate", "ttft_mean", "ttft_p50", "ttft_p99"}
    assert wanted <= set(rows[0])


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--host-tier-sweep", "0,x"], "--host-tier-sweep"),
        (["--host-tier-sweep", "0,10", "--host-tier-blocks", "5"], "leave out --host-tier-blocks"),
        (["--host-tier-sweep", "0,10", "--sweep"], "two studies"),
    ],
)
def test_cli_host_tier_sweep_bad_usage(
    extra: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ARGS, *extra]) == 2
    assert fragment in capsys.readouterr().err


def test_cli_host_tier_blocks_without_prefix_caching(capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in ARGS if a != "--prefix-caching"]
    assert main([*args, "--host-tier-blocks", "8"]) == 2
    assert "add --prefix-caching" in capsys.readouterr().err
