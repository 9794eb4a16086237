"""A continuous-batching serving simulator that drives the real :class:`~pagedkv.KVCacheManager`.

See ``docs/tutorial.md`` (memory) and ``docs/study.md`` (time, latency,
schedulers, replicas) for guided studies, and ``pagedkv simulate --help``.

>>> from pagedkv.simulate import Budget, SimConfig, simulate, synthetic
>>> report = simulate(synthetic("alpaca", 10, seed=0), SimConfig(Budget(256), block_size=8))
>>> report.results["paged"].num_finished
10
"""

from pagedkv.simulate.baseline import ContiguousEngine, FirstFit
from pagedkv.simulate.cluster import ClusterResult, run_cluster
from pagedkv.simulate.config import Budget, BudgetError, ModelShape, SimConfig, parse_bytes
from pagedkv.simulate.conversations import conversations
from pagedkv.simulate.cost import COST_PRESETS, CostModel
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.latency import Latency
from pagedkv.simulate.pagemap import PageMap, capture_page_maps, page_map_text
from pagedkv.simulate.ratesweep import RatePoint, rate_sweep
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
from pagedkv.simulate.scheduler import SCHEDULERS, with_scheduler
from pagedkv.simulate.synthetic import DATASETS, synthetic
from pagedkv.simulate.workload import Request, Workload, WorkloadError, load_jsonl, parse_jsonl

__all__ = [
    "COST_PRESETS",
    "DATASETS",
    "POLICIES",
    "SCHEDULERS",
    "Budget",
    "BudgetError",
    "ClusterResult",
    "ContiguousEngine",
    "CostModel",
    "FirstFit",
    "Latency",
    "ModelShape",
    "PageMap",
    "PagedEngine",
    "PolicyResult",
    "RatePoint",
    "Report",
    "Request",
    "Series",
    "SimConfig",
    "SweepRow",
    "Workload",
    "WorkloadError",
    "capture_page_maps",
    "conversations",
    "format_report",
    "format_sweep",
    "load_jsonl",
    "page_map_text",
    "parse_bytes",
    "parse_jsonl",
    "rate_sweep",
    "run_cluster",
    "run_policy",
    "simulate",
    "sweep",
    "synthetic",
    "with_scheduler",
]
