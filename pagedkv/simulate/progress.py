"""A one-line progress bar on stderr, redrawn at most a few times a second.

Shown only when asked (``--progress``) or when stderr is a terminal; it never
writes to stdout, so ``--json`` output stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A text bar: ``label [#####.....] done/total unit  elapsed``.

    Args:
        label: what is running (``"paged"``).
        total: the count that means done.
        unit: what is counted (``"requests"``).
        stream: where to draw; stderr by default.
        interval_s: least time between redraws.
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
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._is_tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int, extra: str = "") -> None:
        """Redraw with ``done`` finished, unless the last redraw was too recent."""
        now = time.perf_counter()
        if now - self._last_draw < self.interval_s:
            return
        self._last_draw = now
        self._draw(done, extra, now)

    def close(self, done: int, extra: str = "") -> None:
        """Draw the final state and end the line."""
        self._draw(done, extra, time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, done: int, extra: str, now: float) -> None:
        filled = min(self.WIDTH, self.WIDTH * done // self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = f"\r{self.label:<18} [{bar}] {done}/{self.total} {self.unit}  {now - self._start:5.1f} s"
        clear = "\033[K" if self._is_tty else ""  # erase what a longer line left behind
        self.stream.write(text + (f"  {extra}" if extra else "") + clear)
        self.stream.flush()


def wants_progress(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``flag`` if given, else whether ``stream`` (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())
