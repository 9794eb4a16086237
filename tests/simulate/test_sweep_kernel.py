"""Tests for the kernel side of the block-size sweep: the loader, the report and JSON fields, the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.cli import main
from pagedkv.simulate import Budget, SimConfig, sweep, synthetic
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.kernel import (
    KernelCost,
    KernelCostError,
    default_kernel_cost_path,
    load_kernel_cost,
    parse_kernel_cost,
)
from pagedkv.simulate.sweep_kernel import format_kernel_side, kernel_rows, sweep_as_dicts

REPO = Path(__file__).resolve().parents[2]
PACKAGED = REPO / "pagedkv" / "simulate" / "data" / "kernel_block_size.json"
MEASURED = REPO / "benchmarks" / "results" / "kernel_block_size.json"
GOOD: dict[str, Any] = {
    "block_size": [1, 4, 16],
    "gather_ms": [6.0, 4.0, 3.0],
    "view_ms": [3.0, 2.5, 2.0],
    "contiguous_ms": [2.0, 2.0, 2.0],
    "machine": "a test box",
}


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# ---------------------------------------------------------------- the loader


def test_a_good_file_loads_every_point(tmp_path: Path) -> None:
    cost = load_kernel_cost(write(tmp_path, GOOD))
    assert cost.block_sizes == [1, 4, 16]
    assert cost.machine == "a test box" and cost.source.endswith("kernel.json")
    point = cost.at(4)
    assert point is not None
    assert (point.gather_ms, point.view_ms, point.contiguous_ms) == (4.0, 2.5, 2.0)
    assert (point.gather_ratio, point.view_ratio) == (2.0, 1.25)  # 4 / 2, 2.5 / 2
    assert cost.at(8) is None  # not measured: no interpolation
    cost.check_invariants()


def test_extra_keys_are_ignored_and_ints_are_times(tmp_path: Path) -> None:
    data = GOOD | {"note": "re-run", "gather_ms": [6, 4, 3]}
    cost = load_kernel_cost(write(tmp_path, data))
    assert [p.gather_ms for p in cost.points] == [6.0, 4.0, 3.0]


def test_the_shipped_files_load_and_the_packaged_copy_matches_the_measured_one() -> None:
    packaged = load_kernel_cost(PACKAGED)
    assert packaged.block_sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert packaged.machine
    if MEASURED.is_file():  # a checkout: the default is the measured file, and the copy must not drift
        assert default_kernel_cost_path() == MEASURED
        measured = load_kernel_cost(MEASURED)
        assert (measured.points, measured.machine) == (packaged.points, packaged.machine), (
            "pagedkv/simulate/data/kernel_block_size.json is stale: "
            "cp benchmarks/results/kernel_block_size.json pagedkv/simulate/data/"
        )


BAD_FIELDS = [
    (lambda d: d.pop("block_size"), "field 'block_size' is missing"),
    (lambda d: d.pop("gather_ms"), "field 'gather_ms' is missing"),
    (lambda d: d.pop("view_ms"), "field 'view_ms' is missing"),
    (lambda d: d.pop("contiguous_ms"), "field 'contiguous_ms' is missing"),
    (lambda d: d.pop("machine"), "field 'machine' is missing"),
    (lambda d: d.update(block_size=[]), "field 'block_size' must be a non-empty list of ints >= 1"),
    (lambda d: d.update(block_size="16"), "field 'block_size' must be a non-empty list"),
    (lambda d: d.update(block_size=[1, 4, 0]), "field 'block_size'[2] is 0; expected ints >= 1"),
    (lambda d: d.update(block_size=[1, 4.0, 16]), "field 'block_size'[1] is 4.0; expected ints >= 1"),
    (lambda d: d.update(block_size=[1, True, 16]), "field 'block_size'[1] is True"),
    (lambda d: d.update(block_size=[1, 16, 4]), "field 'block_size' must increase; 4 follows 16"),
    (lambda d: d.update(block_size=[1, 4, 4]), "field 'block_size' must increase; 4 follows 4"),
    (
        lambda d: d.update(gather_ms=[6.0, 4.0]),
        "field 'gather_ms' has 2 entries; expected one per block size (3)",
    ),
    (lambda d: d.update(view_ms=[3.0, 0.0, 2.0]), "field 'view_ms'[1] is 0.0; expected numbers > 0"),
    (lambda d: d.update(view_ms=[3.0, -1, 2.0]), "field 'view_ms'[1] is -1; expected numbers > 0"),
    (lambda d: d.update(contiguous_ms=[2.0, None, 2.0]), "field 'contiguous_ms'[1] is None"),
    (lambda d: d.update(contiguous_ms=[2.0, "2", 2.0]), "field 'contiguous_ms'[1] is '2'"),
    (lambda d: d.update(contiguous_ms=[2.0, False, 2.0]), "field 'contiguous_ms'[1] is False"),
    (lambda d: d.update(gather_ms=[6.0, 10**400, 3.0]), "field 'gather_ms'[1] is 1000"),
    (lambda d: d.update(machine=""), "field 'machine' must be a non-empty string, got ''"),
    (lambda d: d.update(machine=7), "field 'machine' must be a non-empty string, got 7"),
]


@pytest.mark.parametrize(("spoil", "message"), BAD_FIELDS, ids=[message[:50] for _, message in BAD_FIELDS])
def test_each_bad_field_is_a_typed_error_naming_it(tmp_path: Path, spoil: Any, message: str) -> None:
    data = copy.deepcopy(GOOD)
    spoil(data)
    before = copy.deepcopy(data)
    path = write(tmp_path, data)
    with pytest.raises(
        KernelCostError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        load_kernel_cost(path)
    assert data == before  # the caller's object is untouched
    assert json.loads(path.read_text()) == before  # and so is the file


def test_nan_and_infinity_are_not_times(tmp_path: Path) -> None:
    text = json.dumps(GOOD).replace("[6.0, 4.0, 3.0]", "[6.0, NaN, Infinity]")
    with pytest.raises(KernelCostError, match=r"field 'gather_ms'\[1\] is nan"):
        load_kernel_cost(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("null", "expected a JSON object, got NoneType"),
    ],
)
def test_a_file_that_is_not_an_object_is_a_typed_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(KernelCostError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_kernel_cost(write(tmp_path, text))


def test_a_missing_file_is_a_typed_error_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(KernelCostError, match=r"cannot read the kernel-cost file '.*nope\.json'"):
        load_kernel_cost(tmp_path / "nope.json")
    assert issubclass(KernelCostError, ValueError)


def test_a_kernel_cost_cannot_be_built_out_of_order() -> None:
    cost = parse_kernel_cost(GOOD, source="t")
    with pytest.raises(AssertionError, match="not increasing"):
        KernelCost(tuple(reversed(cost.points)), "m", "t")


# ------------------------------------------------------- the report and JSON


def test_attention_read_time_is_the_kv_part_of_a_memory_bound_step() -> None:
    # Oracle by hand: 1 GB/s, weights 1e9 params x 2 bytes = 2 s; KV 1,000 bytes per token.
    from pagedkv.simulate.shape import ModelShape

    shape = ModelShape(num_layers=1, num_kv_heads=1, head_dim=250, dtype_bytes=2)  # 1,000 bytes per token
    cost = CostModel(shape=shape, num_params=1e9, memory_bandwidth=1e9, peak_flops=1e12, step_overhead_s=0.0)
    assert cost.attention_read_time(num_tokens=4, kv_tokens_read=3_000_000) == pytest.approx(3.0)  # 3e9 / 1e9
    # 1e6 tokens: 2e15 FLOPs = 2,000 s of compute against 2 s + 3 s of memory: compute-bound, the read hidden.
    assert cost.attention_read_time(num_tokens=10**6, kv_tokens_read=3_000_000) == 0.0
    assert cost.attention_read_time(num_tokens=0, kv_tokens_read=0) == 0.0


@pytest.fixture(scope="module")
def rows() -> list[Any]:
    workload = synthetic("alpaca", 20, seed=0, max_model_len=256)
    return sweep(workload, SimConfig(Budget(512), block_size=4), [4, 16, 3])


def test_kernel_rows_carry_the_measured_point_and_the_step_what_if(rows: list[Any]) -> None:
    cost = parse_kernel_cost(GOOD, source="t")
    krows = kernel_rows(rows, cost)
    assert [row.block_size for row in krows] == [4, 16, 3]  # the contiguous baseline row is left out
    for krow, row in zip(krows, rows):
        result = row.result
        assert 0 < result.attention_s < result.busy_s
        assert krow.attention_share == result.attention_s / result.busy_s
    share = krows[0].attention_share
    # Block size 4: gather 2x, views 1.25x contiguous; only the KV-read share stretches.
    assert krows[0].step_factors() == pytest.approx((1 + share, 1 + 0.25 * share))
    assert krows[2].point is None and krows[2].step_factors() is None


def test_sweep_json_carries_memory_and_kernel_per_block_size(rows: list[Any]) -> None:
    cost = parse_kernel_cost(GOOD, source="t")
    data = sweep_as_dicts(rows, cost)
    assert [d["block_size"] for d in data] == [4, 16, 3, 0]
    first = data[0]
    assert first["occupancy_mean"] == rows[0].result.as_dict()["occupancy_mean"]  # the memory side stays
    assert first["kernel"]["measured"] is True
    assert first["kernel"]["gather_ms"] == 4.0 and first["kernel"]["view_ms"] == 2.5
    assert first["kernel"]["contiguous_ms"] == 2.0
    assert (first["kernel"]["gather_vs_contiguous"], first["kernel"]["view_vs_contiguous"]) == (2.0, 1.25)
    assert first["kernel"]["step_time_if_gather"] > first["kernel"]["step_time_if_views"] > 1
    assert data[2]["kernel"]["measured"] is False and data[2]["kernel"]["gather_ms"] is None
    assert "kernel" not in data[3]  # the baseline row
    assert json.loads(json.dumps(data)) == data
    assert all("kernel" not in d for d in sweep_as_dicts(rows, None))


def test_format_kernel_side_names_the_machine_and_marks_unmeasured_sizes(rows: list[Any]) -> None:
    text = format_kernel_side(rows, parse_kernel_cost(GOOD, source="t"))
    assert "measured on a test box" in text and "  from t:" in text
    lines = text.splitlines()
    row4 = next(line for line in lines if line.startswith("4 "))
    assert "4.00 (2.00x)" in row4 and "2.50 (1.25x)" in row4  # memory columns first, then the kernel's
    assert row4.split()[2] == f"{100 * rows[0].result.occupancy_mean:.1f}%"
    row3 = next(line for line in lines if line.startswith("3 "))
    assert row3.split()[-6:-3] == ["-", "-", "-"] and row3.split()[-2:] == ["-", "-"]
    contiguous = next(line for line in lines if line.startswith("contiguous"))
    assert contiguous.split()[-6:] == ["-"] * 6
    assert sum(1 for line in lines if line[:1].isdigit() or line.startswith("contig")) == 4  # one row each
    assert "a what-if" in text


# ------------------------------------------------------------------ the CLI

SMALL = ["simulate", "--workload", "alpaca", "--num-requests", "6", "--blocks", "64", "--block-size", "4"]


def test_simulate_sweep_prints_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD)
    assert main([*SMALL, "--sweep", "--block-sizes", "4,8", "--kernel-cost", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert (
        "live mean" in out and "gather ms" in out and "kernel side" in out and "measured on a test box" in out
    )


def test_simulate_sweep_json_has_the_kernel_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, GOOD)
    argv = [*SMALL, "--sweep", "--block-sizes", "4,8", "--kernel-cost", str(path), "--json", "--quiet"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernel_cost"] == {"source": str(path), "machine": "a test box", "block_sizes": [1, 4, 16]}
    assert data["sweep"][0]["kernel"]["gather_ms"] == 4.0
    assert data["sweep"][1]["kernel"]["measured"] is False  # block size 8 was not measured
    assert data["config"]["cost"]["name"] == "opt-13b-a100"


def test_simulate_sweep_with_the_default_kernel_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--sweep", "--block-sizes", "16", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernel_cost"]["source"] == str(default_kernel_cost_path())
    assert data["sweep"][0]["kernel"]["measured"] is True


def test_a_bad_kernel_file_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD | {"view_ms": [1.0]})
    assert main([*SMALL, "--sweep", "--kernel-cost", str(path), "--progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().endswith("field 'view_ms' has 1 entries; expected one per block size (3)")
    assert "requests" not in captured.err  # no progress bar: the file was checked before any run
