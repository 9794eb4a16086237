"""benchmarks/bench_views.py writes the tracked block-size sweep only when asked (``--save``)."""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench_views(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    """bench_views with every measurement stubbed out and its results file moved to ``tmp_path``."""
    pytest.importorskip("threadpoolctl")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("bench_views")
    stubs = {
        "Flusher": lambda: None,
        "ratio_table": lambda title, rows: None,
        "decode_rows": lambda *args: {},
        "prefill_rows": lambda *args: {"views": 1.0, "gather": 2.0},
        "windowed": lambda *args: (1.0, 1.0, 65, 0),
        "mapping_costs": lambda *args: (1.0, 1.0, 1.0),
        "areas_and_rss": lambda *args: defaultdict(float),
        "sweep": lambda *args: {
            "block_size": [16],
            "gather_ms": [1.0],
            "view_ms": [1.0],
            "contiguous_ms": [1.0],
        },
        "page_rows": lambda *args: {"views": 1.0},
        "RESULTS": tmp_path / "results" / "kernel_block_size.json",
    }
    for name, stub in stubs.items():
        monkeypatch.setattr(module, name, stub)
    return module


def run(module: ModuleType, monkeypatch: pytest.MonkeyPatch, *flags: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_views.py", *flags])
    module.main()


@pytest.mark.parametrize("flags", [(), ("--quick",)])
def test_a_run_without_save_writes_no_results_file(
    bench_views: ModuleType, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    run(bench_views, monkeypatch, *flags)
    assert not bench_views.RESULTS.exists()


def test_save_writes_the_sweep_with_its_machine(
    bench_views: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(bench_views, monkeypatch, "--save")
    text = bench_views.RESULTS.read_text()
    assert '"block_size"' in text and '"machine"' in text


def test_save_with_quick_is_refused_before_measuring(
    bench_views: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(bench_views, monkeypatch, "--quick", "--save")
    assert exit_info.value.code == 2
    assert "without --quick" in capsys.readouterr().err
    assert not bench_views.RESULTS.exists()
