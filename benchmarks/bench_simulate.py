"""How fast ``pagedkv simulate`` runs, and where the time goes. Prints; asserts nothing.

    python benchmarks/bench_simulate.py              # 10,000 ShareGPT-like requests
    python benchmarks/bench_simulate.py --num-requests 2000

Part 1 runs the default command's work (paged and contiguous, OPT-13B, 12 GiB,
block size 16) and prints wall-clock and CPU seconds (CPU seconds are what
this process got; on a shared machine wall time can be several times more).
Part 2 runs the paged policy again with the manager's ``reserve`` and
``write`` wrapped in timers, to split the CPU time between the manager and
the simulator's own loop.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

from pagedkv.manager import KVCacheManager
from pagedkv.simulate import Budget, ModelShape, SimConfig, parse_bytes, run_policy, synthetic


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--split-requests", type=int, default=2_000, help="requests for part 2")
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


if __name__ == "__main__":
    main()
