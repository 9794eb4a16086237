"""The conformance state machine: any KV cache, driven beside the oracle, every step checked.

:func:`make_cache_machine` builds a Hypothesis ``RuleBasedStateMachine`` around a
*factory*, any callable that ``factory(max_size=None)`` or
``factory(max_size=W)`` turns into an object with the seed's
``attend(q, k, v)``. Each example draws, once and tiny, a token shape (one
head, many heads, grouped-query), a magnitude tier and a window ``W``
(``None`` or 1..6, so windows wrap all the time); then it interleaves

* ``attend``: a fresh token on one of the caches, checked by
  :class:`~pagedkv.testing.contract.CheckedCache` against the oracle (append
  before scoring, evict before scoring, an exact window of ``min(n, W)``
  tokens), with ``len(cache)`` and ``cache.check_invariants()`` when the cache
  has them;
* ``open_cache``: another cache from the same factory, with its own window
  (caches must not share state).

At the end of each example every cache's ``close()`` is called, if it has one.
:func:`run_cache_machine` runs a machine with a seed and returns a
:class:`Verdict`: passed, with how many examples and calls; or the shrunk
failing program as runnable Python. :func:`check_cache` does both.

>>> from pagedkv.testing.buggy import SeedCache
>>> check_cache(SeedCache, max_examples=5, seed=0).passed
True
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

try:
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity, note
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        'pagedkv.testing.stateful needs Hypothesis; install the test extra: '
        'pip install "pagedkv[test]"'
    ) from error

from pagedkv.testing.contract import CheckedCache, ContractError, Precision, precision_eps
from pagedkv.testing.program import (
    AttendStep,
    CloseStep,
    FactoryCode,
    OpenStep,
    Step,
    describe_factory,
    feed_value,
    render_program,
    replay,
    shrink_program,
)
from pagedkv.testing.strategies import Config, Shape, configs, tokens
from pagedkv.testing.strategies import max_sizes as _max_sizes
from pagedkv.testing.strategies import shapes as _shapes

__all__ = [
    "CacheMachine",
    "Feed",
    "RunStats",
    "Verdict",
    "check_cache",
    "make_cache_machine",
    "run_cache_machine",
]

#: How tokens reach the cache: nested Python lists (the seed), or numpy arrays.
Feed = Literal["lists", "arrays"]


@dataclass
class RunStats:
    """Counters a machine class keeps over one run (reset by :func:`run_cache_machine`)."""

    num_examples: int = 0
    num_steps: int = 0
    num_caches: int = 0
    first_failing_example: int | None = None
    has_len: bool = False
    has_invariants: bool = False


@dataclass
class _Failure:
    error: BaseException
    steps: list[Step]


class CacheMachine(RuleBasedStateMachine):
    """One example's state: the caches under test, each beside its oracle, and the steps so far.

    Subclasses come from :func:`make_cache_machine`, which adds the rules and
    sets the class attributes below; this class holds what they share.

    Invariants:
        * every cache in ``self.caches`` matched the oracle at every step so far;
        * ``self.steps`` replays this example from scratch (see :mod:`~pagedkv.testing.program`).
    """

    factory: ClassVar[Callable[..., Any]]
    factory_code: ClassVar[FactoryCode | None]
    label: ClassVar[str]
    feed: ClassVar[Feed]
    scale: ClassVar[float]
    precision: ClassVar[Precision]
    max_caches: ClassVar[int]
    close_caches: ClassVar[bool]
    stats: ClassVar[RunStats]
    last_failure: ClassVar[_Failure | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[CheckedCache] = []
        self.steps: list[Step] = []
        self.config: Config | None = None
        self._failed = False

    # ------------------------------------------------------------ rule bodies

    def start(self, config: Config) -> None:
        """The first step: fix the shape and magnitude for this example, open the first cache."""
        self.config = config
        type(self).stats.num_examples += 1
        note(f"shape {config.shape}, values within ±{config.magnitude:g}")
        self.open(config.max_size)

    def open(self, max_size: int | None) -> None:
        """Build another cache with ``factory(max_size=max_size)``."""
        cls = type(self)
        name = f"cache_{len(self.caches)}"
        self.steps.append(OpenStep(name, max_size))
        note(f"{name} = factory(max_size={max_size})")
        with self._recording():
            try:
                cache = cls.factory(max_size=max_size)
            except Exception as error:
                raise ContractError(
                    f"factory(max_size={max_size}) raised {type(error).__name__}: {error}",
                    kind="factory",
                ) from error
            checked = CheckedCache(
                cache, max_size=max_size, scale=cls.scale, precision=cls.precision, name=name
            )
        self.caches.append(checked)
        cls.stats.num_caches += 1
        cls.stats.has_len |= hasattr(cache, "__len__")
        cls.stats.has_invariants |= callable(getattr(cache, "check_invariants", None))

    def attend(self, data: st.DataObject) -> None:
        """Draw a token and attend it on one of the caches; the check raises on any breach."""
        cls, config = type(self), self.config
        assert config is not None  # set by the initialize rule, which runs first
        index = 0
        if len(self.caches) > 1:
            index = data.draw(st.integers(0, len(self.caches) - 1), label="cache")
        q, k, v = data.draw(
            tokens(config.shape, magnitude=config.magnitude, precision=cls.precision),
            label="q, k, v",
        )
        checked = self.caches[index]
        step = AttendStep(checked.name, q, k, v)
        self.steps.append(step)
        cls.stats.num_steps += 1
        fed = self._fed
        try:
            with self._recording(step, checked):
                checked.attend(fed(q), fed(k), fed(v))
        finally:
            step.expected = checked.last_expected

    def teardown(self) -> None:
        """Close every cache that has ``close()``: a shared pool gets its blocks back."""
        if not type(self).close_caches:
            return
        for checked in self.caches:
            close = getattr(checked.cache, "close", None)
            if not callable(close):
                continue
            if self._failed:  # the run already failed: a second error would hide the first
                with suppress(Exception):
                    close()
                continue
            self.steps.append(CloseStep(checked.name))
            with self._recording():
                close()

    # ---------------------------------------------------------------- private

    def _fed(self, x: Any) -> Any:
        return feed_value(x, type(self).feed, type(self).precision)

    @contextmanager
    def _recording(
        self, step: AttendStep | None = None, checked: CheckedCache | None = None
    ) -> Iterator[None]:
        """Keep the steps of the first failure of this run, and attach them as a note."""
        try:
            yield
        except Exception as error:
            if not self._failed:
                self._failed = True
                cls = type(self)
                if step is not None and checked is not None:
                    step.expected = checked.last_expected
                if cls.stats.first_failing_example is None:
                    cls.stats.first_failing_example = cls.stats.num_examples
                cls.last_failure = _Failure(error, list(self.steps))
                add_note = getattr(error, "add_note", None)
                if callable(add_note):
                    add_note("The failing run as a program:\n" + _render(cls, self.steps, None))
            raise


def _render(cls: type[CacheMachine], steps: list[Step], failure: str | None) -> str:
    return render_program(
        steps,
        factory=cls.factory_code,
        label=cls.label,
        feed=cls.feed,
        precision=cls.precision,
        scale=cls.scale,
        failure=failure,
    )


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
            :class:`~pagedkv.testing.program.FactoryCode` or ``"module:name"``;
            default found from the factory itself (not for lambdas).
        name: the class's name.

    Returns:
        A ``RuleBasedStateMachine`` subclass: run it with :func:`run_cache_machine`,
        or collect ``Machine.TestCase`` in a test module.

    Raises:
        ValueError: an option out of range.
        TypeError: ``factory`` is not callable.
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    if feed not in ("lists", "arrays"):
        raise ValueError(f"feed must be 'lists' or 'arrays', got {feed!r}")
    precision_eps(precision)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if isinstance(max_caches, bool) or not isinstance(max_caches, int) or max_caches < 1:
        raise ValueError(f"max_caches must be an int >= 1, got {max_caches!r}")
    code = FactoryCode.from_spec(factory_code) if isinstance(factory_code, str) else factory_code
    if code is None:
        code = describe_factory(factory)
    shape_strategy = shapes if shapes is not None else _shapes(layouts=("one-head",))
    size_strategy = max_sizes if max_sizes is not None else _max_sizes()
    config_strategy = configs(
        shapes=shape_strategy, max_sizes=size_strategy, scale=scale, precision=precision
    )

    class Machine(CacheMachine):
        @initialize(config=config_strategy)
        def open_first_cache(self, config: Config) -> None:
            self.start(config)

        @precondition(lambda self: 0 < len(self.caches) < max_caches)
        @rule(max_size=size_strategy)
        def open_cache(self, max_size: int | None) -> None:
            self.open(max_size)

        @rule(data=st.data())
        def attend_token(self, data: st.DataObject) -> None:
            self.attend(data)

    if isinstance(factory_code, str):
        label = factory_code
    elif code is not None and code.expression.startswith("functools.partial("):
        label = code.expression
    elif code is not None:
        label = f"{factory.__module__}:{factory.__qualname__}"
    else:
        label = ""
    Machine.factory = staticmethod(factory)
    Machine.factory_code = code
    Machine.label = label or getattr(factory, "__qualname__", repr(factory))
    Machine.feed = feed
    Machine.scale = float(scale)
    Machine.precision = precision
    Machine.max_caches = max_caches
    Machine.close_caches = close
    Machine.stats = RunStats()
    Machine.__name__ = Machine.__qualname__ = name or "CacheMachine"
    return Machine


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

    def __str__(self) -> str:
        return self.report()


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
            # NOTE: no Phase.shrink: the program-level shrinker (shrink_program)
            # does better in a tenth of the time on these runs; see its note.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        )
    if max_examples is not None:
        settings = hypothesis.settings(settings, max_examples=max_examples)
    if steps is not None:
        settings = hypothesis.settings(settings, stateful_step_count=steps)
    return settings


def _shrink(
    machine: type[CacheMachine], steps: list[Step]
) -> tuple[list[Step], ContractError | None]:
    """Replay the failing run on its own; if it fails again, shrink it by whole steps.

    Returns:
        The program, and the error its last replay raised (``None``: it did not fail).
    """

    def run(candidate: list[Step]) -> ContractError | None:
        return replay(
            candidate,
            machine.factory,
            feed=machine.feed,
            precision=machine.precision,
            scale=machine.scale,
            close=machine.close_caches,
        )

    first = run(steps)
    if first is None:
        return steps, None
    kind = first.kind

    def still_fails(candidate: list[Step]) -> bool:
        error = run(candidate)
        return error is not None and error.kind == kind

    shrunk = shrink_program(steps, still_fails)
    final = run(shrunk)
    if final is None or final.kind != kind:  # pragma: no cover - a nondeterministic cache
        return steps, run(steps)
    return shrunk, final


def _leaf(error: BaseException) -> BaseException:
    """The first real error inside exception groups (Flaky and multiple failures)."""
    inner = getattr(error, "exceptions", None)
    while inner:
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return error


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
    """
    chosen = seed if seed is not None else random.SystemRandom().randrange(2**32)
    run_settings = _run_settings(settings, max_examples, steps)
    machine.stats = RunStats()
    machine.last_failure = None
    started = time.perf_counter()
    error: BaseException | None = None
    getter = getattr(hypothesis.stateful, "get_state_machine_test", None)
    try:
        if getter is not None:
            hypothesis.seed(chosen)(getter(machine, settings=run_settings))()
        else:  # pragma: no cover - Hypothesis before get_state_machine_test: derandomized
            hypothesis.stateful.run_state_machine_as_test(
                machine, settings=hypothesis.settings(run_settings, derandomize=True)
            )
    except Exception as caught:
        if isinstance(caught, hypothesis.errors.HypothesisException) and not isinstance(
            caught, Flaky
        ):
            raise
        error = caught
    stats = machine.stats
    checks = ["the output against the oracle"]
    if stats.has_len:
        checks.append("len(cache) == min(n, max_size)")
    if stats.has_invariants:
        checks.append("cache.check_invariants()")
    common: dict[str, Any] = {
        "label": machine.label,
        "seed": chosen,
        "num_examples": stats.num_examples,
        "max_examples": run_settings.max_examples,
        "num_steps": stats.num_steps,
        "num_caches": stats.num_caches,
        "elapsed_s": time.perf_counter() - started,
        "checks": tuple(checks),
    }
    if error is None:
        return Verdict(passed=True, **common)
    failure = machine.last_failure
    leaf = _leaf(error)
    message = str(leaf) if isinstance(leaf, ContractError) else f"{type(leaf).__name__}: {leaf}"
    if isinstance(error, Flaky):
        message = (
            "The failure did not happen again when its example was replayed: the cache keeps "
            "state between instances, or is not deterministic. The first error:\n" + message
        )
    reproducer = None
    num_program_steps = None
    if failure is not None:
        recorded = failure.error
        if isinstance(recorded, ContractError) and not isinstance(error, Flaky):
            message = str(recorded)
        steps, replayed = _shrink(machine, failure.steps)
        if replayed is not None:
            message = str(replayed)
        else:
            message += (
                "\n(Replayed on its own, this program did not fail: the cache depends on "
                "state from earlier examples, or is not deterministic.)"
            )
        reproducer = _render(machine, steps, message)
        num_program_steps = sum(isinstance(step, AttendStep) for step in steps)
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

