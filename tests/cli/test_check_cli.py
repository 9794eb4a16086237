"""``pagedkv check MODULE:FACTORY``: exit status 0 on pass, 1 on a found failure, 2 on bad usage.

Each exit status is checked once on the real command (``python -m pagedkv check``);
the rest in-process, through the same ``main``, which is faster.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedkv import cli
from pagedkv.cli.check import main, parse_max_sizes
from pagedkv.testing.check import UsageError, load_factory


def pagedkv_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", "check", *args], capture_output=True, text=True, timeout=120
    )


def between_markers(report: str) -> str:
    _, program, _ = report.split("# ---8<---\n")
    return program


def test_a_passing_cache_exits_0_with_a_count() -> None:
    result = pagedkv_check("pagedkv:KVCache", "--max-examples", "5", "--steps", "10", "--seed", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED: pagedkv:KVCache kept the seed contract." in result.stdout
    assert "runs (max_examples=5), " in result.stdout
    assert "seed 3" in result.stdout


def test_a_planted_bug_exits_1_with_a_program_that_fails_on_its_own(tmp_path: Path) -> None:
    result = pagedkv_check("pagedkv.testing.buggy:EvictsAfterScoring", "--seed", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED: pagedkv.testing.buggy:EvictsAfterScoring broke the seed contract." in (
        result.stdout
    )
    assert "Replay this run: pagedkv check pagedkv.testing.buggy:EvictsAfterScoring --seed 0" in (
        result.stdout
    )
    script = tmp_path / "repro.py"
    script.write_text(between_markers(result.stdout))
    replayed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert replayed.returncode == 1
    assert "ContractError" in replayed.stderr
    assert "one more than the window" in replayed.stderr


def test_bad_usage_exits_2() -> None:
    result = pagedkv_check("no_such_module_here:make")
    assert result.returncode == 2
    assert "cannot import module" in result.stderr


# --------------------------------------------------------------- in-process


def test_a_factory_in_the_current_directory_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process, where the current directory is not on sys.path (as for the
    # installed `pagedkv` script, unlike `python -m`): load_factory adds it.
    # The adapter pattern from docs/testing.md: another API behind the seed's.
    (tmp_path / "kit_adapter_demo.py").write_text(textwrap.dedent("""
        from pagedkv import KVCache

        class Other:
            def __init__(self, window):
                self.inner = KVCache(max_size=window)

            def step(self, query, key, value):
                return self.inner.attend(query, key, value)

        class Adapter:
            def __init__(self, max_size=None):
                self.other = Other(window=max_size)

            def attend(self, q, k, v):
                return self.other.step(q, k, v)
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path not in ("", str(tmp_path))])
    try:
        status = main(["kit_adapter_demo:Adapter", "--max-examples", "5", "--steps", "10"])
    finally:
        sys.modules.pop("kit_adapter_demo", None)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "checked at every call: the output against the oracle." in out.lower()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pagedkv:NoSuchFactory", "has no attribute 'NoSuchFactory'"),
        ("pagedkv:__version__", "is a str, not a callable factory"),
        ("pagedkv.testing.contract:precision_eps", "cannot be called as factory(max_size=None)"),
        (":KVCache", "expected MODULE:FACTORY"),
        ("pagedkv", "expected MODULE:FACTORY"),
    ],
)
def test_load_factory_rejects_what_cannot_build_caches(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_factory(spec)


def test_usage_errors_return_2_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pagedkv:NoSuchFactory"]) == 2
    assert "has no attribute" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["pagedkv:KVCache", "--max-size", "0"])
    assert exited.value.code == 2


def test_options_reach_the_machine_and_the_rerun_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "failing.py"
    status = cli.main([
        "check", "pagedkv.testing.buggy:FreesBlockEarly", "--seed", "1", "--arrays",
        "--max-size", "1-3", "--steps", "20", "-o", str(output),
    ])
    out = capsys.readouterr().out
    assert status == 1
    assert "max_size in [1, 2, 3], arrays" in out
    assert "--steps 20 --max-size 1,2,3 --arrays" in out
    assert "np.array(" in output.read_text()
    assert output.read_text() == between_markers(out)


def test_all_head_layouts_pass_on_kvcache_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["pagedkv:KVCache", "--heads", "all", "--max-examples", "5", "--steps", "10",
                   "--precision", "float64", "--seed", "5"])
    assert status == 0, capsys.readouterr().out
    assert "one-head/multi-head/grouped-query" in capsys.readouterr().out


def test_parse_max_sizes_accepts_none_ints_and_ranges() -> None:
    assert parse_max_sizes("None, 2-4 ,2") == (None, 2, 3, 4)


def test_without_hypothesis_check_exits_2_naming_the_test_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # `import hypothesis` now fails
    assert main(["pagedkv.testing.buggy:SeedCache", "--max-examples", "1"]) == 2
    captured = capsys.readouterr()
    assert 'pip install "pagedkv[test]"' in captured.err
    assert "needs Hypothesis" in captured.err
    assert captured.out == ""


def test_state_kept_on_the_class_exits_1_saying_the_failure_needs_earlier_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "failing.py"
    status = main([
        "pagedkv.testing.buggy:KeepsTokensOnClass", "--caches", "1", "--seed", "0", "-o", str(output),
    ])
    out = capsys.readouterr().out
    assert status == 1
    assert "the failure depends on state left by earlier runs (e.g. class or module state); " \
        "the program does not fail alone" in out.lower()
    assert "# ---8<---" not in out
    assert "--seed 0 --caches 1" in out
    assert not output.exists()
    assert f"Wrote nothing to {output}" in out
