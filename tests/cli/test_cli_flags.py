"""Every bad flag of the command line exits 2 with one error line that names it, never a traceback.

The table runs the CLI in process (``pagedkv.cli.main``), so it stays fast.
A value argparse can judge alone (``--seed -1``) fails while parsing, with
argparse's usage block and one ``error: argument --seed: ...`` line; what only
the command can judge (a policy name, a memory budget, a file) fails when it
runs, with one ``pagedkv simulate: error: --flag ...`` line.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

import pagedkv
from pagedkv import cli
from pagedkv.cli import build_parser, main
from pagedkv.cli import check as check_command
from pagedkv.cli import demo as demo_module
from pagedkv.simulate import command as command_module
from pagedkv.simulate.progress import Progress, format_seconds
from pagedkv.testing import check

BIG = str(10**30)
HUGE = "9" * 5000  # more digits than int() reads
SMALL = ["--workload", "alpaca", "--num-requests", "4", "--blocks", "64", "--block-size", "4"]
CHECK = ["check", "pagedkv:KVCache", "--max-examples", "2", "--steps", "3", "--seed", "1"]

BAD_FLAGS = [
    # ---- the cases of issue 11 item 13
    (["demo", "--seed", "-1"], "argument --seed: expected an int >= 0, got '-1'"),
    (["simulate", "--policies", ""], "--policies: unknown policy ''"),
    ([*CHECK, "--scale", "nan"], "argument --scale: expected a finite number, got 'nan'"),
    (["demo", "--tokens", "-5"], "argument --tokens: expected a positive int up to 1,000,000, got '-5'"),
    (["demo", "--tokens", "0"], "argument --tokens: expected a positive int up to 1,000,000, got '0'"),
    (["simulate", "--arrival-rate", "inf"], "--arrival-rate: expected a finite number > 0, got 'inf'"),
    # ---- demo
    (["demo", "--tokens", "1000001"], "argument --tokens: expected a positive int up to 1,000,000"),
    (["demo", "--tokens", BIG], "argument --tokens: expected a positive int up to"),
    (["demo", "--tokens", HUGE], "argument --tokens: expected a positive int up to"),
    (["demo", "--tokens", "nan"], "argument --tokens: expected a positive int up to 1,000,000, got 'nan'"),
    (["demo", "--tokens", "1.5"], "argument --tokens: expected a positive int up to 1,000,000, got '1.5'"),
    (["demo", "--tokens", ""], "argument --tokens: expected a positive int up to 1,000,000, got ''"),
    (["demo", "--tokens", "-inf"], "argument --tokens: expected one argument"),
    (["demo", "--tokens=-inf"], "argument --tokens: expected a positive int up to 1,000,000, got '-inf'"),
    (["demo", "--seed", "x"], "argument --seed: expected an int >= 0, got 'x'"),
    (["demo", "--seed", "inf"], "argument --seed: expected an int >= 0, got 'inf'"),
    # ---- simulate and viz: one value at a time
    (["simulate", "--seed", "-1"], "argument --seed: expected an int >= 0, got '-1'"),
    (["viz", "--seed", "1.5"], "argument --seed: expected an int >= 0, got '1.5'"),
    (["simulate", "--num-requests", "0"], "--num-requests: expected a positive int up to 10,000,000"),
    (["simulate", "--num-requests", BIG], "--num-requests: expected a positive int up to 10,000,000"),
    (["viz", "--num-requests", "nan"], "argument --num-requests: expected a positive int up to 10,000,000"),
    (["simulate", "--n", "0"], "argument --n: expected a positive int up to 10,000, got '0'"),
    (["simulate", "--n", BIG], "argument --n: expected a positive int up to 10,000"),
    (["simulate", "--prefix-groups", "-1"], "argument --prefix-groups: expected an int >= 0 up to"),
    (["simulate", "--prefix-groups", BIG], "argument --prefix-groups: expected an int >= 0 up to"),
    (["simulate", "--prefix-len", "-1"], "argument --prefix-len: expected an int >= 0, got '-1'"),
    (["viz", "--prefix-len", "nan"], "argument --prefix-len: expected an int >= 0, got 'nan'"),
    (["simulate", "--arrival-rate=-inf"], "--arrival-rate: expected a finite number > 0, got '-inf'"),
    (["simulate", "--arrival-rate", "nan"], "--arrival-rate: expected a finite number > 0, got 'nan'"),
    (["simulate", "--arrival-rate", "0"], "argument --arrival-rate: expected a finite number > 0, got '0'"),
    (["simulate", "--arrival-rate", "-1"], "argument --arrival-rate: expected a finite number > 0, got '-1'"),
    (["viz", "--arrival-rate", ""], "argument --arrival-rate: expected a finite number > 0, got ''"),
    (["simulate", "--max-model-len", "0"], "argument --max-model-len: expected a positive int, got '0'"),
    (["simulate", "--blocks", "0"], "argument --blocks: expected a positive int, got '0'"),
    (["simulate", "--block-size", "inf"], "argument --block-size: expected a positive int, got 'inf'"),
    (["simulate", "--window", "0"], "argument --window: expected a positive int, got '0'"),
    (["simulate", "--max-num-seqs", "-1"], "argument --max-num-seqs: expected a positive int, got '-1'"),
    (["simulate", "--watermark", "1"], "argument --watermark: expected a number in [0, 1), got '1'"),
    (["simulate", "--watermark", "nan"], "argument --watermark: expected a number in [0, 1), got 'nan'"),
    (["viz", "--watermark=-inf"], "argument --watermark: expected a number in [0, 1), got '-inf'"),
    (["simulate", "--num-layers", "0"], "argument --num-layers: expected a positive int, got '0'"),
    (["simulate", "--num-kv-heads", "x"], "argument --num-kv-heads: expected a positive int, got 'x'"),
    (["simulate", "--head-dim", "-1"], "argument --head-dim: expected a positive int, got '-1'"),
    (["simulate", "--dtype-bytes", "1.5"], "argument --dtype-bytes: expected a positive int, got '1.5'"),
    (["viz", "--sample-every", "0"], "argument --sample-every: expected a positive int, got '0'"),
    (["simulate", "--sampling", "nope"], "argument --sampling: invalid choice: 'nope'"),
    (["simulate", "--memory", "1GB", "--blocks", "9"], "--blocks: not allowed with argument --memory"),
    (["simulate", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    # ---- simulate and viz: what the command judges
    (["simulate", "--memory", ""], "--memory '': not a memory size: ''"),
    (["simulate", "--memory", "nan"], "--memory nan: not a memory size: 'nan'"),
    (["simulate", "--memory", "-1"], "--memory -1: not a memory size: '-1'"),
    (["viz", "--memory", "12 potatoes"], "--memory '12 potatoes': not a memory size: '12 potatoes'"),
    (["simulate", "--memory", "100KB"], "--memory 100KB: the memory budget is smaller than one block"),
    (["simulate", "--memory", BIG], f"--memory {BIG}: a pool of"),
    (["simulate", "--blocks", BIG], f"--blocks {BIG}: a pool of"),
    (["viz", "--block-size", BIG], "--blocks 128 (the default): a pool of 128 blocks"),
    (["viz", "--memory", "10MB"], "--memory 10MB: request 0's prompt of"),
    (["simulate", *SMALL, "--blocks", "2"], "--blocks 2: request 0's prompt of"),
    (["simulate", "--workload", ""], "--workload: unknown workload ''"),
    (["simulate", "--workload", "lmsys"], "--workload: unknown workload 'lmsys'"),
    (["simulate", "--workload", "missing.jsonl"], "cannot read workload file 'missing.jsonl'"),
    (["simulate", "--workload", "{folder}/"], "cannot read workload file"),
    (["simulate", "--max-model-len", "300"], "the clip of 150 tokens (--workload sharegpt"),
    (["simulate", "--prefix-len", "1024"], "prefix_len 1024 leaves no room under max_model_len 2048"),
    (["viz", "--max-model-len", "3"], "max_model_len must be an int >= 4, got 3 (--workload alpaca"),
    (["simulate", *SMALL, "--n", "2", "--max-num-seqs", "1"], "wants n=2 samples, more than max_num_seqs=1"),
    (["simulate", "--policies", ","], "--policies: unknown policy ''"),
    (["simulate", "--policies", " "], "--policies: unknown policy ''"),
    (["simulate", "--policies", "paged,nope"], "--policies: unknown policy 'nope'; expected paged"),
    (["simulate", "--policies", "ALL"], "--policies: unknown policy 'ALL'"),
    (["simulate", "--block-sizes", "2,8"], "--block-sizes is for --sweep"),
    (["simulate", "--windows", "none"], "--windows is for --sweep"),
    (["simulate", "--sweep", "--block-sizes", ""], "--block-sizes: '' is not an int >= 1"),
    (["simulate", "--sweep", "--block-sizes", "0"], "--block-sizes: '0' is not an int >= 1"),
    (["simulate", "--sweep", "--block-sizes", "4,,8"], "--block-sizes: '' is not an int >= 1"),
    (["simulate", "--sweep", "--block-sizes", "²"], "--block-sizes: '²' is not an int >= 1"),
    (["simulate", "--sweep", "--block-sizes", "nan"], "--block-sizes: 'nan' is not an int >= 1"),
    (["simulate", "--sweep", "--block-sizes", HUGE], "--block-sizes: '999"),
    (["simulate", "--sweep", "--block-sizes", BIG], "the memory budget is smaller than one block"),
    (["simulate", "--sweep", "--windows", "0"], "--windows: '0' is not an int >= 1"),
    (["simulate", "--sweep", "--windows", "-1"], "--windows: '-1' is not an int >= 1"),
    (["simulate", "--kernel-cost", "none"], "--kernel-cost is for --sweep"),
    (["simulate", *SMALL, "--sweep", "--kernel-cost", "{folder}/no"], "cannot read the kernel-cost file"),
    (["simulate", *SMALL, "--sweep", "--kernel-cost", "{file}"], "not JSON (Expecting value at line 1"),
    (["viz", *SMALL, "--png", "sweep", "--kernel-cost", "{file}"], "not JSON (Expecting value at line 1"),
    (["viz", "--steps", ""], "--steps: '' is not an int >= 0"),
    (["viz", "--steps", "-1"], "--steps: '-1' is not an int >= 0"),
    (["viz", "--steps", "1,x"], "--steps: 'x' is not an int >= 0"),
    (["viz", "--width", "0"], "argument --width: expected a positive int, got '0'"),
    (["viz", "--width", "inf"], "argument --width: expected a positive int, got 'inf'"),
    (["viz", "--png", ""], "--png: unknown picture ''"),
    (["viz", "--png", "pagemap,"], "--png: unknown picture ''"),
    (["viz", "--png", "heatmap"], "--png: unknown picture 'heatmap'; expected pagemap"),
    (["viz", "--png", "pagemap", "--out", ""], "argument --out: expected a folder, got ''"),
    (["viz", "--png", "pagemap", "--out", "{file}"], "argument --out: expected a folder, got"),
    (["viz", "--png", "pagemap", "--out", "{file}/sub"], "argument --out: cannot write into"),
    (["viz", "--all", "--out", "{file}"], "argument --out: expected a folder, got"),
    # ---- check
    ([*CHECK, "--scale", "inf"], "argument --scale: expected a finite number, got 'inf'"),
    ([*CHECK, "--scale=-inf"], "argument --scale: expected a finite number, got '-inf'"),
    ([*CHECK, "--scale", "x"], "argument --scale: expected a finite number, got 'x'"),
    ([*CHECK, "--max-examples", "0"], "argument --max-examples: expected a positive int up to 1,000,000"),
    ([*CHECK, "--max-examples", BIG], "argument --max-examples: expected a positive int up to 1,000,000"),
    ([*CHECK, "--steps", "0"], "argument --steps: expected a positive int, got '0'"),
    ([*CHECK, "--head-dim", "nan"], "argument --head-dim: expected a positive int, got 'nan'"),
    ([*CHECK, "--max-heads", "-1"], "argument --max-heads: expected a positive int, got '-1'"),
    ([*CHECK, "--caches", ""], "argument --caches: expected a positive int, got ''"),
    ([*CHECK, "--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    ([*CHECK, "--precision", "float16"], "argument --precision: invalid choice: 'float16'"),
    ([*CHECK, "--head-dim", "2731"], "--head-dim 2731 and --max-heads 4 draw one-head tokens of up to 8,193"),
    ([*CHECK, "--head-dim", BIG], f"--head-dim {BIG} and --max-heads 4 draw one-head tokens"),
    ([*CHECK, "--heads", "multi", "--max-heads", "64", "--head-dim", "128"], "draw multi-head tokens"),
    ([*CHECK, "--max-size", ""], "argument --max-size: --max-size takes none, positive ints and ranges"),
    ([*CHECK, "--max-size", "0"], "argument --max-size: --max-size takes none, positive ints and ranges"),
    ([*CHECK, "--max-size", "3-1"], "got '3-1'"),
    ([*CHECK, "--max-size", f"1-{BIG}"], "(of at most 10,000 sizes), got '1-1000"),
    ([*CHECK, "--max-size", "nan"], "argument --max-size: --max-size takes none"),
    ([*CHECK, "--heads", ""], "argument --heads: --heads takes one, multi, gqa, all"),
    ([*CHECK, "--heads", "one,nope"], "argument --heads: --heads takes one, multi, gqa, all"),
    ([*CHECK, "-o", ""], "argument -o/--output: expected a file to write, got ''"),
    ([*CHECK, "-o", "{folder}"], "argument -o/--output: expected a file to write"),
    ([*CHECK, "-o", "{file}/repro.py"], "argument -o/--output: cannot write"),
    (["check", "pagedkv", "--seed", "1"], "expected MODULE:FACTORY (e.g. pagedkv:KVCache), got 'pagedkv'"),
]


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in a fresh folder, so nothing a command writes lands in the repository."""
    monkeypatch.chdir(tmp_path)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``pagedkv ARGV`` in process: (exit status, stdout, stderr), whether argparse exits or main returns."""
    try:
        status = main(argv)
    except SystemExit as exit_info:
        assert isinstance(exit_info.code, int)
        status = exit_info.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def error_lines(err: str) -> list[str]:
    """stderr less argparse's usage block (the ``usage:`` line and its indented continuations)."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(argv)[:60] for argv, _ in BAD_FLAGS])
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "file").write_text("not a folder\n")
    argv = [arg.format(file=tmp_path / "file", folder=tmp_path) for arg in argv]
    status, out, err = run_cli(argv, capsys)
    assert status == 2, err
    assert "Traceback" not in err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedkv") and ": error: " in lines[0] and message in lines[0], lines[0]
    assert out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "3", "--seed", BIG],
        ["simulate", *SMALL, "--policies", "paged,paged,all", "--seed", "0", "--arrival-rate", "0.5"],
        ["simulate", *SMALL, "--sweep", "--block-sizes", "4,4,8", "--windows", "none,none,16"],
        ["simulate", *SMALL, "--sweep", "--block-sizes", "4,8", "--kernel-cost", "none"],
        ["simulate", *SMALL, "--watermark", "0", "--window", BIG, "--max-num-seqs", BIG],
        ["simulate", *SMALL, "--max-model-len", BIG, "--sample-every", BIG],
        ["viz", "--num-requests", "4", "--steps", "1,1,0", "--width", BIG, "--out", "not/yet/made"],
        [*CHECK, "--seed", "-1", "--max-size", "none,none,1-3", "--heads", "all,one", "--scale", "1e300"],
    ],
    ids=["demo", "simulate", "sweep", "sweep-no-kernel", "no-limits", "huge-lengths", "viz", "check"],
)
def test_valid_flags_still_exit_0(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # Repeats in a list are dropped, as --max-size and --heads always did; huge windows mean "no limit".
    status, out, err = run_cli(argv, capsys)
    assert status == 0, err
    assert err == "" and out


def test_repeated_names_are_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["simulate", *SMALL, "--policies", "paged,contiguous,paged"], capsys)
    assert status == 0
    header = next(line for line in out.splitlines() if line.strip().startswith("paged "))
    assert header.split() == ["paged", "contiguous"]


