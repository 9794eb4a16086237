"""The hybrid-model study: vLLM's KV-cache groups against uniform allocation, in memory and in rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.counts import window_blocks
from pagedkv.errors import ConfigError
from pagedkv.simulate.config import Budget, SimConfig, parse_bytes
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.hybrid import (
    HYBRID_PRESETS,
    HybridModel,
    KVCacheGroup,
    format_hybrid,
    hybrid_study,
)
from pagedkv.simulate.shape import ModelShape

GEMMA = HYBRID_PRESETS["gemma3-27b-like"]
GPT_OSS = HYBRID_PRESETS["gpt-oss-like"]


def _model(windows: tuple[int | None, ...]) -> HybridModel:
    shape = ModelShape(num_layers=len(windows), num_kv_heads=1, head_dim=4, dtype_bytes=2)
    return HybridModel("tiny", windows, 1, 4, 2, CostModel(shape=shape))


def _layout(model: HybridModel) -> list[tuple[int | None, int, int]]:
    return [(g.window, g.num_layers, g.num_padded_layers) for g in model.groups()]


# ------------------------------------------------------------------ the groups


def test_gemma3_splits_into_seven_groups_of_ten_the_last_window_group_padded() -> None:
    # 62 layers, every sixth full: 10 full, 52 window 1024. Group size 10 (the "1" of 5:1):
    #   full(10) | win(10) win(10) win(10) win(10) win(10) win(2 real + 8 padding)
    assert _layout(GEMMA) == [(None, 10, 10)] + [(1024, 10, 10)] * 5 + [(1024, 2, 10)]


def test_gpt_oss_splits_into_one_full_and_one_window_group_of_eighteen() -> None:
    assert _layout(GPT_OSS) == [(None, 18, 18), (128, 18, 18)]


def test_counts_within_a_quarter_of_each_other_pad_to_the_larger() -> None:
    # vLLM's rule for e.g. 12 window + 13 full layers: 2 groups of 13, not 3 groups of 12.
    model = _model(tuple([8] * 12 + [None] * 13))
    assert _layout(model) == [(None, 13, 13), (8, 12, 13)]


def test_presets_have_the_real_configs_geometry() -> None:
    assert (GEMMA.shape.num_layers, GEMMA.num_kv_heads, GEMMA.head_dim) == (62, 16, 128)
    assert (GPT_OSS.shape.num_layers, GPT_OSS.num_kv_heads, GPT_OSS.head_dim) == (36, 8, 64)
    assert GEMMA.layer_windows[:6] == (1024,) * 5 + (None,)
    assert GPT_OSS.layer_windows[:2] == (128, None)


# ------------------------------------------------------------ memory per request


def test_a_window_group_never_holds_more_than_its_window_blocks() -> None:
    group = KVCacheGroup(window=10, num_layers=1, num_padded_layers=1)
    # block_size 4, window 10: ceil(10 / 4) + 1 = 4 blocks at most, however long the sequence.
    assert [group.num_blocks(n, 4) for n in (1, 4, 5, 12, 13, 16, 17, 1000)] == [1, 1, 2, 3, 4, 4, 4, 4]
    assert window_blocks(10, 4) == 4


def test_bytes_per_request_by_hand_for_gpt_oss() -> None:
    layer_block = 16 * 8 * 64 * 2 * 2  # block_size x kv heads x head_dim x (K, V) x bf16
    # 1,000 tokens: 63 blocks; the window group keeps ceil(128 / 16) + 1 = 9 of them.
    assert GPT_OSS.bytes_per_request(1000, 16, "uniform") == 63 * 36 * layer_block
    assert GPT_OSS.bytes_per_request(1000, 16, "grouped") == (63 * 18 + 9 * 18) * layer_block
    # Shorter than the window: both layouts hold the same.
    assert GPT_OSS.bytes_per_request(100, 16, "grouped") == GPT_OSS.bytes_per_request(100, 16, "uniform")


def test_grouped_costs_more_than_uniform_below_the_window_padding_and_far_less_beyond_it() -> None:
    # Gemma 3 below its window: 70 padded layer slots against 62 layers (12.9% more).
    short = GEMMA.bytes_per_request(1024, 16, "grouped") / GEMMA.bytes_per_request(1024, 16, "uniform")
    assert short == pytest.approx(70 / 62)
    # 8k tokens: 10 x 512 + 60 x 65 layer-blocks against 62 x 512: about 3.5x less.
    ratio = GEMMA.bytes_per_request(8192, 16, "uniform") / GEMMA.bytes_per_request(8192, 16, "grouped")
    assert ratio == pytest.approx(62 * 512 / (10 * 512 + 60 * 65))


def test_tokens_per_byte_is_exact_for_uniform_allocation() -> None:
    from pagedkv.simulate.synthetic import synthetic

    workload = synthetic("sharegpt", 30, seed=0)
    assert GEMMA.tokens_per_byte(workload, 16, "uniform") == pytest.approx(1 / GEMMA.shape.bytes_per_token)


def test_unknown_allocation_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown allocation 'paged'; expected grouped or uniform"):
        GEMMA.bytes_per_request(10, 16, "paged")


@pytest.mark.parametrize(
    ("windows", "fragment"),
    [((), "needs at least one layer"), ((0, None), "a window must be None or an int >= 1, got 0")],
)
def test_a_malformed_model_is_a_config_error(windows: tuple[int | None, ...], fragment: str) -> None:
    shape = ModelShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2)
    with pytest.raises(ConfigError, match=fragment):
        HybridModel("bad", windows, 1, 4, 2, CostModel(shape=shape))


def test_a_cost_model_of_another_shape_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="its cost model's shape"):
        HybridModel("bad", (None, 8), 1, 4, 2, CostModel())


# ------------------------------------------------------------------ the study


def _study(allocations: tuple[str, ...] = ("grouped", "uniform")):  # type: ignore[no-untyped-def]
    config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), GEMMA.shape), block_size=16)
    workload = ("longdoc", 16, {"max_model_len": 32768})
    return hybrid_study(GEMMA, config, [0.3, 1.2], allocations=allocations, workload=workload)


def test_grouped_allocation_fits_more_requests_and_sustains_at_least_uniforms_rate() -> None:
    study = _study()
    slots = {name: config.budget.num_tokens for name, config in study.configs.items()}
    assert slots["grouped"] > 2.5 * slots["uniform"]  # long documents: mostly outside the windows
    assert study.configs["uniform"].budget.num_bytes == study.configs["grouped"].budget.num_bytes
    sustained, peak = study.sustained_rates(), study.peak_throughputs()
    assert sustained["grouped"] >= sustained["uniform"]
    assert peak["grouped"] > peak["uniform"]
    text = format_hybrid(study)
    assert "window 1024: 2+8 pad" in text and "grouped / uniform:" in text


def test_the_study_needs_the_memory_in_bytes() -> None:
    config = SimConfig(Budget.from_blocks(4096, 16), block_size=16)
    with pytest.raises(ConfigError, match="needs the memory in bytes"):
        hybrid_study(GEMMA, config, [1.0])


# ------------------------------------------------------------------------ CLI

SMALL = ["--workload", "longdoc", "--max-model-len", "32768", "--num-requests", "8", "--quiet"]


def test_cli_json_carries_memory_per_request_and_rates_per_allocation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--hybrid-model", "gpt-oss-like", *SMALL, "--rates", "1,2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "gpt-oss-like" and len(data["model"]["groups"]) == 2
    row = next(r for r in data["memory_per_request"] if r["num_tokens"] == 8192)
    assert row["uniform_bytes"] > row["grouped_bytes"] and 0.45 < row["grouped_saving"] < 0.5
    assert set(data["sustained_rates"]) == set(data["peak_throughputs"]) == {"grouped", "uniform"}
    assert [(p["rate"], p["system"]) for p in data["rate_sweep"]] == [
        (1.0, "grouped"), (1.0, "uniform"), (2.0, "grouped"), (2.0, "uniform")
    ]  # fmt: skip
    assert "wall_s" not in json.dumps(data["rate_sweep"])


def test_cli_kv_allocation_runs_only_the_one_chosen(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate",
        "--hybrid-model",
        "gpt-oss-like",
        *SMALL,
        "--rates",
        "1",
        "--kv-allocation",
        "uniform",
    ]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["allocations"]) == ["uniform"] and list(data["sustained_rates"]) == ["uniform"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--hybrid-model", "llama"], "--hybrid-model: unknown preset 'llama'; expected gemma3-27b-like"),
        (["--kv-allocation", "grouped"], "--kv-allocation is for --hybrid-model"),
        (["--hybrid-model", "gpt-oss-like", "--sweep"], "--hybrid-model and --sweep are two studies"),
        (["--hybrid-model", "gpt-oss-like", "--num-layers", "4"], "leave out --num-layers"),
        (["--hybrid-model", "gpt-oss-like", "--blocks", "64"], "give --memory, not --blocks"),
        (["--hybrid-model", "gpt-oss-like", "--request-rate", "2"], "leave out --request-rate"),
        (["--hybrid-model", "gpt-oss-like", "--workload", "longdoc"], "--max-model-len 2048"),
    ],
)
def test_cli_bad_hybrid_options_exit_2_and_print_nothing(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err and captured.out == ""


def test_plot_hybrid_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pagedkv.simulate.plots_hybrid import plot_hybrid

    path = plot_hybrid([_study()], tmp_path / "hybrid.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
