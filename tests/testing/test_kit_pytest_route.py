"""The kit as a newcomer meets it: the docs' pytest templates, state kept on a class, a program run alone.

Each test here was a report in issue 27: the documented template failed on a
correct seed cache, the pytest route reported Hypothesis's unshrunk example
where ``pagedkv check`` shrank to two calls, and a cache keeping its tokens
on its class got a program that passes when run alone.
"""

from __future__ import annotations

import functools
import re
import sys
import textwrap
import unittest
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import settings

from pagedkv.testing import ContractError, Verdict, check_cache, make_cache_machine
from pagedkv.testing.buggy import EvictsAfterScoring, KeepsTokensOnClass, SeedCache
from pagedkv.testing.program import replay_alone
from pagedkv.testing.stateful import DEPENDS_ON_EARLIER_RUNS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "testing.md"

# A newcomer's solution of the seed exercise (/work/shared/seed): dot, softmax,
# append, evict the oldest past max_size, then score; vectors as plain lists.
SEED_CACHE = """
import math


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def softmax(xs):
    peak = max(xs)
    exps = [math.exp(x - peak) for x in xs]
    return [e / sum(exps) for e in exps]


class MyCache:
    def __init__(self, max_size=None):
        self.max_size = max_size
        self.keys = []
        self.values = []

    def attend(self, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        {evict}
        weights = softmax([dot(q, key) for key in self.keys])
        return [sum(w * value[i] for w, value in zip(weights, self.values)) for i in range(len(v))]
"""
EVICT = "if self.max_size is not None and len(self.keys) > self.max_size: del self.keys[0], self.values[0]"


