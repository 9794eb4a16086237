"""A continuous-batching serving simulator that drives the real :class:`~pagedkv.KVCacheManager`.

See ``docs/tutorial.md`` for a guided study and ``pagedkv simulate --help``.

>>> from pagedkv.simulate import Budget, SimConfig, simulate, synthetic
>>> report = simulate(synthetic("alpaca", 10, seed=0), SimConfig(Budget(256), block_size=8))
>>> report.results["paged"].num_finished
10
"""

from pagedkv.simulate.baseline import ContiguousEngine, FirstFit
from pagedkv.simulate.config import Budget, BudgetError, ModelShape, SimConfig, parse_bytes
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.report import (
    POLICIES,
    Report,
    SweepRow,
    format_report,
    format_sweep,
    run_policy,
    simulate,
    sweep,
)
from pagedkv.simulate.result import PolicyResult, Series
from pagedkv.simulate.workload import (
    DATASETS,
    Request,
    Workload,
    WorkloadError,
    load_jsonl,
    parse_jsonl,
    synthetic,
)

__all__ = [
    "DATASETS",
    "POLICIES",
    "Budget",
    "BudgetError",
    "ContiguousEngine",
    "FirstFit",
    "ModelShape",
    "PagedEngine",
    "PolicyResult",
    "Report",
    "Request",
    "Series",
    "SimConfig",
    "SweepRow",
    "Workload",
    "WorkloadError",
    "format_report",
    "format_sweep",
    "load_jsonl",
    "parse_bytes",
    "parse_jsonl",
    "run_policy",
    "simulate",
    "sweep",
    "synthetic",
]
