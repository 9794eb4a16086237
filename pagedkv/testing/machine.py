"""The conformance state machine: any KV cache, driven beside the oracle, every step checked.

A :class:`CacheMachine` is built per example from a frozen :class:`MachineOptions` (what to
check) and a fresh :class:`MachineRun` (what this run found), as zarr's packaged machines take
their store, so two runs never share state. Each example draws a token shape, a magnitude
tier and a window ``W`` once and tiny, then interleaves ``attend`` (checked by
:class:`~pagedkv.testing.contract.CheckedCache`) and ``open_cache`` (another cache with its
own window); at the end every cache's ``close()`` runs. Building, running and judging a
machine: :mod:`~pagedkv.testing.stateful`; the rules in full: docs/testing.md.
"""

from __future__ import annotations

import math
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

try:
    from hypothesis import note
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f'{__name__} needs Hypothesis; install the test extra: pip install "pagedkv[test]"'
    ) from error

from pagedkv.testing.contract import CheckedCache, ContractError, Precision, precision_eps
from pagedkv.testing.factory_code import FactoryCode
from pagedkv.testing.program import (
    AttendStep,
    CloseStep,
    Feed,
    OpenStep,
    Step,
    attend_step,
    open_step,
    render_program,
    replay,
)
from pagedkv.testing.strategies import Config, Shape, configs, tokens

__all__ = [
    "CacheMachine",
    "Failure",
    "MachineOptions",
    "MachineRun",
    "RunStats",
]


@dataclass(frozen=True)
class MachineOptions:
    """What a machine checks and how: fixed when the machine is made, shared by all its runs.

    Args:
        factory: called as ``factory(max_size=None)`` or ``factory(max_size=W)``.
        shapes: the token shapes to draw.
        max_sizes: the windows to draw.
        feed: ``"lists"`` or ``"arrays"``.
        scale: the factor the caches multiply scores by.
        precision: the float type the caches compute in.
        max_caches: how many caches one example may open.
        close: call each cache's ``close()`` at the end of an example.
        factory_code: how printed programs import the factory (``None``: a placeholder).
        label: how reports name the factory.

    Raises:
        ValueError: an option out of range.
        TypeError: ``factory`` is not callable.
    """

    factory: Callable[..., Any]
    shapes: st.SearchStrategy[Shape]
    max_sizes: st.SearchStrategy[int | None]
    feed: Feed = "lists"
    scale: float = 1.0
    precision: Precision = "float64"
    max_caches: int = 2
    close: bool = True
    factory_code: FactoryCode | None = None
    label: str = ""
    #: What each example draws first (shape, magnitude, first window); built from the above.
    configs: st.SearchStrategy[Config] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise TypeError(f"factory must be callable, got {type(self.factory).__name__}")
        if self.feed not in ("lists", "arrays"):
            raise ValueError(f"feed must be 'lists' or 'arrays', got {self.feed!r}")
        precision_eps(self.precision)
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {self.scale}")
        max_caches = self.max_caches
        if isinstance(max_caches, bool) or not isinstance(max_caches, int) or max_caches < 1:
            raise ValueError(f"max_caches must be an int >= 1, got {max_caches!r}")
        drawn = configs(
            shapes=self.shapes, max_sizes=self.max_sizes, scale=self.scale, precision=self.precision
        )
        object.__setattr__(self, "configs", drawn)  # frozen: set once, here

    def replay(self, steps: list[Step]) -> ContractError | None:
        """Run ``steps`` again on new caches from the factory; see :func:`~pagedkv.testing.program.replay`."""
        return replay(
            steps,
            self.factory,
            feed=self.feed,
            precision=self.precision,
            scale=self.scale,
            close=self.close,
        )

    def render(self, steps: list[Step], failure: str | None) -> str:
        """``steps`` as a runnable program (see :func:`~pagedkv.testing.program.render_program`)."""
        return render_program(
            steps,
            factory=self.factory_code,
            label=self.label,
            feed=self.feed,
            precision=self.precision,
            scale=self.scale,
            failure=failure,
        )


@dataclass
class RunStats:
    """Counters over one run: examples, ``attend`` calls, caches, and what the caches offer."""

    num_examples: int = 0
    num_steps: int = 0
    num_caches: int = 0
    first_failing_example: int | None = None
    has_len: bool = False
    has_invariants: bool = False


@dataclass
class Failure:
    """A failing example: the first error it raised, and the steps up to it.

    Args:
        error: the error.
        steps: the program that raised it (a copy of the example's steps).
    """

    error: BaseException
    steps: list[Step]


@dataclass
class MachineRun:
    """What one run of a machine has found: one per run, passed to every example's machine.

    Args:
        stats: the run's counters.
        failure: the latest failing example (Hypothesis replays the one it
            reports last, so after the run this is that one).
    """

    stats: RunStats = field(default_factory=RunStats)
    failure: Failure | None = None


