"""Smoke tests of the command line: ``--help``, ``demo``, ``simulate``, ``viz``.

Every command runs at least once through a subprocess (``python -m pagedkv``);
the other outputs are checked in-process through ``main``, which is faster.
Every error path must say what is wrong and exit with status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main

SMALL = [
    "--workload",
    "alpaca",
    "--num-requests",
    "12",
    "--blocks",
    "96",
    "--block-size",
    "4",
    "--max-model-len",
    "256",
]


def run(
    *args: str, env: dict[str, str] | None = None, code: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m pagedkv ARGS`` (or ``python -c CODE ARGS``), captured."""
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "pagedkv", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}, check=False
    )


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``main(ARGS)`` in this process, captured in the shape ``run`` returns."""
    status = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["pagedkv", *args], status, captured.out, captured.err)


def test_help_lists_every_command_on_one_line() -> None:
    result = run("--help", env={"COLUMNS": "80"})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    start = lines.index("  COMMAND") + 1
    entries = lines[start : lines.index("", start)]
    names = [line.split()[0] for line in entries]
    assert {"demo", "simulate", "viz"} <= set(names)
    assert all(line.startswith("    ") and len(line.split()) > 1 for line in entries)  # no wrapped lines


def test_no_command_prints_help_and_exits_2() -> None:
    result = run()
    assert result.returncode == 2 and "simulate" in result.stdout


def test_demo_still_runs() -> None:
    result = run("demo", "--tokens", "30")
    assert result.returncode == 0, result.stderr
    assert "matched exactly" in result.stdout


def test_simulate_prints_a_table_for_each_policy() -> None:
    result = run(
        "simulate",
        *SMALL,
        "--policies",
        "all",
        "--n",
        "2",
        "--prefix-groups",
        "1",
        "--prefix-len",
        "8",
        "--prefix-caching",
    )
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("paged "))
    assert header.split() == ["paged", "contiguous", "contiguous-pow2", "contiguous-oracle"]
    assert "memory holding live tokens, mean" in result.stdout
    assert result.stderr == ""  # no progress bar when stderr is not a terminal


def test_simulate_json_is_deterministic_apart_from_timing(capsys: pytest.CaptureFixture[str]) -> None:
    # One run in another process (another string-hash seed), one here.
    outputs = []
    for result in (
        run("simulate", *SMALL, "--json", "--seed", "3"),
        run_in_process(capsys, "simulate", *SMALL, "--json", "--seed", "3"),
    ):
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert set(data["timing"]["paged"]) == {
            "wall_s",
            "simulated_tokens_per_s",
            "cpu_s",
            "simulated_tokens_per_cpu_s",
        }
        del data["timing"]
        outputs.append(data)
    assert outputs[0] == outputs[1]
    assert outputs[0]["policies"]["paged"]["num_finished"] == 12
    assert outputs[0]["config"]["num_blocks"] == 96


def test_simulate_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, "simulate", *SMALL, "--progress", "--policies", "paged")
    assert result.returncode == 0
    assert "12/12 requests" in result.stderr and "requests" not in result.stdout.splitlines()[-1]


def test_simulate_sweep_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(
        capsys, "simulate", *SMALL, "--sweep", "--block-sizes", "2,8", "--windows", "none,32"
    )
    assert result.returncode == 0, result.stderr
    rows = [
        line.split() for line in result.stdout.splitlines() if line[:1].isdigit() or line.startswith("contig")
    ]
    assert [row[:2] for row in rows] == [
        ["2", "none"],
        ["8", "none"],
        ["contiguous", "none"],
        ["2", "32"],
        ["8", "32"],
        ["contiguous", "32"],
    ]


def test_simulate_reads_a_jsonl_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 5}\n{"prompt": [1, 2, 3], "output_len": 4, "n": 2}\n')
    result = run_in_process(
        capsys,
        "simulate", "--workload", str(path), "--blocks", "16", "--block-size", "4", "--max-model-len", "32",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "requests.jsonl" in result.stdout and "2 / 0 / 0" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "{bad}"], "line 2: field 'output_len' must be an int >= 1, got -1"),
        (
            ["--workload", "alpaca", "--blocks", "2", "--block-size", "4"],
            "tokens needs 5 blocks of 4, the memory holds 2",
        ),
        (["--memory", "100KB"], "smaller than one block: 100000 bytes hold 0 token slots"),
        (["--memory", "12 potatoes"], "not a memory size: '12 potatoes'"),
        (["--workload", "lmsys"], "unknown workload 'lmsys'"),
        (["--workload", "missing.jsonl"], "cannot read workload file"),
        (["--policies", "paged,fifo"], "unknown policy 'fifo'"),
        (["--sweep", "--block-sizes", "4,x"], "--block-sizes: 'x' is not an int >= 1"),
    ],
)
def test_simulate_bad_input_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    # In process, to keep the suite fast; the first case also runs through a subprocess below.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 4, "output_len": 2}\n{"prompt_len": 4, "output_len": -1}\n')
    args = [str(bad) if arg == "{bad}" else arg for arg in args]
    assert main(["simulate", *args, "--num-requests", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pagedkv simulate: error:") and message in captured.err
    assert captured.out == ""


def test_a_malformed_jsonl_line_exits_2_through_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 4, "output_len": 2}\n\n{"prompt_len": 4, "output_len": 2, "n": "two"}\n')
    result = run("simulate", "--workload", str(bad))
    assert result.returncode == 2
    assert (
        result.stderr
        == "pagedkv simulate: error: bad.jsonl line 3: field 'n' must be an int >= 1, got 'two'\n"
    )


def test_unknown_options_exit_2_through_the_command_line() -> None:
    result = run("simulate", "--frobnicate")
    assert result.returncode == 2 and "unrecognized arguments: --frobnicate" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--blocks", "0"], "argument --blocks: expected a positive int, got '0'"),
        (["viz", "--watermark", "2"], "argument --watermark: expected a number in [0, 1), got '2'"),
        (["simulate", "--memory", "1GB", "--blocks", "9"], "not allowed with argument"),
        (["launch"], "invalid choice: 'launch'"),
    ],
)
def test_bad_values_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_viz_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["viz", "--steps", "1,x"]) == 2
    assert "--steps: 'x' is not an int >= 0" in capsys.readouterr().err
    assert main(["viz", "--png", "heatmap"]) == 2
    assert "unknown picture 'heatmap'" in capsys.readouterr().err


def test_viz_prints_text_page_maps() -> None:
    result = run("viz", "--steps", "0,3,99999")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "step 0: 128 blocks x 4 slots" in out and "step 3:" in out
    assert "  owner  ###" in out  # the default workload's system prompts, shared through the prefix cache
    assert "(no step 99999" in out and "A-Z: shared by its samples" in out


def test_viz_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In-process: matplotlib, imported here, closes its font files in every forked
    # child; tests/memory/test_page_fork.py no longer depends on it not being imported.
    pytest.importorskip("matplotlib")
    result = run_in_process(capsys, "viz", "--png", "pagemap", "--out", str(tmp_path), "--num-requests", "6")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pagemap.png").read_bytes()[:4] == b"\x89PNG"


def test_viz_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from pagedkv.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    result = run("viz", "--png", "all", "--out", str(tmp_path), code=code)
    assert result.returncode == 2
    assert 'pip install "pagedkv[plot]"' in result.stderr
    assert not list(tmp_path.iterdir())
