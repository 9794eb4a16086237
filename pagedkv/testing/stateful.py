"""Run the conformance state machine and judge the run: a :class:`Verdict`, never an exception.

:func:`~pagedkv.testing.machine.make_cache_machine` builds a Hypothesis
``RuleBasedStateMachine`` around a *factory*, any callable that
``factory(max_size=None)`` or ``factory(max_size=W)`` turns into an object with
the seed's ``attend(q, k, v)`` (see :mod:`~pagedkv.testing.machine`).
:func:`run_cache_machine` runs a machine with a seed and returns a
:class:`Verdict`: passed, with how many examples and calls; or the shrunk
failing program as runnable Python. :func:`check_cache` does both.

Each run gets its own :class:`~pagedkv.testing.machine.MachineRun`, handed to
every example's machine, so runs in one process never share counts or
failures, even one started inside another.

>>> from pagedkv.testing.buggy import SeedCache
>>> check_cache(SeedCache, max_examples=5, seed=0).passed
True
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, cast

try:
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity
    from hypothesis.errors import Flaky
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f'{__name__} needs Hypothesis; install the test extra: pip install "pagedkv[test]"'
    ) from error

from pagedkv.testing.contract import ContractError
from pagedkv.testing.machine import (
    CacheMachine,
    MachineOptions,
    MachineRun,
    RunStats,
    make_cache_machine,
)
from pagedkv.testing.program import AttendStep, Feed, Step
from pagedkv.testing.shrink import shrink_program
from pagedkv.testing.verdict import Verdict

__all__ = [
    "CacheMachine",
    "Feed",
    "MachineOptions",
    "MachineRun",
    "RunStats",
    "Verdict",
    "check_cache",
    "make_cache_machine",
    "run_cache_machine",
]


def _run_settings(
    settings: hypothesis.settings | None, max_examples: int | None, steps: int | None
) -> hypothesis.settings:
    if settings is None:
        settings = hypothesis.settings(
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
            report_multiple_bugs=False,
            # NOTE: no Phase.shrink: the program shrinker (shrink_program) leaves
            # fewer steps in a tenth of the time; docs/testing.md has the figures.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        )
    if max_examples is not None:
        settings = hypothesis.settings(settings, max_examples=max_examples)
    if steps is not None:
        settings = hypothesis.settings(settings, stateful_step_count=steps)
    return settings


def _shrink(options: MachineOptions, steps: list[Step]) -> tuple[list[Step], ContractError | None]:
    """Replay the failing run on its own; if it fails again, shrink it while it fails the same way.

    Returns:
        The program, and the error its last replay raised (``None``: it did not fail).
    """
    first = options.replay(steps)
    if first is None:
        return steps, None
    kind = first.kind

    def still_fails(candidate: list[Step]) -> bool:
        error = options.replay(candidate)
        return error is not None and error.kind == kind

    shrunk = shrink_program(steps, still_fails)
    final = options.replay(shrunk)
    if final is None or final.kind != kind:  # pragma: no cover - a nondeterministic cache
        return steps, options.replay(steps)
    return shrunk, final


def _leaf(error: BaseException) -> BaseException:
    """The first real error inside exception groups (Flaky and multiple failures)."""
    inner = getattr(error, "exceptions", None)
    while inner:
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return error


def _checks(stats: RunStats) -> tuple[str, ...]:
    checks = ["the output against the oracle"]
    if stats.has_len:
        checks.append("len(cache) == min(n, max_size)")
    if stats.has_invariants:
        checks.append("cache.check_invariants()")
    return tuple(checks)


def run_cache_machine(
    machine: type[CacheMachine],
    *,
    max_examples: int | None = None,
    seed: int | None = None,
    steps: int | None = None,
    settings: hypothesis.settings | None = None,
) -> Verdict:
    """Run ``machine`` and return the verdict instead of raising.

    Args:
        machine: a class from :func:`make_cache_machine`.
        max_examples: examples to try (default: the current Hypothesis profile's).
        seed: the random seed; ``None`` picks one and reports it.
        steps: most steps per example (default: the profile's ``stateful_step_count``).
        settings: Hypothesis settings to start from; by default the current profile
            without a database, quiet, one bug reported.

    Returns:
        The :class:`Verdict`.

    Raises:
        TypeError: ``machine`` has no options (it is not from :func:`make_cache_machine`).
    """
    options = getattr(machine, "options", None)
    if not isinstance(options, MachineOptions):
        raise TypeError(f"{machine.__name__} has no options: build it with make_cache_machine()")
    chosen = seed if seed is not None else random.SystemRandom().randrange(2**32)
    run_settings = _run_settings(settings, max_examples, steps)
    run = MachineRun()

    # NOTE: Hypothesis takes any callable that returns a machine (zarr passes a
    # function too); each example gets a new machine, all of them this run's.
    def build() -> CacheMachine:
        return machine(options, run)

    factory = cast("type[CacheMachine]", build)
    started = time.perf_counter()
    error: BaseException | None = None
    getter = getattr(hypothesis.stateful, "get_state_machine_test", None)
    try:
        if getter is not None:
            hypothesis.seed(chosen)(getter(factory, settings=run_settings))()
        else:  # pragma: no cover - Hypothesis before get_state_machine_test: derandomized
            hypothesis.stateful.run_state_machine_as_test(
                factory, settings=hypothesis.settings(run_settings, derandomize=True)
            )
    except Exception as caught:
        if isinstance(caught, hypothesis.errors.HypothesisException) and not isinstance(
            caught, Flaky
        ):
            raise
        error = caught
    stats = run.stats
    common: dict[str, Any] = {
        "label": options.label,
        "seed": chosen,
        "num_examples": stats.num_examples,
        "max_examples": run_settings.max_examples,
        "num_steps": stats.num_steps,
        "num_caches": stats.num_caches,
        "elapsed_s": time.perf_counter() - started,
        "checks": _checks(stats),
    }
    if error is None:
        return Verdict(passed=True, **common)
    leaf = _leaf(error)
    message = str(leaf) if isinstance(leaf, ContractError) else f"{type(leaf).__name__}: {leaf}"
    if isinstance(error, Flaky):
        message = (
            "The failure did not happen again when its example was replayed: the cache keeps "
            "state between instances, or is not deterministic. The first error:\n" + message
        )
    reproducer = None
    num_program_steps = None
    if run.failure is not None:
        recorded = run.failure.error
        if isinstance(recorded, ContractError) and not isinstance(error, Flaky):
            message = str(recorded)
        program, replayed = _shrink(options, run.failure.steps)
        if replayed is not None:
            message = str(replayed)
        else:
            message += (
                "\n(Replayed on its own, this program did not fail: the cache depends on "
                "state from earlier examples, or is not deterministic.)"
            )
        reproducer = options.render(program, message)
        num_program_steps = sum(isinstance(step, AttendStep) for step in program)
    return Verdict(
        passed=False,
        failure=message,
        reproducer=reproducer,
        first_failing_example=stats.first_failing_example,
        num_program_steps=num_program_steps,
        **common,
    )


def check_cache(
    factory: Callable[..., Any],
    *,
    max_examples: int | None = 100,
    seed: int | None = None,
    steps: int | None = None,
    settings: hypothesis.settings | None = None,
    **options: Any,
) -> Verdict:
    """Build the machine for ``factory`` and run it: make_cache_machine, then run_cache_machine.

    Args:
        factory: see :func:`make_cache_machine`.
        max_examples: examples to try.
        seed: the random seed (``None``: pick one).
        steps: most steps per example.
        settings: Hypothesis settings to start from.
        **options: passed to :func:`make_cache_machine` (``feed``, ``shapes``, ...).

    Returns:
        The :class:`Verdict`.
    """
    machine = make_cache_machine(factory, **options)
    return run_cache_machine(
        machine, max_examples=max_examples, seed=seed, steps=steps, settings=settings
    )