class CacheMachine(RuleBasedStateMachine):
    """One example's state: the caches under test, each beside its oracle, and the steps so far.

    Invariants:
        * every cache in ``self.caches`` matched the oracle at every step so far;
        * ``self.steps`` replays this example from scratch (see :mod:`~pagedkv.testing.program`).

    Args:
        options: what to check; default the class's own ``options``, which
            :func:`make_cache_machine` sets so that Hypothesis (its ``TestCase``)
            can build the machine with no arguments.
        run: where this example counts itself and records its failure;
            default a new one, seen by this example alone.

    Raises:
        TypeError: no options given, and the class has none.
    """

    #: The frozen options of a class from :func:`make_cache_machine`; an instance may be given others.
    options: MachineOptions
    #: A ``unittest.TestCase`` that runs the machine as ``pagedkv check`` does: the
    #: kit's shrinker, and the verdict's report as the failure (not Hypothesis's);
    #: set by :func:`~pagedkv.testing.stateful.make_cache_machine`.
    TestCase: type[unittest.TestCase]  # type: ignore[assignment, unused-ignore]  # newer Hypothesis: its own TestCase type

    def __init__(self, options: MachineOptions | None = None, run: MachineRun | None = None) -> None:
        super().__init__()
        if options is not None:
            self.options = options
        elif not isinstance(getattr(self, "options", None), MachineOptions):
            raise TypeError(
                f"{type(self).__name__} has no options: build the class with make_cache_machine(), "
                "or pass MachineOptions"
            )
        self.run = run if run is not None else MachineRun()
        self.caches: list[CheckedCache] = []
        self.steps: list[Step] = []
        self.config: Config | None = None
        self._failed = False

    # ------------------------------------------------------------------ rules

    @initialize(data=st.data())
    def open_first_cache(self, data: st.DataObject) -> None:
        """Draw this example's configuration, then open its first cache."""
        self.start(data.draw(self.options.configs, label="config"))

    @precondition(lambda self: 0 < len(self.caches) < self.options.max_caches)
    @rule(data=st.data())
    def open_cache(self, data: st.DataObject) -> None:
        """Open another cache, with a window of its own."""
        self.open(data.draw(self.options.max_sizes, label="max_size"))

    @rule(data=st.data())
    def attend_token(self, data: st.DataObject) -> None:
        """Attend a fresh token on one of the open caches."""
        self.attend(data)

    # ------------------------------------------------------------ rule bodies

    def start(self, config: Config) -> None:
        """The first step: fix the shape and magnitude for this example, open the first cache."""
        self.config = config
        self.run.stats.num_examples += 1
        note(f"shape {config.shape}, values within ±{config.magnitude:g}")
        self.open(config.max_size)

    def open(self, max_size: int | None) -> None:
        """Build another cache with ``factory(max_size=max_size)``."""
        options, stats = self.options, self.run.stats
        step = OpenStep(f"cache_{len(self.caches)}", max_size)
        self.steps.append(step)
        note(f"{step.name} = factory(max_size={max_size})")
        with self._recording():
            checked = open_step(
                step, options.factory, scale=options.scale, precision=options.precision
            )
        self.caches.append(checked)
        stats.num_caches += 1
        stats.has_len |= hasattr(checked.cache, "__len__")
        stats.has_invariants |= callable(getattr(checked.cache, "check_invariants", None))

    def attend(self, data: st.DataObject) -> None:
        """Draw a token and attend it on one of the caches; the check raises on any breach."""
        options, config = self.options, self.config
        assert config is not None  # set by the initialize rule, which runs first
        index = 0
        if len(self.caches) > 1:
            index = data.draw(st.integers(0, len(self.caches) - 1), label="cache")
        q, k, v = data.draw(
            tokens(config.shape, magnitude=config.magnitude, precision=options.precision),
            label="q, k, v",
        )
        checked = self.caches[index]
        step = AttendStep(checked.name, q, k, v)
        self.steps.append(step)
        self.run.stats.num_steps += 1
        with self._recording():
            attend_step(step, checked, feed=options.feed, precision=options.precision)

    def teardown(self) -> None:
        """Close every cache that has ``close()``: a shared pool gets its blocks back."""
        if not self.options.close:
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

    @contextmanager
    def _recording(self) -> Iterator[None]:
        """Record this example's first failure in the run, and attach the program as a note."""
        try:
            yield
        except Exception as error:
            if not self._failed:
                self._failed = True
                stats = self.run.stats
                if stats.first_failing_example is None:
                    stats.first_failing_example = stats.num_examples
                self.run.failure = Failure(error, list(self.steps))
                add_note = getattr(error, "add_note", None)
                if callable(add_note):
                    program = self.options.render(self.steps, None)
                    add_note("The failing run as a program:\n" + program)
            raise
