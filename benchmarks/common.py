"""Measurement plumbing shared by the benchmark scripts: machine header, cache flush, medians.

Not part of the library. Every script pins BLAS to one thread with
``threadpoolctl.threadpool_limits(1)`` around its measurements, on both sides
of every ratio; pagedkv itself never touches thread settings.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from threadpoolctl import threadpool_info

import pagedkv

#: Bytes written before a "cold" call: twice the 32 MiB L3 of the machine the
#: tables were made on, so a call's keys and values start out of cache, as one
#: layer's cache does in a many-layer model by the time that layer runs again.
FLUSH_BYTES = 64 << 20


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with family and model numbers when given."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    name = fields.get("model name", platform.processor() or "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def cache_sizes() -> str:
    """L2 and L3 sizes from sysfs, e.g. ``L2 1024K, L3 32768K`` (empty when unknown)."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            with open(f"{base}/{entry}/level", encoding="utf-8") as level_file:
                level = level_file.read().strip()
            with open(f"{base}/{entry}/size", encoding="utf-8") as size_file:
                size = size_file.read().strip()
            if level in ("2", "3"):
                sizes.append(f"L{level} {size}")
    except OSError:
        return ""
    return ", ".join(sizes)


def blas_description() -> str:
    """Every BLAS threadpoolctl sees: library, version, kernel (architecture), threading layer."""
    found = []
    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        found.append(
            f"{info.get('internal_api')} {info.get('version')} ({info.get('prefix')}), "
            f"kernel {info.get('architecture', '?')}, threading {info.get('threading_layer', '?')}, "
            f"{info.get('num_threads')} threads by default"
        )
    return "; ".join(found) or "no BLAS found by threadpoolctl"


def header(title: str, parameters: Sequence[str]) -> str:
    """The lines every benchmark prints first: machine, versions, threads, parameters."""
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    lines = [
        f"# {title}",
        f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs"
        + (f", {cache_sizes()}" if cache_sizes() else ""),
        f"python {platform.python_version()}, numpy {np.__version__}, pagedkv {pagedkv.__version__}",
        f"BLAS: {blas_description()}",
        "OPENBLAS_CORETYPE: "
        + (coretype if coretype else "unset (OpenBLAS picked the kernel above from the CPU)"),
        "threads: BLAS pinned to 1 thread with threadpoolctl.threadpool_limits(1) for every "
        "measurement, on both sides of every ratio (the library never changes thread settings)",
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(shared machine: numbers are noisy; medians of repeated runs)",
        *parameters,
    ]
    return "\n".join(lines)


def footer() -> str:
    """The last line every benchmark prints: the load average when it ended."""
    return f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


class Flusher:
    """Evicts the CPU caches by writing ``FLUSH_BYTES`` (about 3 ms a call)."""

    def __init__(self) -> None:
        self._buffer = np.zeros(FLUSH_BYTES // 8, np.float64)

    def __call__(self) -> None:
        self._buffer += 1.0


def median_us(samples: Sequence[float]) -> float:
    """Median of timings given in seconds, in microseconds."""
    return statistics.median(samples) * 1e6


#: The clock every timing reads; see :func:`use_clock`.
_clock: Callable[[], float] = time.perf_counter
CLOCKS = {
    "wall": "wall clock (time.perf_counter)",
    "cpu": "this thread's CPU time (time.thread_time): time spent descheduled by other "
    "processes is left out, memory-bandwidth contention is not",
}


def use_clock(name: str) -> str:
    """Make every timing read the ``wall`` or the ``cpu`` clock; return its description."""
    global _clock
    _clock = time.thread_time if name == "cpu" else time.perf_counter
    return CLOCKS[name]


def now() -> float:
    """The chosen clock's current reading, in seconds."""
    return _clock()


def time_once(function: Callable[[], object]) -> float:
    """Seconds one call of ``function`` takes on the chosen clock."""
    start = _clock()
    function()
    return _clock() - start


def format_us(microseconds: float) -> str:
    """A time for a table: ``812 µs``, ``12.3 ms``."""
    if microseconds >= 10_000:
        return f"{microseconds / 1000:.1f} ms"
    if microseconds >= 1000:
        return f"{microseconds / 1000:.2f} ms"
    return f"{microseconds:.0f} µs" if microseconds >= 10 else f"{microseconds:.1f} µs"


def table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (pads columns so it also reads as plain text)."""
    widths = [max(len(str(row[i])) for row in [columns, *rows]) for i in range(len(columns))]
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), rule, *(line(row) for row in rows)])