def docs_block(marker: str) -> str:
    """The ```python block of docs/testing.md that contains ``marker``, verbatim."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    (block,) = [block for block in blocks if marker in block]
    return block


def load_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str, *, evict: str
) -> ModuleType:
    """Write ``mycache.py`` and the docs' template beside it, import the template as pytest would."""
    (tmp_path / "mycache.py").write_text(textwrap.dedent(SEED_CACHE).replace("{evict}", evict))
    (tmp_path / "test_my_cache_template.py").write_text(docs_block(marker))
    monkeypatch.syspath_prepend(str(tmp_path))  # the replay alone gets sys.path too
    for name in ("mycache", "test_my_cache_template"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import test_my_cache_template  # type: ignore[import-not-found]

    module: ModuleType = test_my_cache_template  # both leave sys.modules when the test ends
    return module


@functools.cache
def evicts_after_scoring(*, fresh_process: bool) -> Verdict:
    """The kit's verdict on ``EvictsAfterScoring`` (seed 0), run once and shared by the tests below."""
    return check_cache(EvictsAfterScoring, max_examples=100, seed=0, fresh_process=fresh_process)


def run_test_case(case: type[unittest.TestCase]) -> unittest.TestResult:
    result = unittest.TestResult()
    case("runTest").run(result)
    return result


# ------------------------------------------------- the docs' pytest templates


def test_the_documented_template_passes_on_a_correct_seed_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = load_template(tmp_path, monkeypatch, "def test_my_cache", evict=EVICT)
    if settings().max_examples < 50:  # the quick profile: 10 examples, as the TestCase's below

        def fewer_examples(factory: Any, **options: Any) -> Verdict:
            return check_cache(factory, **{**options, "max_examples": 10})

        monkeypatch.setattr(template, "check_cache", fewer_examples)
    template.test_my_cache_keeps_the_seed_contract()  # raises on a failure


def test_the_documented_template_fails_with_the_clis_shrunk_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bug: no eviction at all, so every bounded window is wrong by its second token.
    template = load_template(tmp_path, monkeypatch, "def test_my_cache", evict="pass")
    with pytest.raises(ContractError) as failed:
        template.test_my_cache_keeps_the_seed_contract()
    report = str(failed.value)
    assert "FAILED: mycache:MyCache broke the seed contract." in report
    assert "shrunk to 2 attend calls" in report
    program = report.split("# ---8<---\n")[1]
    assert "from mycache import MyCache" in program
    assert len(re.findall(r"^cache_\d+\.attend\(", program, flags=re.MULTILINE)) == 2
    assert "Replay this run: pass seed=" in report


def test_the_documented_testcase_template_passes_on_a_correct_seed_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = load_template(tmp_path, monkeypatch, "TestMyCacheConformance", evict=EVICT)
    case = template.TestMyCacheConformance
    case.settings = settings(case.settings, max_examples=10, database=None)
    result = run_test_case(case)
    assert result.wasSuccessful(), result.failures + result.errors


def test_the_testcase_fails_with_the_clis_shrunk_report_not_hypothesis_example() -> None:
    case = make_cache_machine(EvictsAfterScoring).TestCase
    case.settings = settings(max_examples=100, deadline=None, database=None)
    result = run_test_case(case)
    ((_, traceback),) = result.failures
    assert "FAILED: pagedkv.testing.buggy:EvictsAfterScoring broke the seed contract." in traceback
    assert "shrunk to 2 attend calls" in traceback
    assert "# ---8<---" in traceback
    assert "Falsifying example" not in traceback


def test_the_testcase_is_one_class_per_machine_and_keeps_its_settings() -> None:
    machine = make_cache_machine(SeedCache)
    case = machine.TestCase
    case.settings = settings(max_examples=3, database=None)
    assert machine.TestCase is case
    assert machine.TestCase.settings.max_examples == 3
    assert run_test_case(case).wasSuccessful()


def test_assert_passed_does_nothing_on_a_pass_and_raises_the_report_on_a_failure() -> None:
    check_cache(SeedCache, max_examples=5, seed=0).assert_passed()
    verdict = evicts_after_scoring(fresh_process=True)
    with pytest.raises(ContractError, match="shrunk to 2 attend calls") as failed:
        verdict.assert_passed()
    assert failed.value.kind == "verdict"
    assert verdict.reproducer is not None and verdict.reproducer in str(failed.value)


# ------------------------------------------ a failure that needs earlier runs


def test_state_kept_on_the_class_is_reported_as_depending_on_earlier_runs() -> None:
    # One cache per example: only an earlier example's leftovers can break it.
    verdict = check_cache(KeepsTokensOnClass, max_examples=100, seed=0, max_caches=1)
    assert not verdict.passed
    assert verdict.fails_alone is False
    assert verdict.reproducer is None
    assert verdict.num_program_steps is None
    report = verdict.report()
    assert (
        "The failure depends on state left by earlier runs (e.g. class or module state); "
        "the program does not fail alone." in report
    )
    assert "In this process, after earlier examples, it failed with:" in report
    assert "shrunk to" not in report
    assert "# ---8<---" not in report


def test_a_program_that_fails_alone_is_reported_as_such() -> None:
    verdict = evicts_after_scoring(fresh_process=True)
    assert verdict.fails_alone is True
    assert DEPENDS_ON_EARLIER_RUNS not in verdict.report()


def test_fresh_process_false_skips_the_replay_alone() -> None:
    verdict = evicts_after_scoring(fresh_process=False)
    assert verdict.fails_alone is None
    assert verdict.num_program_steps == 2


def test_replay_alone_tells_failed_passed_and_not_run_apart() -> None:
    verdict = evicts_after_scoring(fresh_process=False)
    assert verdict.reproducer is not None
    failed = replay_alone(verdict.reproducer)
    assert (failed.outcome, failed.kind) == ("failed", "output")
    passed = replay_alone(verdict.reproducer.replace("EvictsAfterScoring", "SeedCache"))
    assert passed.outcome == "passed"
    missing = replay_alone("import no_such_module_for_the_kit\n")
    assert missing.outcome == "not run"
    assert "no_such_module_for_the_kit" in missing.detail
