"""Every command output quoted in docs/tutorial.md and docs/study.md is what the command prints.

An output block is a ```console fence whose first line is ``$ pagedkv ...``
and which has lines after the command (fences that only list commands, with
no output, are not output blocks). Each is run in process through
``pagedkv.cli.main`` and compared:

* ``exact``: the whole output, line for line (``...`` in the doc stands for
  any run of lines). Cheap, deterministic commands: ``demo``, ``viz``.
* ``layout``: the expensive simulations run in a reduced form (fewer
  requests) that prints the same layout; the test compares the table's
  column names, row labels and the text around it, every number masked.
  With ``PAGEDKV_HYPOTHESIS_PROFILE=ci`` (the CI profile) the quoted command
  itself runs too and every cell must match, the wall-clock cells (``wall
  time``, ``simulated tokens per second``, ``per CPU second``, ``sim tok/s``,
  ``per cpu s``) alone masked.

Columns are cells split on runs of two or more spaces, so a timing figure
that widens its column does not fail the comparison. Output blocks of other
programs (``$ python benchmarks/...``: timing tables) are listed in
``NOT_CHECKED`` with the reason; a new output block in neither list fails
``test_every_output_block_is_checked``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from pagedkv.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/tutorial.md", "docs/study.md")
IS_CI = os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE") == "ci"

#: command (as quoted) -> (mode, the reduced arguments a layout check runs instead).
CHECKS: dict[str, tuple[str, list[str] | None]] = {
    "pagedkv demo": ("exact", None),
    "pagedkv viz --steps 0,42": ("exact", None),
    "pagedkv simulate --policies all": ("layout", ["simulate", "--policies", "all", "--num-requests", "12"]),
    "pagedkv simulate --sweep --num-requests 300": (
        "layout",
        ["simulate", "--sweep", "--num-requests", "12"],
    ),
    "pagedkv simulate --sweep --num-requests 300 --block-sizes 16 --windows none,128,256,512": (
        "layout",
        [
            "simulate",
            "--sweep",
            "--num-requests",
            "12",
            "--block-sizes",
            "16",
            "--windows",
            "none,128,256,512",
        ],
    ),
}
#: Output blocks not checked, and why.
NOT_CHECKED = {
    "python benchmarks/bench_simulate.py": "a benchmark: every figure is wall-clock time",
}
#: Report rows (first cell) and sweep columns (header cells) that hold wall-clock figures.
TIMING_ROWS = {"wall time", "simulated tokens per second", "per CPU second"}
TIMING_COLUMNS = {"sim tok/s", "per cpu s"}


def output_blocks() -> list[tuple[str, str, list[str]]]:
    """``(doc, command, output lines)`` for every console fence that quotes a command and its output."""
    blocks = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for body in re.findall(r"^```console\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            lines = body.rstrip("\n").split("\n")
            if not lines[0].startswith("$ ") or all(line.startswith("$ ") for line in lines):
                continue  # a list of commands, no output
            blocks.append((doc, lines[0][2:], lines[1:]))
    return blocks


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``pagedkv ARGV`` in process: its stdout lines (status 0 asserted), the checkout's path relative."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    return out.rstrip("\n").replace(f"{ROOT}{os.sep}", "").split("\n")


def cells(line: str) -> list[str]:
    """A table line's cells: split on runs of two or more spaces; a rule of dashes is one ``-`` per cell."""
    parts = re.split(r"\s{2,}", line.rstrip())
    return ["-" if part and set(part) == {"-"} else part for part in parts]


def mask_timing(lines: list[str]) -> list[list[str]]:
    """Every line as cells, the wall-clock cells replaced by ``<time>``."""
    masked, timing_columns = [], set()
    for line in lines:
        row = cells(line)
        if TIMING_COLUMNS & set(row):
            timing_columns = {index for index, cell in enumerate(row) if cell in TIMING_COLUMNS}
        label = row[0].strip() or (row[1] if len(row) > 1 else "")
        if label in TIMING_ROWS:
            row = [row[0], *(cell if cell == label else "<time>" for cell in row[1:])]
        elif row != ["-"] * len(row):
            row = ["<time>" if index in timing_columns else cell for index, cell in enumerate(row)]
        masked.append(row)
    return masked


def mask_numbers(lines: list[str]) -> list[list[str]]:
    """Every line as cells, every number masked but a table row's first cell (its label: a size, a name)."""
    number = re.compile(r"\d[\d,.]*")
    masked = []
    for row in map(cells, lines):
        label = [row[0]] if len(row) > 1 else []  # a line of text is one cell: mask it all
        masked.append([*label, *(number.sub("N", cell) for cell in row[len(label) :])])
    return masked


def matches(quoted: list[str], printed: list[str]) -> bool:
    """``printed`` is ``quoted`` line for line, a ``...`` line standing for any run of lines."""
    pattern = "\n".join(".*?" if line == "..." else re.escape(line) for line in quoted)
    return re.fullmatch(pattern, "\n".join(printed), flags=re.DOTALL) is not None


BLOCKS = output_blocks()


def test_every_output_block_is_checked() -> None:
    quoted = {command for _, command, _ in BLOCKS}
    assert quoted, "no output blocks found: did the fence format change?"
    assert quoted - set(CHECKS) - set(NOT_CHECKED) == set()
    assert set(CHECKS) <= quoted  # no check left over for a block that is gone


@pytest.mark.parametrize(
    ("doc", "command", "quoted"),
    [block for block in BLOCKS if block[1] in CHECKS],
    ids=[f"{doc}: {command}" for doc, command, _ in BLOCKS if command in CHECKS],
)
def test_quoted_output_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str], doc: str, command: str, quoted: list[str]
) -> None:
    mode, reduced = CHECKS[command]
    argv = shlex.split(command)[1:]
    quoted = [line.rstrip() for line in quoted]
    if mode == "exact":
        printed = [line.rstrip() for line in run(argv, capsys)]
        assert matches(quoted, printed), "\n".join(printed)
        return
    assert reduced is not None
    assert mask_numbers(run(reduced, capsys)) == mask_numbers(quoted)
    if IS_CI:  # the quoted command itself: seconds each
        assert mask_timing(run(argv, capsys)) == mask_timing(quoted)


def test_the_masks_hide_only_timing() -> None:
    quoted = ["x  a      sim tok/s  per cpu s", "-  -----  ---------  ---------", "1  5.0%   1,000  2,000"]
    printed = ["x  a   sim tok/s  per cpu s", "-  ---  ---------  ---------", "1  5.0%  999,999  3"]
    assert mask_timing(printed) == mask_timing(quoted)
    assert mask_timing(["1  6.0%  1  2"]) != mask_timing(["1  5.0%  1  2"])
    assert mask_timing(["wall time    1.36 s  0.28 s"]) == mask_timing(["wall time  4.11 s  0.20 s"])
    assert mask_numbers(["peak  99.1%  35.8%"]) == mask_numbers(["peak  7%  3%"])
    assert mask_numbers(["peak  7%"]) != mask_numbers(["mean  7%"])
    assert mask_numbers(["sweep: x 300, 15,728 slots"]) == mask_numbers(["sweep: x 12, 15,728 slots"])
    assert matches(["a", "...", "c"], ["a", "b", "b", "c"])
    assert not matches(["a", "c"], ["a", "b", "c"])