@pytest.mark.parametrize(
    ("argv", "attribute", "value"),
    [
        (["demo", "--tokens", "1000000"], "tokens", 1_000_000),
        (["demo", "--seed", BIG], "seed", 10**30),
        (["simulate", "--num-requests", "10000000"], "num_requests", 10_000_000),
        (["simulate", "--n", "10000"], "n", 10_000),
        (["simulate", "--prefix-groups", str(2**63 - 1)], "prefix_groups", 2**63 - 1),
        (["simulate", "--arrival-rate", "1e30"], "arrival_rate", 1e30),
        (["check", "pagedkv:KVCache", "--max-examples", "1000000"], "max_examples", 1_000_000),
        (["check", "pagedkv:KVCache", "--max-size", "1-10000"], "max_size", tuple(range(1, 10_001))),
        (["check", "pagedkv:KVCache", "--scale", "-0.5"], "scale", -0.5),
    ],
)
def test_the_largest_values_still_parse(argv: list[str], attribute: str, value: object) -> None:
    assert getattr(build_parser().parse_args(argv), attribute) == value


def test_the_largest_token_hypothesis_can_draw_is_accepted() -> None:
    check.check_token_size(["one-head"], 2730, 4)  # 3 x 2730 = 8,190 values
    check.check_token_size(["grouped-query"], 4, 1000)  # at most 2 x 1000 x 4 = 8,000
    with pytest.raises(check.UsageError, match="8,193 values"):
        check.check_token_size(["one-head"], 2731, 4)


