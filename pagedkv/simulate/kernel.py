"""The kernel side of the block-size trade-off: measured attention time per block size, loaded and checked.

Owns :class:`KernelCost` and its JSON file, written by ``benchmarks/bench_views.py`` and read
by ``pagedkv simulate --sweep --kernel-cost PATH`` (default: the checkout's
``benchmarks/results/kernel_block_size.json``, else the package-data copy). Models the
PagedAttention paper's kernel microbenchmark (§7.1, Figure 18). The file format and an
example: docs/simulate.md, "The kernel side of the block-size sweep".
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError

__all__ = [
    "KERNEL_COST_FILE",
    "KernelCost",
    "KernelCostError",
    "KernelPoint",
    "default_kernel_cost_path",
    "load_kernel_cost",
    "parse_kernel_cost",
]

#: The file's name, in ``benchmarks/results/`` and in ``pagedkv/simulate/data/``.
KERNEL_COST_FILE = "kernel_block_size.json"
#: The per-method timing fields, in the order reports show them.
METHOD_FIELDS = ("gather_ms", "view_ms", "contiguous_ms")


class KernelCostError(ConfigError):
    """A kernel-cost file that is missing, not JSON, or not of the schema (the message names the field)."""


@dataclass(frozen=True, slots=True)
class KernelPoint:
    """Measured milliseconds per attention call at one block size.

    Attributes:
        block_size: token slots per block.
        gather_ms: gathering the pages into scratch, then attending.
        view_ms: attending through a mapped view of the pages.
        contiguous_ms: the best kernel on one contiguous array (no paging),
            timed in turns with the other two.
    """

    block_size: int
    gather_ms: float
    view_ms: float
    contiguous_ms: float

    @property
    def gather_ratio(self) -> float:
        """``gather_ms / contiguous_ms``: what gathering costs against no paging."""
        return self.gather_ms / self.contiguous_ms

    @property
    def view_ratio(self) -> float:
        """``view_ms / contiguous_ms``: what mapped views cost against no paging."""
        return self.view_ms / self.contiguous_ms

    def as_dict(self) -> dict[str, float]:
        """The times and the ratios to contiguous, as plain values."""
        return {
            "gather_ms": self.gather_ms,
            "view_ms": self.view_ms,
            "contiguous_ms": self.contiguous_ms,
            "gather_vs_contiguous": round(self.gather_ratio, 4),
            "view_vs_contiguous": round(self.view_ratio, 4),
        }


@dataclass(frozen=True, slots=True)
class KernelCost:
    """A measured block-size sweep of the attention kernel (the schema in the module docstring).

    Attributes:
        points: one :class:`KernelPoint` per block size, in increasing block size.
        machine: where it was measured.
        source: the file it came from (or a label).

    Invariants:
        * at least one point; block sizes are ints >= 1, strictly increasing;
        * every time is a finite number > 0.
    """

    points: tuple[KernelPoint, ...]
    machine: str
    source: str

    def __post_init__(self) -> None:
        self.check_invariants()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a point is out of order or a time is not a positive number."""
        if not self.points:
            raise AssertionError("a kernel cost without points")
        sizes = [point.block_size for point in self.points]
        if any(later <= earlier for earlier, later in itertools.pairwise(sizes)) or sizes[0] < 1:
            raise AssertionError(f"block sizes not increasing from 1: {sizes}")
        for point in self.points:
            for value in (point.gather_ms, point.view_ms, point.contiguous_ms):
                if not (math.isfinite(value) and value > 0):
                    raise AssertionError(f"block size {point.block_size}: time {value!r} is not > 0")

    @property
    def block_sizes(self) -> list[int]:
        """The block sizes measured."""
        return [point.block_size for point in self.points]

    def at(self, block_size: int) -> KernelPoint | None:
        """The point measured at ``block_size``, or None (no interpolation: unmeasured is unknown)."""
        return next((point for point in self.points if point.block_size == block_size), None)

    def describe(self) -> dict[str, Any]:
        """Where and what was measured, as plain values (for reports)."""
        return {"source": self.source, "machine": self.machine, "block_sizes": self.block_sizes}


