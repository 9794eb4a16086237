"""Argparse types of the ``pagedkv`` command line: a bad value exits 2 with "expected ..., got ...".

Shared by every subcommand (``demo``, ``simulate``, ``viz``, ``check``); only the standard library.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "finite_float",
    "fraction",
    "int_range",
    "non_negative_float",
    "non_negative_int",
    "output_file",
    "output_folder",
    "positive_float",
    "positive_int",
]


def int_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None).

    >>> int_range(1, 10)("3")
    3
    """
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    expected = kind if maximum is None else f"{kind} up to {maximum:,}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also ints of more than 4,300 digits
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)


def _float(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """An argparse type: any finite number (not nan, inf or -inf)."""
    return _float(text, "a finite number")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _float(text, "a finite number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _float(text, "a finite number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in ``[0, 1)``."""
    value = _float(text, "a number in [0, 1)")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def output_file(text: str) -> str:
    """An argparse type: a file that can be written in an existing folder (not created here)."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file to write, got {text!r}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {str(path.parent)!r}")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def output_folder(text: str) -> str:
    """An argparse type: a folder that exists or can be made, and can be written (not created here)."""
    path = Path(text)
    if not text or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write into {text!r}: {str(ancestor)!r} is not a folder we may write"
        )
    return text