def test_an_output_file_that_cannot_be_written_after_the_run_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parse-time checks cannot see everything (a full disk, a folder root may not write): the write itself.
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(check_command, "open", refuse, raising=False)
    argv = ["check", "pagedkv.testing.buggy:FreesBlockEarly", "--seed", "1", "-o", str(tmp_path / "repro.py")]
    status, out, err = run_cli(argv, capsys)
    assert status == 2
    assert "FAILED" in out
    path = str(tmp_path / "repro.py")
    assert error_lines(err) == [f"pagedkv check: error: --output: cannot write {path!r}: Permission denied"]


def test_the_types_reject_what_they_should() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected an int >= 0, got '-1'"):
        cli.non_negative_int("-1")
    assert cli.int_range(1, 3)("3") == 3
    assert cli.positive_float("1e-300") == 1e-300
    assert cli.fraction("0") == 0.0
    for bad in ("nan", "inf", "-inf", "", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.finite_float(bad)


# ---- issue 27: --version, Ctrl-C, the subcommand's own usage, progress bars


def test_version_prints_the_package_name_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["--version"], capsys)
    assert status == 0 and err == ""
    assert out == f"pagedkv {pagedkv.__version__}\n"


@pytest.mark.parametrize("command", ["simulate", "viz", "demo"])
def test_ctrl_c_prints_one_line_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    def interrupt(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_module if command == "demo" else command_module, f"run_{command}", interrupt)
    status, out, err = run_cli([command], capsys)
    assert status == 130
    assert err == f"pagedkv {command}: interrupted\n"  # no traceback
    assert out == ""


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["simulate", "--frobnicate"], "usage: pagedkv simulate "),
        (["viz", "--frobnicate"], "usage: pagedkv viz "),
        (["demo", "--tokens", "3", "extra"], "usage: pagedkv demo "),
        ([*CHECK, "--frobnicate"], "usage: pagedkv check "),
    ],
    ids=["simulate", "viz", "demo", "check"],
)
def test_an_unknown_flag_is_reported_with_the_subcommands_own_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str
) -> None:
    status, out, err = run_cli(argv, capsys)
    assert status == 2 and out == ""
    assert err.startswith(usage), err
    command = argv[0]
    assert error_lines(err) == [f"pagedkv {command}: error: unrecognized arguments: {argv[-1]}"]


