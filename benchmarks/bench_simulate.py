"""How fast ``pagedkv simulate`` runs, and where the time goes. Prints; asserts nothing.

    python benchmarks/bench_simulate.py              # 10,000 ShareGPT-like requests
    python benchmarks/bench_simulate.py --num-requests 2000
    python benchmarks/bench_simulate.py --study      # also the serving study's targets (minutes)

Part 1 runs the default command's work (paged and contiguous, OPT-13B, 12 GiB,
block size 16) and prints wall-clock and CPU seconds (CPU seconds are what
this process got; on a shared machine wall time can be several times more).
Part 2 runs the paged policy again with the manager's ``reserve`` and
``write`` wrapped in timers, to split the CPU time between the manager and
the simulator's own loop. With ``--study``, part 3 times the rate sweep of
the tutorial (paged and three reservation baselines, 10 rates, 2,000
requests each; target under 2 minutes) and part 4 runs every scheduler on
the 10,000 requests (target under a minute each) and prints what each did.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

from pagedkv.manager.manager import KVCacheManager
from pagedkv.simulate import Budget, ModelShape, SimConfig, parse_bytes, run_policy, synthetic
from pagedkv.simulate.ratesweep import DEFAULT_RATES, rate_sweep
from pagedkv.simulate.scheduler import SCHEDULERS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--split-requests", type=int, default=2_000, help="requests for part 2")
    parser.add_argument("--study", action="store_true", help="parts 3 and 4: the serving study's targets")
    args = parser.parse_args()
    config = SimConfig(Budget.from_bytes(parse_bytes("12GiB"), ModelShape()), block_size=16)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(
        f"workload: {args.num_requests:,} ShareGPT-like requests; OPT-13B, 12 GiB = "
        f"{config.num_blocks} blocks of 16\n"
    )
    workload = synthetic("sharegpt", args.num_requests, seed=0)
    header = f"{'policy':<12} {'wall s':>8} {'cpu s':>8} {'steps':>9} {'sim tokens':>11}"
    print(f"{header} {'tokens/s (wall)':>16}")
    total_wall = 0.0
    for policy in ("paged", "contiguous"):
        wall, cpu = time.perf_counter(), time.process_time()
        result = run_policy(policy, workload, config)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        total_wall += wall
        print(
            f"{policy:<12} {wall:8.2f} {cpu:8.2f} {result.num_steps:9,} {result.num_simulated_tokens:11,} "
            f"{result.num_simulated_tokens / wall:16,.0f}"
        )
    print(f"{'both':<12} {total_wall:8.2f}\n")

    spent = {"reserve": 0.0, "write": 0.0}
    calls = {"reserve": 0, "write": 0}
    originals: dict[str, Callable[..., Any]] = {
        "reserve": KVCacheManager.reserve,
        "write": KVCacheManager.write,
    }

    def timed(name: str) -> Callable[..., Any]:
        original = originals[name]

        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.process_time()
            try:
                return original(*a, **k)
            finally:
                spent[name] += time.process_time() - start
                calls[name] += 1

        return wrapper

    KVCacheManager.reserve = timed("reserve")  # type: ignore[method-assign]
    KVCacheManager.write = timed("write")  # type: ignore[method-assign]
    try:
        workload = synthetic("sharegpt", args.split_requests, seed=0)
        cpu = time.process_time()
        result = run_policy("paged", workload, config)
        cpu = time.process_time() - cpu
    finally:
        KVCacheManager.reserve = originals["reserve"]  # type: ignore[method-assign]
        KVCacheManager.write = originals["write"]  # type: ignore[method-assign]
    rest = cpu - spent["reserve"] - spent["write"]
    decode = result.num_decode_tokens
    print(f"where the paged policy's CPU time goes ({args.split_requests:,} requests, {cpu:.2f} s CPU):")
    for name in ("reserve", "write"):
        print(
            f"  manager.{name:<8} {spent[name]:6.2f} s  {100 * spent[name] / cpu:5.1f}%  "
            f"{calls[name]:,} calls, {1e6 * spent[name] / calls[name]:.0f} us per call"
        )
    print(
        f"  everything else  {rest:6.2f} s  {100 * rest / cpu:5.1f}%  "
        "(the simulator's loop, preempt, free, fork...)"
    )
    print(
        f"  per decode token: {1e6 * spent['reserve'] / decode:.2f} us in reserve (all reservations, "
        f"prefill included, over {decode:,} decode tokens)"
    )

    if args.study:
        study(config, args.num_requests)


def study(config: SimConfig, num_requests: int) -> None:
    """Parts 3 and 4: the rate sweep's wall time, and every scheduler on ``num_requests``."""
    systems = ["paged", "contiguous", "contiguous-pow2", "contiguous-oracle"]
    wall, cpu = time.perf_counter(), time.process_time()
    points = rate_sweep("sharegpt", 2000, config, DEFAULT_RATES["sharegpt"], systems)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"\nrate sweep: {len(systems)} systems x {len(DEFAULT_RATES['sharegpt'])} rates x 2,000 requests")
    print(f"  {wall:.1f} s wall, {cpu:.1f} s CPU ({len(points)} runs; target under 120 s)")
    print(f"\nevery scheduler on {num_requests:,} ShareGPT-like requests, all arriving at once:")
    header = f"{'scheduler':<15} {'wall s':>7} {'preempt':>8} {'recomputed':>11} {'of prefill':>10}"
    print(f"{header} {'swap GB':>8} {'model s':>8} {'tok/s':>6} {'norm s/tok':>10}")
    workload = synthetic("sharegpt", num_requests, seed=0)
    for name in SCHEDULERS:
        wall = time.perf_counter()
        result = run_policy(f"paged:{name}", workload, config)
        wall = time.perf_counter() - wall
        share = result.num_recomputed_tokens / max(1, result.num_prefill_tokens)
        print(
            f"{name:<15} {wall:7.1f} {result.num_preemptions:8,} {result.num_recomputed_tokens:11,} "
            f"{100 * share:9.1f}% {result.swap_bytes / 1e9:8.1f} {result.model_s:8.0f} "
            f"{result.latency.tokens_per_s:6.0f} {result.latency.normalised_mean:10.3f}"
        )


if __name__ == "__main__":
    main()
