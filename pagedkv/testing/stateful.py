"""Run the conformance state machine and judge the run: a :class:`Verdict`, never an exception.

:func:`make_cache_machine` builds a Hypothesis ``RuleBasedStateMachine`` around a *factory*,
any callable that ``factory(max_size=None)`` or ``factory(max_size=W)`` turns into an object
with the seed's ``attend(q, k, v)``; :func:`run_cache_machine` runs it with a seed, each run
with its own :class:`~pagedkv.testing.machine.MachineRun`, and replays a failing program alone
in a new Python process before reporting it; :func:`check_cache` does both.
"""

from __future__ import annotations

import functools
import random
import time
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

try:
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f'{__name__} needs Hypothesis; install the test extra: pip install "pagedkv[test]"'
    ) from error

from pagedkv.testing.contract import ContractError, Precision
from pagedkv.testing.factory_code import FactoryCode, name_factory
from pagedkv.testing.machine import (
    CacheMachine,
    MachineOptions,
    MachineRun,
    RunStats,
)
from pagedkv.testing.program import AttendStep, Feed, Step, replay_alone
from pagedkv.testing.shrink import shrink_program
from pagedkv.testing.strategies import Shape
from pagedkv.testing.strategies import max_sizes as default_max_sizes
from pagedkv.testing.strategies import shapes as default_shapes
from pagedkv.testing.verdict import Verdict

