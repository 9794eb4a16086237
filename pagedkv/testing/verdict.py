"""The verdict of a conformance run: passed, with counts; or the failure and its shrunk program.

:func:`~pagedkv.testing.stateful.run_cache_machine` returns one; ``report()``
writes it for people, as ``pagedkv check`` prints it; ``assert_passed()``
raises that same report in a test suite.

>>> verdict = Verdict(True, "mycache:make", 0, 5, 5, 40, 6, 0.1, ("the output against the oracle",))
>>> print(verdict.report().splitlines()[0])
PASSED: mycache:make kept the seed contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.testing.contract import ContractError

__all__ = ["Verdict"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of a run: passed, with counts; or the failure and its shrunk program.

    Attributes:
        passed: no example broke the contract.
        label: the factory checked.
        seed: the run's seed; the same seed replays the same examples.
        num_examples: examples run; Hypothesis runs some beyond ``max_examples``
            that it discards (overruns, mutations).
        max_examples: the ``max_examples`` setting of the run.
        num_steps: ``attend`` calls made.
        num_caches: caches built.
        elapsed_s: wall time.
        checks: what was checked at every step.
        failure: the shrunk example's error message.
        reproducer: the shrunk example as a runnable Python program.
        first_failing_example: which example failed first (1-based).
        num_program_steps: ``attend`` calls in the shrunk program.
        fails_alone: ``True`` when the program failed the same way run alone in
            a new Python process; ``False`` when it did not (the failure depends
            on state earlier runs left behind, and there is no program);
            ``None`` when that was not tried (no importable factory) or could not be.
    """

    passed: bool
    label: str
    seed: int
    num_examples: int
    max_examples: int
    num_steps: int
    num_caches: int
    elapsed_s: float
    checks: tuple[str, ...]
    failure: str | None = None
    reproducer: str | None = None
    first_failing_example: int | None = None
    num_program_steps: int | None = None
    fails_alone: bool | None = None

    def __bool__(self) -> bool:
        return self.passed

    def report(self, *, rerun: str | None = None) -> str:
        """The verdict as text for people.

        Args:
            rerun: a command that replays this run, printed after a failure.

        Returns:
            Lines ending in a newline; on failure the reproducer sits between
            ``# ---8<---`` lines.
        """
        if self.passed:
            return (
                f"PASSED: {self.label} kept the seed contract.\n"
                f"  {self.num_examples:,} runs (max_examples={self.max_examples}), "
                f"{self.num_steps:,} attend calls on "
                f"{self.num_caches:,} caches (seed {self.seed}, {self.elapsed_s:.1f} s).\n"
                f"  Checked at every call: {', '.join(self.checks)}.\n"
            )
        found = (
            f"in example {self.first_failing_example}"
            if self.first_failing_example is not None
            else "during the run"
        )
        shrunk = (
            f", shrunk to {self.num_program_steps} attend call"
            f"{'s' if self.num_program_steps != 1 else ''}"
            if self.num_program_steps is not None
            else ""
        )
        lines = [
            f"FAILED: {self.label} broke the seed contract.",
            f"  Found {found} (seed {self.seed}){shrunk}; {self.elapsed_s:.1f} s.",
            "",
            *(self.failure or "").splitlines(),
            "",
        ]
        if self.reproducer is not None:
            lines += [
                "The shrunk failing program, as runnable Python (save it, run it with python):",
                "",
                "# ---8<---",
                *self.reproducer.splitlines(),
                "# ---8<---",
                "",
            ]
        if rerun:
            lines += [f"Replay this run: {rerun}", ""]
        return "\n".join(lines)

    def assert_passed(self) -> None:
        """Raise the report if the cache broke the contract: the check for a test suite.

        The message is :meth:`report`'s text, the shrunk program included, as
        ``pagedkv check`` prints it, with the seed that replays the run.

        Raises:
            ContractError: the cache broke the seed contract (an ``AssertionError``,
                so pytest and unittest report it as a failed test).

        >>> Verdict(True, "mycache:make", 0, 5, 5, 40, 6, 0.1, ()).assert_passed()
        """
        __tracebackhide__ = True  # pytest shows the report, not this frame
        if not self.passed:
            rerun = f"pass seed={self.seed} (and the same options) to check_cache or run_cache_machine"
            raise ContractError("\n" + self.report(rerun=rerun), kind="verdict")

    def __str__(self) -> str:
        return self.report()
