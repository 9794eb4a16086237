"""A one-line progress bar on stderr, redrawn at most a few times a second.

Shown only when asked (``--progress``) or when stderr is a terminal; it never
writes to stdout, so ``--json`` output stays clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_seconds", "wants_progress"]


def format_seconds(seconds: float) -> str:
    """A duration for a person: ``"42 s"``, ``"3:05"`` (minutes), ``"1:02:03"`` (hours).

    >>> format_seconds(42.4), format_seconds(185), format_seconds(3723)
    ('42 s', '3:05', '1:02:03')
    """
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}:{secs:02d}"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """A text bar: ``label [#####.....] done/total unit  elapsed  ETA``.

    The ETA assumes the rest goes at the pace so far (elapsed x left / done);
    it is shown once something is done, and the final line shows the elapsed
    time alone.

    >>> import io
    >>> ticks = iter([0.0, 10.0])
    >>> stream = io.StringIO()
    >>> bar = Progress("paged", 1000, stream=stream, clock=lambda: next(ticks))
    >>> bar.update(250)
    >>> stream.getvalue().strip()
    'paged              [#######.......................] 250/1000 requests   10.0 s  ETA 30 s'

    Args:
        label: what is running (``"paged"``, or ``"policy 2 of 4: contiguous"``).
        total: the count that means done.
        unit: what is counted (``"requests"``).
        stream: where to draw; stderr by default.
        interval_s: least time between redraws.
        clock: seconds from an arbitrary start (``time.perf_counter``; tests pass their own).
    """

    WIDTH = 30

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "requests",
        stream: TextIO | None = None,
        interval_s: float = 0.2,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._last_draw = float("-inf")
        self._is_tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int, extra: str = "") -> None:
        """Redraw with ``done`` finished, unless the last redraw was too recent."""
        now = self._clock()
        if now - self._last_draw < self.interval_s:
            return
        self._last_draw = now
        self._draw(done, extra, now)

    def close(self, done: int, extra: str = "") -> None:
        """Draw the final state and end the line."""
        self._draw(done, extra, self._clock(), final=True)
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, done: int, extra: str, now: float, *, final: bool = False) -> None:
        filled = min(self.WIDTH, self.WIDTH * done // self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = now - self._start
        text = f"\r{self.label:<18} [{bar}] {done}/{self.total} {self.unit}  {elapsed:5.1f} s"
        if not final and 0 < done < self.total:
            text += f"  ETA {format_seconds(elapsed * (self.total - done) / done)}"
        clear = "\033[K" if self._is_tty else ""  # erase what a longer line left behind
        self.stream.write(text + (f"  {extra}" if extra else "") + clear)
        self.stream.flush()


def wants_progress(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``flag`` if given, else whether ``stream`` (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())
