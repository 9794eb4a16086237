"""Tiers below the device pool: block store / load throughput per tier, and host-tier policy hit rates.

Run: ``python benchmarks/bench_tiers.py`` (``--quick`` for a smoke run).

* (a) GB/s of whole blocks (every layer, keys and values, one piece) moved from
  the pool into each tier (``TieredStore.offer``: read_block, frame, put) and
  back into fresh device blocks (``DeviceTiering.load``: get, check, load_block),
  beside a plain ``memcpy`` (``np.copyto``) of the same bytes measured in the
  same run. Tiers: host (numpy slots), file (``FileStore`` in a temp dir, page
  cache warm), redis (a ``redis-server`` on loopback, started here when on PATH).
* (b) host-tier hit rates of LRU and S3-FIFO on one synthetic trace: a hot set of
  system prompts read again and again, cut by one-off scans (long unique prompts).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from common import footer, header, table
from threadpoolctl import threadpool_limits

from pagedkv.memory.pool import KVPool
from pagedkv.tiers import BlockLayout, DeviceTiering, FileStore, HostTier, RedisStore, TieredStore
from pagedkv.tiers.host import HOST_POLICIES


def _start_redis() -> tuple[subprocess.Popen[bytes], int] | None:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--maxmemory", "2gb"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return process, port


def _gbps(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.2f}"


def throughput(num_blocks: int, repeats: int, redis_port: int | None) -> list[list[str]]:
    pool = KVPool(2 * num_blocks, block_size=16, num_kv_heads=8, head_dim=128, num_layers=4, dtype=np.float32)
    rng = np.random.default_rng(0)
    for layer in range(pool.num_layers):
        slots = np.arange(num_blocks * 16)
        shape = (len(slots), 8, 128)
        pool.write(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))
    layout = BlockLayout.of_pool(pool, "bench")
    total = num_blocks * layout.block_nbytes
    source = np.ones(total, np.uint8)
    target = np.empty_like(source)
    memcpy = min(_timed(lambda: np.copyto(target, source)) for _ in range(repeats))
    block = f"{layout.block_nbytes >> 10} KiB"
    rows = [["memcpy (np.copyto)", block, _gbps(total, memcpy), _gbps(total, memcpy), "1.00"]]
    with tempfile.TemporaryDirectory() as directory:
        tiers_of = {
            "host": lambda: [HostTier(block_nbytes=layout.block_nbytes, num_blocks=num_blocks)],
            "file": lambda: [FileStore(directory, max_bytes=4 * total)],
        }
        if redis_port is not None:
            tiers_of["redis"] = lambda: [RedisStore(port=redis_port, timeout_s=5)]
        for name, make in tiers_of.items():
            best_store, best_load = float("inf"), float("inf")
            for _ in range(repeats):
                made = make()
                host = made[0] if isinstance(made[0], HostTier) else None
                stores = [] if host is not None else made
                tiering = DeviceTiering(pool, TieredStore(layout, host=host, stores=stores))  # type: ignore[arg-type]
                keys = [b"key%d-%f" % (i, time.perf_counter()) for i in range(num_blocks)]
                fresh = list(range(num_blocks, 2 * num_blocks))
                best_store = min(best_store, _timed(partial(_store_all, tiering, keys)))
                best_load = min(best_load, _timed(partial(tiering.load, keys, fresh)))
                if not np.array_equal(pool.key_pages(3)[fresh[-1]], pool.key_pages(3)[num_blocks - 1]):
                    raise SystemExit(f"{name}: a loaded block differs from the one stored")
            ratio = f"{memcpy / best_load:.2f}"
            rows.append([name, block, _gbps(total, best_store), _gbps(total, best_load), ratio])
    return rows


def _store_all(tiering: DeviceTiering, keys: list[bytes]) -> None:
    for block_id, key in enumerate(keys):
        tiering.evicted(block_id, key)


def _timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def hit_rates(num_requests: int) -> list[list[str]]:
    rng = np.random.default_rng(1)
    trace: list[bytes] = []
    hot = [[b"sys%d-%d" % (s, b) for b in range(8)] for s in range(6)]  # 6 system prompts of 8 blocks
    for request in range(num_requests):
        if rng.random() < 0.2:
            trace += [b"scan%d-%d" % (request, b) for b in range(40)]  # a long one-off prompt
        else:
            trace += hot[int(rng.zipf(1.5)) % len(hot)]
    rows = []
    for capacity in (32, 64):
        row = [str(capacity)]
        for policy in HOST_POLICIES:
            host = HostTier(block_nbytes=1, num_blocks=capacity, policy=policy)
            hits = 0
            for key in trace:
                if host.get(key) is not None:
                    hits += 1
                else:
                    host.put(key, b"x")
            row.append(f"{hits / len(trace):.1%}")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few blocks and repeats: a smoke run")
    args = parser.parse_args()
    num_blocks, repeats, num_requests = (32, 2, 200) if args.quick else (256, 5, 3000)
    print(header("bench_tiers: block store/load throughput per tier, host-tier policy hit rates", [
        f"blocks: {num_blocks} of 16 tokens x 8 kv heads x 128 x float32 x 4 layers (keys and values); "
        f"best of {repeats}; wall clock",
    ]))
    redis = _start_redis()
    try:
        with threadpool_limits(1):
            rows = throughput(num_blocks, repeats, None if redis is None else redis[1])
    finally:
        if redis is not None:
            redis[0].kill()
            redis[0].wait()
    print("\n(a) GB/s, device pool -> tier (store) and tier -> fresh device blocks (load)")
    print(table(["tier", "block", "store GB/s", "load GB/s", "load / memcpy"], rows))
    if redis is None:
        print("(no redis-server on PATH: the redis row is left out)")
    print(f"\n(b) host-tier hit rate on a hot-set + scans trace ({num_requests} requests)")
    print(table(["host blocks", *HOST_POLICIES], hit_rates(num_requests)))
    print(footer())


if __name__ == "__main__":
    main()