def test_an_unknown_flag_before_any_command_keeps_the_top_level_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = run_cli(["--frobnicate"], capsys)
    assert status == 2
    assert err.startswith("usage: pagedkv [-h]")
    assert error_lines(err) == ["pagedkv: error: unrecognized arguments: --frobnicate"]


@pytest.mark.parametrize(
    ("extra", "labels"),
    [
        (["--policies", "paged,contiguous"], ["policy 1 of 2: paged", "policy 2 of 2: contiguous"]),
        (["--sweep", "--block-sizes", "4,8", "--kernel-cost", "none"],
         ["run 1 of 3: paged", "run 2 of 3: paged", "run 3 of 3: contiguous"]),
    ],
    ids=["policies", "sweep"],
)  # fmt: skip
def test_progress_bars_say_which_run_of_how_many(
    capsys: pytest.CaptureFixture[str], extra: list[str], labels: list[str]
) -> None:
    status, out, err = run_cli(["simulate", *SMALL, *extra, "--progress"], capsys)
    assert status == 0 and out
    finals = [draw for draw in err.split("\r") if draw.endswith("\n")]  # each bar's last draw
    assert [draw.split(" [")[0].strip() for draw in finals] == labels


def test_a_progress_bar_shows_an_eta_until_it_is_done() -> None:
    ticks = iter([0.0, 10.0, 20.0, 40.0])
    stream = io.StringIO()
    bar = Progress("paged", 100, stream=stream, clock=lambda: next(ticks))
    bar.update(25)  # 10 s for a quarter: 30 s to go
    bar.update(50)  # 20 s for a half: 20 s to go
    bar.close(100)
    draws = stream.getvalue().split("\r")[1:]
    assert draws[0].endswith("25/100 requests   10.0 s  ETA 30 s")
    assert draws[1].endswith("50/100 requests   20.0 s  ETA 20 s")
    assert draws[2] == "paged              [" + "#" * 30 + "] 100/100 requests   40.0 s\n"
    assert format_seconds(3600 + 65) == "1:01:05"