__all__ = [
    "CacheMachine",
    "Feed",
    "MachineOptions",
    "MachineRun",
    "RunStats",
    "Verdict",
    "check_cache",
    "machine_test_case",
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


#: What a failure that needs earlier runs' state is reported as, instead of a program.
DEPENDS_ON_EARLIER_RUNS = (
    "The failure depends on state left by earlier runs (e.g. class or module state); "
    "the program does not fail alone.\nRun in a new Python process, neither the shrunk "
    "program nor the whole failing example failed. Look for state the cache keeps outside "
    "its instance: a class attribute (a list in the class body is shared by every "
    "instance), a module global, a cache keyed by id(). Replaying the run with its seed "
    "runs the earlier examples too."
)


@dataclass(frozen=True)
class _Reported:
    """The failing program to report, once checked alone in a new process."""

    message: str
    program: list[Step] | None
    fails_alone: bool | None


def _check_alone(
    options: MachineOptions,
    shrunk: list[Step],
    message: str,
    original: list[Step],
    original_message: str,
    kind: str | None,
) -> _Reported:
    """Replay the shrunk program alone in a new process; if it passes there, the whole example.

    NOTE: the shrinker replays in this process, where a cache that keeps state
    on its class sees every earlier replay's leftovers: the program it leaves
    can fail here and pass in the reader's hands (even with 0 calls). Only a
    new process says whether a program fails on its own.
    """

    def fails(program: list[Step], failure: str, same_kind: str | None) -> bool | None:
        alone = replay_alone(options.render(program, failure))
        if alone.outcome == "not run":
            return None
        return alone.outcome == "failed" and (same_kind is None or alone.kind == same_kind)

    shrunk_alone = fails(shrunk, message, kind)
    if shrunk_alone is None:
        note = "(Could not run the program in a new Python process to check it fails alone.)"
        return _Reported(f"{message}\n{note}", shrunk, None)
    if shrunk_alone:
        return _Reported(message, shrunk, True)
    if fails(original, original_message, None):  # it may fail earlier alone: any failure
        note = (
            "(Not shrunk: the shrunk program did not fail alone in a new Python process, so this "
            "is the whole failing example; the cache keeps state between instances.)"
        )
        return _Reported(f"{original_message}\n{note}", original, True)
    in_process = f"In this process, after earlier examples, it failed with:\n{message}"
    return _Reported(f"{DEPENDS_ON_EARLIER_RUNS}\n\n{in_process}", None, False)


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
    fresh_process: bool = True,
) -> Verdict:
    """Run ``machine`` and return the verdict instead of raising.

    Args:
        machine: a class from :func:`make_cache_machine`.
        max_examples: examples to try (default: the current Hypothesis profile's).
        seed: the random seed; ``None`` picks one and reports it.
        steps: most steps per example (default: the profile's ``stateful_step_count``).
        settings: Hypothesis settings to start from; by default the current profile
            without a database, quiet, one bug reported.
        fresh_process: run a failing program alone in a new Python process
            before reporting it (when the factory is importable), so a failure
            that needs earlier examples' state is reported as that.

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
            hypothesis.stateful.run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
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
    reported = _Reported(message, None, None)
    if run.failure is not None:
        recorded = run.failure.error
        if isinstance(recorded, ContractError) and not isinstance(error, Flaky):
            message = str(recorded)
        original_message = message
        program, replayed = _shrink(options, run.failure.steps)
        if replayed is not None:
            message = str(replayed)
        else:
            message += (
                "\n(Replayed on its own, this program did not fail: the cache depends on "
                "state from earlier examples, or is not deterministic.)"
            )
        kind = replayed.kind if replayed is not None else getattr(recorded, "kind", None)
        reported = _Reported(message, program, None)
        if fresh_process and options.factory_code is not None:
            reported = _check_alone(
                options, program, message, run.failure.steps, original_message, kind
            )
    final = reported.program
    return Verdict(
        passed=False,
        failure=reported.message,
        reproducer=None if final is None else options.render(final, reported.message),
        first_failing_example=stats.first_failing_example,
        num_program_steps=(
            None if final is None else sum(isinstance(step, AttendStep) for step in final)
        ),
        fails_alone=reported.fails_alone,
        **common,
    )


def check_cache(
    factory: Callable[..., Any],
    *,
    max_examples: int | None = 100,
    seed: int | None = None,
    steps: int | None = None,
    settings: hypothesis.settings | None = None,
    fresh_process: bool = True,
    **options: Any,
) -> Verdict:
    """Build the machine for ``factory`` and run it: make_cache_machine, then run_cache_machine.

    Args:
        factory: see :func:`make_cache_machine`.
        max_examples: examples to try.
        seed: the random seed (``None``: pick one).
        steps: most steps per example.
        settings: Hypothesis settings to start from.
        fresh_process: replay a failing program alone in a new Python process.
        **options: passed to :func:`make_cache_machine` (``feed``, ``shapes``, ...).

    Returns:
        The :class:`Verdict`.

    Example:
        >>> from pagedkv.testing.buggy import EvictsAfterScoring, SeedCache
        >>> check_cache(SeedCache, max_examples=5, seed=0).passed
        True
        >>> check_cache(EvictsAfterScoring, max_examples=50, seed=0).passed
        False
    """
    machine = make_cache_machine(factory, **options)
    return run_cache_machine(
        machine,
        max_examples=max_examples,
        seed=seed,
        steps=steps,
        settings=settings,
        fresh_process=fresh_process,
    )


def _test_case_settings(settings: hypothesis.settings) -> hypothesis.settings:
    """A ``TestCase``'s settings as :func:`run_cache_machine` runs them: no shrink phase, quiet."""
    loud = settings.verbosity in (Verbosity.verbose, Verbosity.debug)
    return hypothesis.settings(
        settings,
        # NOTE: the kit's shrinker replaces Hypothesis's shrink phase, as in
        # run_cache_machine's defaults: fewer steps left, in a tenth of the time.
        phases=[phase for phase in settings.phases if phase is not Phase.shrink],
        verbosity=settings.verbosity if loud else Verbosity.quiet,
        print_blob=False,
        report_multiple_bugs=False,
    )


