"""The calls a state-machine run made, and how to print them as a runnable Python program.

Running a step is defined once, here (:func:`open_step`, :func:`attend_step`): the machine,
:func:`replay` and the shrinker all go through it. :func:`render_program` turns a shrunk run
into a standalone script, no Hypothesis needed, whose last line raises the same error;
:func:`replay_alone` runs it in a new Python process, to learn whether it fails on its own or
only after earlier runs left state behind (a class attribute, a module global). Naming the
factory: :mod:`~pagedkv.testing.factory_code`; shrinking: :mod:`~pagedkv.testing.shrink`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv.testing.contract import CheckedCache, ContractError, Precision
from pagedkv.testing.factory_code import FactoryCode

__all__ = [
    "AloneRun",
    "AttendStep",
    "CloseStep",
    "Feed",
    "OpenStep",
    "Step",
    "attend_step",
    "feed_value",
    "open_step",
    "render_program",
    "replay",
    "replay_alone",
]

#: How tokens reach the cache: nested Python lists (the seed), or numpy arrays.
Feed = Literal["lists", "arrays"]


# --------------------------------------------------------------------- steps


@dataclass
class OpenStep:
    """``name = factory(max_size=max_size)``.

    Args:
        name: the cache's variable name.
        max_size: the window it was built with.
    """

    name: str
    max_size: int | None


@dataclass
class AttendStep:
    """``name.attend(q, k, v)``, with the oracle's output when it was computed.

    Args:
        name: the cache's variable name.
        q: the query, as nested lists of floats.
        k: the key.
        v: the value.
        expected: the oracle's output (``None`` until computed).
    """

    name: str
    q: Any
    k: Any
    v: Any
    expected: Any = None


@dataclass
class CloseStep:
    """``name.cache.close()`` (the machine closes every cache at the end of a run).

    Args:
        name: the cache's variable name.
    """

    name: str


Step = OpenStep | AttendStep | CloseStep


def _comment(text: str) -> list[str]:
    return [f"#   {line}".rstrip() for line in text.splitlines()] or ["#"]


def render_program(
    steps: Sequence[Step],
    *,
    factory: FactoryCode | None,
    label: str = "",
    feed: Feed = "lists",
    precision: Precision = "float64",
    scale: float = 1.0,
    failure: str | None = None,
) -> str:
    """The steps as a standalone Python program whose last line fails as the run did.

    Args:
        steps: the recorded steps, in order.
        factory: code naming the factory; ``None`` writes a placeholder to fill in.
        label: how to name the factory in the header comment.
        feed: ``"arrays"`` passes numpy arrays, as the machine did.
        precision: the precision given to :class:`CheckedCache` (and the arrays' dtype).
        scale: the score scale given to :class:`CheckedCache`.
        failure: the error message, quoted in the header.

    Returns:
        The program's source, ending in a newline.

    Example:
        >>> code = FactoryCode.from_spec("pagedkv.testing.buggy:EvictsAfterScoring")
        >>> steps = [OpenStep("cache_0", 1), AttendStep("cache_0", [0.0], [0.0], [1.0], [1.0])]
        >>> print(render_program(steps, factory=code, failure="..."))  # doctest: +ELLIPSIS
        # The shrunk failing program found by pagedkv's conformance state machine.
        ...
        from pagedkv.testing.buggy import EvictsAfterScoring
        from pagedkv.testing.contract import CheckedCache
        <BLANKLINE>
        cache_0 = CheckedCache(EvictsAfterScoring(max_size=1), max_size=1, name='cache_0')
        cache_0.attend([0.0], [0.0], [1.0])  # oracle: [1.0]  <- fails here
        <BLANKLINE>
    """
    lines = ["# The shrunk failing program found by pagedkv's conformance state machine."]
    if label:
        lines.append(f"# Cache factory: {label}")
    lines.append("# Run it with python: it replays the calls, checks each output against the")
    lines.append("# oracle, and its last line raises" + (":" if failure else "."))
    if failure:
        lines += _comment(failure)
    lines.append("")
    if feed == "arrays":
        lines.append("import numpy as np")
    imports = ["from pagedkv.testing.contract import CheckedCache"]
    if factory is not None:
        imports += [line for line in factory.imports if line not in imports]
    lines += sorted(imports, key=lambda line: (not line.startswith("import"), line))
    lines.append("")
    if factory is None:
        name = "factory"
        lines.append("factory = ...  # could not name the factory (a lambda?): write it here")
    elif factory.expression.isidentifier():
        name = factory.expression
    else:
        name = "factory"
        lines.append(f"factory = {factory.expression}")
    extra = "" if scale == 1.0 else f", scale={scale!r}"
    extra += "" if precision == "float64" else f", precision={precision!r}"
    dtype = "" if precision == "float64" else ", dtype=np.float32"

    def fed(x: Any) -> str:
        return f"np.array({x!r}{dtype})" if feed == "arrays" else repr(x)

    for index, step in enumerate(steps):
        if isinstance(step, OpenStep):
            size = step.max_size
            call = f"{name}(max_size={size})"
            line = f"{step.name} = CheckedCache({call}, max_size={size}{extra}, name={step.name!r})"
        elif isinstance(step, AttendStep):
            line = f"{step.name}.attend({fed(step.q)}, {fed(step.k)}, {fed(step.v)})"
            if step.expected is not None:
                expected = repr(step.expected)
                line += f"  # oracle: {expected if len(expected) <= 80 else expected[:77] + '...'}"
        else:
            line = f"{step.name}.cache.close()"
        if index == len(steps) - 1 and failure:
            line += "  <- fails here" if "  # " in line else "  # <- fails here"
        lines.append(line)
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------- running steps


def feed_value(x: Any, feed: Feed, precision: Precision) -> Any:
    """A token as the machine passes it: the nested list itself, or a numpy array of it.

    Args:
        x: nested lists of floats.
        feed: ``"lists"`` or ``"arrays"``.
        precision: the arrays' dtype.

    Returns:
        ``x``, or a new array.
    """
    if feed == "lists":
        return x
    import numpy as np  # only the arrays feed needs it

    return np.array(x, dtype=np.float64 if precision == "float64" else np.float32)


def open_step(
    step: OpenStep, factory: Callable[..., Any], *, scale: float = 1.0, precision: Precision = "float64"
) -> CheckedCache:
    """Build the cache ``step`` names with ``factory(max_size=step.max_size)``, checked.

    Args:
        step: the step.
        factory: the cache factory.
        scale: the cache's score scale.
        precision: the cache's precision.

    Returns:
        The new cache inside a :class:`CheckedCache` named ``step.name``.

    Raises:
        ContractError: the factory raised (kind ``"factory"``), or the new
            cache's ``len`` or invariants are wrong.
    """
    try:
        cache = factory(max_size=step.max_size)
    except Exception as error:
        raise ContractError(
            f"factory(max_size={step.max_size}) raised {type(error).__name__}: {error}",
            kind="factory",
        ) from error
    return CheckedCache(
        cache, max_size=step.max_size, scale=scale, precision=precision, name=step.name
    )


def attend_step(
    step: AttendStep, checked: CheckedCache, *, feed: Feed = "lists", precision: Precision = "float64"
) -> Any:
    """Attend ``step``'s token on ``checked``, and keep the oracle's output in ``step.expected``.

    Args:
        step: the step; ``step.expected`` is set even when the check fails.
        checked: the cache the step names.
        feed: how tokens are passed.
        precision: the arrays' dtype, for the arrays feed.

    Returns:
        The cache's output.

    Raises:
        ContractError: the output, ``len`` or invariants break the contract.
    """
    try:
        return checked.attend(*(feed_value(x, feed, precision) for x in (step.q, step.k, step.v)))
    finally:
        step.expected = checked.last_expected


def replay(
    steps: Sequence[Step],
    factory: Callable[..., Any],
    *,
    feed: Feed = "lists",
    precision: Precision = "float64",
    scale: float = 1.0,
    close: bool = True,
) -> ContractError | None:
    """Run ``steps`` again, as the reproducer would, and return the error it raises (if any).

    Every cache still open at the end is closed (when ``close``), errors
    suppressed, so a shared pool gets its blocks back.

    Args:
        steps: the program.
        factory: the cache factory.
        feed: how tokens are passed.
        precision: the caches' precision.
        scale: the caches' score scale.
        close: close the caches left open.

    Returns:
        The :class:`ContractError` the program raised, or ``None`` if it ran clean.
    """
    caches: dict[str, CheckedCache] = {}
    try:
        for step in steps:
            if isinstance(step, OpenStep):
                caches[step.name] = open_step(step, factory, scale=scale, precision=precision)
            elif isinstance(step, AttendStep):
                attend_step(step, caches[step.name], feed=feed, precision=precision)
            else:
                caches.pop(step.name).cache.close()
    except ContractError as error:
        return error
    except Exception as error:  # close() failing, or a bad program
        name = type(error).__name__
        return ContractError(f"{name}: {error}", kind=f"raised {name}")
    finally:
        if close:
            for checked in caches.values():
                closer = getattr(checked.cache, "close", None)
                if callable(closer):
                    with suppress(Exception):
                        closer()
    return None


# ------------------------------------------------------ replaying a program alone

#: Seconds a printed program may run in its new process before the replay gives up.
ALONE_TIMEOUT_S = 60.0

# Runs the program from stdin; a ContractError exits 3 with its kind on stdout, so
# "failed the same way" is told apart from a program that cannot even start.
_ALONE_RUNNER = """\
import sys
from pagedkv.testing.contract import ContractError
source = sys.stdin.read()
try:
    exec(compile(source, "<the failing program>", "exec"), {"__name__": "__main__"})
except ContractError as error:
    sys.stdout.write(error.kind)
    sys.exit(3)
"""


@dataclass(frozen=True)
class AloneRun:
    """What a printed program did when run alone in a new Python process.

    Args:
        outcome: ``"failed"`` (raised :class:`ContractError`), ``"passed"`` (ran
            clean) or ``"not run"`` (could not start or finish: an import failed,
            another error, a timeout).
        kind: the :class:`ContractError`'s kind when it failed.
        detail: why it could not run (the last line of its error), else ``""``.
    """

    outcome: Literal["failed", "passed", "not run"]
    kind: str | None = None
    detail: str = ""


def replay_alone(source: str, *, timeout_s: float = ALONE_TIMEOUT_S) -> AloneRun:
    """Run a program from :func:`render_program` in a new Python process, nothing shared.

    NOTE: replays in this process see whatever the cache left in its class or
    module during the run (a class attribute shared by all instances), so a
    program can fail here and not in the reader's hands. A new process has no
    such state; it gets this process's ``sys.path`` and working directory, so
    the factory imports as it did here.

    Args:
        source: the program.
        timeout_s: give up after this many seconds.

    Returns:
        The :class:`AloneRun`.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    try:
        result = subprocess.run(
            [sys.executable, "-c", _ALONE_RUNNER],
            input=source, capture_output=True, text=True, timeout=timeout_s, env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return AloneRun("not run", detail=f"{type(error).__name__}: {error}")
    if result.returncode == 3:
        return AloneRun("failed", kind=result.stdout.strip())
    if result.returncode == 0:
        return AloneRun("passed")
    lines = result.stderr.strip().splitlines()
    return AloneRun("not run", detail=lines[-1] if lines else f"exit status {result.returncode}")
