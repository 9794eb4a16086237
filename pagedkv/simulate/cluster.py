"""More than one replica: N paged engines, each with its own real manager, behind a router.

Owns :func:`run_cluster` and :class:`ClusterResult`: every replica advanced to each arrival,
its KV events drained into the router, the request routed, the router's own cost measured.
Counterpart: SGLang's router and llm-d's / Dynamo's KV-aware routing in front of vLLM
replicas. The loop and an example: docs/simulate.md, "A cluster of replicas".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.latency import Latency, summarize
from pagedkv.simulate.report import table
from pagedkv.simulate.result import PolicyResult
from pagedkv.simulate.router import make_router
from pagedkv.simulate.workload import Workload

__all__ = ["ClusterResult", "format_cluster", "run_cluster"]


@dataclass
class ClusterResult:
    """What a cluster of replicas measured under one router.

    Attributes:
        router: the router's name.
        replicas: each replica's own result (memory, preemptions, prefix hits).
        num_finished: requests finished over all replicas.
        prefix_hit_rate: prompt tokens found cached over all replicas.
        latency: what requests saw, over all replicas (model seconds).
        num_routed: requests routed to each replica.
        routing_us: wall-clock microseconds per routing decision (the
            router's own cost; event draining included; not deterministic).
        wall_s: wall-clock seconds of the whole run.
    """

    router: str
    replicas: list[PolicyResult]
    num_finished: int = 0
    prefix_hit_rate: float = 0.0
    latency: Latency = field(default_factory=Latency)
    num_routed: list[int] = field(default_factory=list)
    routing_us: float = field(default=0.0, compare=False)
    wall_s: float = field(default=0.0, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """Deterministic fields (wall-clock ones under ``"timing"``)."""
        return {
            "router": self.router,
            "num_replicas": len(self.replicas),
            "num_finished": self.num_finished,
            "prefix_hit_rate": round(self.prefix_hit_rate, 6),
            "num_routed": self.num_routed,
            "latency": {key: round(value, 6) for key, value in vars(self.latency).items()},
            "replicas": [replica.as_dict() for replica in self.replicas],
            "timing": {"routing_us": round(self.routing_us, 3), "wall_s": round(self.wall_s, 3)},
        }


def run_cluster(workload: Workload, config: SimConfig, num_replicas: int, router_name: str) -> ClusterResult:
    """Serve ``workload`` on ``num_replicas`` replicas of ``config`` behind router ``router_name``.

    Raises:
        ConfigError: fewer than one replica, an unknown router, or the
            prefix-aware router without prefix caching on the replicas.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    router = make_router(router_name, config.block_size)
    if router.wants_events and not config.enable_prefix_caching:
        raise ConfigError(f"the {router_name} router needs prefix caching on the replicas")
    start = time.perf_counter()
    engines = [PagedEngine(workload, config, kv_events=router.wants_events) for _ in range(num_replicas)]
    for engine in engines:
        engine.begin()
    num_routed = [0] * num_replicas
    routing_s = 0.0
    for request in workload.requests:
        arrival_s = request.arrival_s if request.arrival_s is not None else 0.0
        for engine in engines:
            engine.advance_until(arrival_s)
        began = time.perf_counter()
        if router.wants_events:
            for index, engine in enumerate(engines):
                router.observe(index, engine.manager.drain_kv_events())
        loads = [engine.num_requests_in_flight for engine in engines]
        index = router.choose(workload.prompt_tokens(request), loads)
        routing_s += time.perf_counter() - began
        engines[index].submit(request)
        num_routed[index] += 1
    for engine in engines:
        while engine.has_work:
            engine.run_step()
    results = [engine.end() for engine in engines]
    records = [record for engine in engines for record in engine.clock.records]
    num_generated = sum(result.num_generated_tokens for result in results)
    num_queries = sum(result.num_prefix_query_tokens for result in results)
    return ClusterResult(
        router=router_name,
        replicas=results,
        num_finished=sum(result.num_finished for result in results),
        prefix_hit_rate=sum(r.num_prefix_hit_tokens for r in results) / num_queries if num_queries else 0.0,
        latency=summarize(records, num_generated_tokens=num_generated),
        num_routed=num_routed,
        routing_us=1e6 * routing_s / max(1, len(workload.requests)),
        wall_s=time.perf_counter() - start,
    )


def format_cluster(results: list[ClusterResult]) -> str:
    """One row per router (``all``), then one per replica under it."""
    headers = [
        "router", "replica", "routed", "live mean", "live peak", "prefix hit", "preempt",
        "norm s/tok", "p99", "TTFT s", "tok/s", "route us",
    ]  # fmt: skip
    rows = []
    for result in results:
        latency = result.latency
        num_preemptions = sum(replica.num_preemptions for replica in result.replicas)
        rows.append(
            [
                result.router, "all", f"{sum(result.num_routed):,}", "", "",
                f"{100 * result.prefix_hit_rate:.1f}%", f"{num_preemptions:,}",
                f"{latency.normalised_mean:.3f}", f"{latency.normalised_p99:.3f}",
                f"{latency.ttft_mean:.2f}", f"{latency.tokens_per_s:,.0f}", f"{result.routing_us:.1f}",
            ]
        )  # fmt: skip
        for index, replica in enumerate(result.replicas):
            own = replica.latency
            rows.append(
                [
                    "", str(index), f"{result.num_routed[index]:,}", f"{100 * replica.occupancy_mean:.1f}%",
                    f"{100 * replica.occupancy_peak:.1f}%", f"{100 * replica.prefix_hit_rate:.1f}%",
                    f"{replica.num_preemptions:,}", f"{own.normalised_mean:.3f}", f"{own.normalised_p99:.3f}",
                    f"{own.ttft_mean:.2f}", f"{own.tokens_per_s:,.0f}", "",
                ]
            )  # fmt: skip
    return table(headers, rows)