@functools.cache
def machine_test_case(machine: type[CacheMachine]) -> type[unittest.TestCase]:
    """``machine.TestCase``: a test case that runs ``machine`` as ``pagedkv check`` does.

    Hypothesis's own ``TestCase`` runs its shrink phase (tens of seconds on a
    long run) and reports Hypothesis's falsifying example. This one runs
    :func:`run_cache_machine` with the case's ``settings`` (less the shrink
    phase) and fails with :meth:`Verdict.assert_passed`: the same shrinking and
    the same report, runnable program included, as the command line.

    Args:
        machine: a class from :func:`make_cache_machine`.

    Returns:
        A ``unittest.TestCase`` subclass (the same one each time); assign its
        ``settings`` to choose ``max_examples`` and the like.
    """

    class KitTestCase(unittest.TestCase):
        settings = hypothesis.settings(deadline=None, suppress_health_check=list(HealthCheck))

        def runTest(self) -> None:  # noqa: N802 - unittest's name
            __tracebackhide__ = True  # pytest shows the report, not this frame
            verdict = run_cache_machine(machine, settings=_test_case_settings(self.settings))
            verdict.assert_passed()

    KitTestCase.__name__ = f"{machine.__name__}.TestCase"
    KitTestCase.__qualname__ = f"{machine.__qualname__}.TestCase"
    return KitTestCase


def make_cache_machine(
    factory: Callable[..., Any],
    *,
    feed: Feed = "lists",
    shapes: st.SearchStrategy[Shape] | None = None,
    max_sizes: st.SearchStrategy[int | None] | None = None,
    scale: float = 1.0,
    precision: Precision = "float64",
    max_caches: int = 2,
    close: bool = True,
    factory_code: FactoryCode | str | None = None,
    name: str | None = None,
) -> type[CacheMachine]:
    """A state machine that checks the caches ``factory`` builds against the seed contract.

    Args:
        factory: called as ``factory(max_size=None)`` or ``factory(max_size=W)``;
            returns an object with ``attend(q, k, v)`` (and optionally
            ``__len__``, ``check_invariants()``, ``close()``).
        feed: ``"lists"`` passes nested Python lists of floats (the seed);
            ``"arrays"`` passes numpy arrays of ``precision``'s dtype.
        shapes: token shapes to draw (:func:`~pagedkv.testing.strategies.shapes`);
            default one head, head_dim 1..4, the seed's vectors.
        max_sizes: windows to draw; default ``None`` or 1..6.
        scale: the factor the caches multiply scores by.
        precision: the float type the caches compute in; sets the tolerance
            and the largest magnitudes drawn.
        max_caches: how many caches one example may open (2: caches must not
            share state).
        close: call each cache's ``close()`` at the end of an example.
        factory_code: how reproducers import the factory: a
            :class:`~pagedkv.testing.factory_code.FactoryCode` or ``"module:name"``;
            default found from the factory itself (not for lambdas).
        name: the class's name.

    Returns:
        A :class:`CacheMachine` subclass whose ``options`` hold these arguments
        (frozen): run it with :func:`~pagedkv.testing.stateful.run_cache_machine`,
        or collect ``Machine.TestCase`` in a test module.

    Raises:
        ValueError: an option out of range.
        TypeError: ``factory`` is not callable.

    >>> from pagedkv.testing.buggy import SeedCache
    >>> machine = make_cache_machine(SeedCache)
    >>> machine.options.label
    'pagedkv.testing.buggy:SeedCache'
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    code, label = name_factory(factory, factory_code)
    options = MachineOptions(
        factory=factory,
        shapes=shapes if shapes is not None else default_shapes(layouts=("one-head",)),
        max_sizes=max_sizes if max_sizes is not None else default_max_sizes(),
        feed=feed,
        scale=float(scale),
        precision=precision,
        max_caches=max_caches,
        close=close,
        factory_code=code,
        label=label,
    )
    class_name = name or "CacheMachine"
    namespace = {"options": options, "__qualname__": class_name, "__module__": CacheMachine.__module__}
    machine = cast("type[CacheMachine]", type(class_name, (CacheMachine,), namespace))
    machine.TestCase = machine_test_case(machine)
    return machine
