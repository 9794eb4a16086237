"""Both sides of the block-size trade-off in one table: the sweep's memory rows beside the measured kernel.

Owns :class:`KernelRow` and its table: each sweep row beside the measured kernel point, and
the what-if step time if attention ran at the measured ratio. Models the PagedAttention
paper's block-size study (§7.2). The formula, and why it is a what-if, not a prediction:
docs/simulate.md, "The kernel side of the block-size sweep".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.simulate.kernel import KernelCost, KernelPoint
from pagedkv.simulate.report import SweepRow, format_sweep

__all__ = ["KernelRow", "format_kernel_side", "kernel_columns", "kernel_rows", "sweep_as_dicts"]


@dataclass(frozen=True, slots=True)
class KernelRow:
    """The kernel side at one paged point of a sweep.

    Attributes:
        block_size: token slots per block.
        max_size: the point's window (None: none).
        point: the kernel measured at this block size (None: not measured).
        attention_share: of the paged run's busy model time, the share spent
            reading KV in memory-bound steps (0 when nothing was busy).
    """

    block_size: int
    max_size: int | None
    point: KernelPoint | None
    attention_share: float

    def step_factors(self) -> tuple[float, float] | None:
        """Step time / with a contiguous kernel, at gather's and views' ratios (None: unmeasured)."""
        if self.point is None:
            return None
        share = self.attention_share
        return (1 - share + share * self.point.gather_ratio, 1 - share + share * self.point.view_ratio)

    def as_dict(self) -> dict[str, Any]:
        """The measured times, ratios, attention share and step-time what-ifs (None where unmeasured)."""
        factors = self.step_factors()
        return {
            "measured": self.point is not None,
            **(self.point.as_dict() if self.point is not None else dict.fromkeys(
                ("gather_ms", "view_ms", "contiguous_ms", "gather_vs_contiguous", "view_vs_contiguous")
            )),
            "attention_share": round(self.attention_share, 6),
            "step_time_if_gather": None if factors is None else round(factors[0], 6),
            "step_time_if_views": None if factors is None else round(factors[1], 6),
        }  # fmt: skip


def kernel_rows(rows: Sequence[SweepRow], cost: KernelCost) -> list[KernelRow]:
    """One :class:`KernelRow` per paged row of a sweep (baseline rows have no block size).

    >>> from pagedkv.simulate import Budget, SimConfig, sweep, synthetic
    >>> from pagedkv.simulate.kernel import load_kernel_cost
    >>> rows = sweep(synthetic("alpaca", 8, seed=0), SimConfig(Budget(256), block_size=8), [8, 3])
    >>> [(row.block_size, row.point is not None) for row in kernel_rows(rows, load_kernel_cost())]
    [(8, True), (3, False)]
    """
    out = []
    for row in rows:
        if not row.block_size:
            continue
        result = row.result
        share = result.attention_s / result.busy_s if result.busy_s > 0 else 0.0
        out.append(KernelRow(row.block_size, row.max_size, cost.at(row.block_size), share))
    return out


def sweep_as_dicts(rows: Sequence[SweepRow], cost: KernelCost | None) -> list[dict[str, Any]]:
    """The sweep's rows as JSON-ready dicts; with ``cost``, each paged row gains ``"kernel"``."""
    if cost is None:
        return [row.as_dict() for row in rows]
    kernel = iter(kernel_rows(rows, cost))
    return [row.as_dict() | ({"kernel": next(kernel).as_dict()} if row.block_size else {}) for row in rows]


def kernel_columns(rows: Sequence[SweepRow], cost: KernelCost) -> tuple[list[str], list[list[str]]]:
    """The kernel side as extra columns of :func:`~pagedkv.simulate.report.format_sweep`, one per row."""
    headers = ["gather ms", "views ms", "contig ms", "KV-read share", "step if gather", "if views"]
    kernel = iter(kernel_rows(rows, cost))
    cells = []
    for row in rows:
        if not row.block_size:  # the contiguous baseline: no pages, no kernel ratio
            cells.append(["-"] * len(headers))
            continue
        krow = next(kernel)
        share = f"{100 * krow.attention_share:.1f}%"
        point, factors = krow.point, krow.step_factors()
        if point is None or factors is None:
            cells.append(["-", "-", "-", share, "-", "-"])
            continue
        cells.append(
            [
                f"{point.gather_ms:.2f} ({point.gather_ratio:.2f}x)",
                f"{point.view_ms:.2f} ({point.view_ratio:.2f}x)",
                f"{point.contiguous_ms:.2f}",
                share,
                f"{factors[0]:.3f}x",
                f"{factors[1]:.3f}x",
            ]
        )
    return headers, cells


def format_kernel_side(rows: Sequence[SweepRow], cost: KernelCost) -> str:
    """The sweep's table with the kernel side as its last columns, and what they mean."""
    lines = [
        format_sweep(rows, kernel_columns(rows, cost)),
        "",
        f"kernel side (the last six columns), measured on {cost.machine}",
        f"  from {cost.source}: ms per attention call at each block size, and its ratio to the contiguous",
        "  kernel timed in turns with it. KV-read share: of the paged run's busy model time, what its",
        "  memory-bound steps spend reading KV (cost model). step if ...: that time with the KV read",
        "  stretched by the measured ratio, against a contiguous kernel: a what-if with this CPU's",
        "  ratios, not the modeled accelerator's. '-': not measured (none guessed).",
    ]
    return "\n".join(lines)
