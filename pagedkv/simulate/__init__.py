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
from pagedkv.simulate.pagemap import PageMap, capture_page_maps, page_map_text
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
from pagedkv.simulate.synthetic import DATASETS, synthetic
from pagedkv.simulate.workload import Request, Workload, WorkloadError, load_jsonl, parse_jsonl

__all__ = [
    "DATASETS",
    "POLICIES",
    "Budget",
    "BudgetError",
    "ContiguousEngine",
    "FirstFit",
    "ModelShape",
    "PageMap",
    "PagedEngine",
    "PolicyResult",
    "Report",
    "Request",
    "Series",
    "SimConfig",
    "SweepRow",
    "Workload",
    "WorkloadError",
    "capture_page_maps",
    "format_report",
    "format_sweep",
    "load_jsonl",
    "page_map_text",
    "parse_bytes",
    "parse_jsonl",
    "run_policy",
    "simulate",
    "sweep",
    "synthetic",
]