def _field(data: dict[str, Any], name: str, source: str) -> Any:
    if name not in data:
        raise KernelCostError(f"{source}: field {name!r} is missing (schema: pagedkv.simulate.kernel)")
    return data[name]


def _is_entry(item: Any, *, integer: bool) -> bool:
    """An int >= 1 (``integer``) or a finite number > 0; never a bool."""
    if isinstance(item, bool) or not isinstance(item, int if integer else (int, float)):
        return False
    if integer:
        return bool(item >= 1)
    try:
        return math.isfinite(float(item)) and item > 0
    except OverflowError:  # an int too large for a float
        return False


def _number_list(value: Any, name: str, source: str, *, integer: bool) -> list[Any]:
    what = "ints >= 1" if integer else "numbers > 0 (milliseconds)"
    if not isinstance(value, list) or not value:
        raise KernelCostError(f"{source}: field {name!r} must be a non-empty list of {what}, got {value!r}")
    for index, item in enumerate(value):
        if not _is_entry(item, integer=integer):
            raise KernelCostError(f"{source}: field {name!r}[{index}] is {item!r}; expected {what}")
    return value


def parse_kernel_cost(data: Any, *, source: str) -> KernelCost:
    """Check ``data`` (decoded JSON) against the schema and build a :class:`KernelCost`.

    Args:
        data: the decoded JSON object.
        source: where it came from, for messages.

    Raises:
        KernelCostError: not an object, a field missing or of the wrong type,
            lists of different lengths, block sizes not increasing.

    >>> try:
    ...     parse_kernel_cost({"block_size": [16]}, source="x.json")
    ... except KernelCostError as error:
    ...     print(error)
    x.json: field 'gather_ms' is missing (schema: pagedkv.simulate.kernel)
    """
    if not isinstance(data, dict):
        raise KernelCostError(f"{source}: expected a JSON object, got {type(data).__name__}")
    sizes = _number_list(_field(data, "block_size", source), "block_size", source, integer=True)
    times = {}
    for name in METHOD_FIELDS:
        times[name] = _number_list(_field(data, name, source), name, source, integer=False)
        if len(times[name]) != len(sizes):
            raise KernelCostError(
                f"{source}: field {name!r} has {len(times[name])} entries; expected one per block size "
                f"({len(sizes)})"
            )
    for index in range(1, len(sizes)):
        if sizes[index] <= sizes[index - 1]:
            raise KernelCostError(
                f"{source}: field 'block_size' must increase; {sizes[index]} follows {sizes[index - 1]}"
            )
    machine = _field(data, "machine", source)
    if not isinstance(machine, str) or not machine.strip():
        raise KernelCostError(f"{source}: field 'machine' must be a non-empty string, got {machine!r}")
    points = tuple(
        KernelPoint(size, float(gather), float(view), float(contiguous))
        for size, gather, view, contiguous in zip(sizes, *(times[name] for name in METHOD_FIELDS))
    )
    return KernelCost(points, machine.strip(), source)


def default_kernel_cost_path() -> Path:
    """The checkout's measured file when there is one, else the copy shipped with the package.

    >>> default_kernel_cost_path().name
    'kernel_block_size.json'
    """
    root = Path(__file__).resolve().parents[2]
    checkout = root / "benchmarks" / "results" / KERNEL_COST_FILE
    if (root / "pyproject.toml").is_file() and checkout.is_file():
        return checkout
    return Path(__file__).resolve().parent / "data" / KERNEL_COST_FILE


def load_kernel_cost(path: str | Path | None = None) -> KernelCost:
    """Read and check a kernel-cost file (``None``: :func:`default_kernel_cost_path`).

    Nothing is half-loaded: the file is read whole, checked whole, and only
    then turned into a :class:`KernelCost`.

    Raises:
        KernelCostError: the file is missing or unreadable, not JSON, or not of the schema.

    >>> load_kernel_cost().at(16).block_size
    16
    """
    file = Path(path) if path is not None else default_kernel_cost_path()
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise KernelCostError(f"cannot read the kernel-cost file {source!r}: {reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise KernelCostError(
            f"{source}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from None
    return parse_kernel_cost(data, source=source)
