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
* (c) time to first token of a cached 2,000-token prompt through ``KVCacheManager``:
  admission (``add_sequence``: device hit, or a load from the host / file / redis
  tier into fresh blocks), then reserve, write and attend the tokens past the hit.
  "recompute" writes k/v for all 2,000 tokens through the manager and attends
  each (a prefill's KV work); a hit attends only the tokens past it. What is
  modelled: the KV cache's own work only. A real recompute also runs the model's
  prefill (billions of FLOPs a token), so the ratios here understate what a tier
  hit saves; they bound how much the tiers themselves cost.
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

from pagedkv import KVCacheManager
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


TTFT_SHAPE = {"block_size": 16, "num_kv_heads": 8, "head_dim": 128, "num_layers": 2, "dtype": np.float32}


def _first_token(manager: KVCacheManager, seq_id: str, prompt: list[int]) -> int:
    """Admit ``prompt``, write k/v past its hit and attend them (the work before the first token); the hit."""
    num_hit = manager.add_sequence(seq_id, prompt)
    batch = manager.reserve({seq_id: prompt[num_hit:]})
    rows = np.full((len(prompt) - num_hit, 8, 128), 0.01, np.float32)   # (num_tokens, num_kv_heads, head_dim)
    for layer in range(TTFT_SHAPE["num_layers"]):
        manager.write(layer, batch, rows, rows)
        manager.attend(layer, batch, rows)
    return num_hit


def ttft(num_tokens: int, repeats: int, redis_port: int | None) -> list[list[str]]:
    prompt = [(7 * t + 3) % 32000 for t in range(num_tokens)]
    num_blocks = -(-num_tokens // 16) + 2

    def fresh(tiers: TieredStore | None = None) -> KVCacheManager:
        return KVCacheManager(KVPool(num_blocks, **TTFT_SHAPE), enable_prefix_caching=True,  # type: ignore[arg-type]
                              trusted_inputs=True, tiers=tiers)

    def recompute() -> float:
        manager = fresh()
        return _timed(partial(_first_token, manager, "p", prompt))

    def device() -> float:
        manager = fresh()
        _first_token(manager, "warm", prompt)
        manager.free("warm")
        return _timed(partial(_first_token, manager, "p", prompt))

    rows = []
    baseline = min(recompute() for _ in range(repeats))
    rows.append(["recompute (write + attend every token)", "0", f"{baseline * 1e3:.2f}", "1.00"])
    best = min(device() for _ in range(repeats))
    rows.append(["device (prefix cache)", str((num_tokens - 1) // 16 * 16), f"{best * 1e3:.2f}",
                 f"{baseline / best:.2f}"])
    with tempfile.TemporaryDirectory() as directory:
        layout = BlockLayout.of_pool(KVPool(1, **TTFT_SHAPE), "bench")  # type: ignore[arg-type]
        tiers_of: dict[str, Callable[[], TieredStore]] = {
            "host": lambda: TieredStore(layout, host=HostTier(block_nbytes=layout.block_nbytes,
                                                               num_blocks=num_blocks),
                                        write_policy="write_through"),
            "file": lambda: TieredStore(layout, stores=[FileStore(directory, max_bytes=1 << 32)],
                                        write_policy="write_through"),
        }
        if redis_port is not None:
            tiers_of["redis"] = lambda: TieredStore(layout, stores=[RedisStore(port=redis_port, timeout_s=5)],
                                                    write_policy="write_through")
        for name, make in tiers_of.items():
            tiers = make()
            writer = fresh(tiers)
            _first_token(writer, "w", prompt)   # write-through: every full block reaches the tier
            writer.flush_tiers()
            best, num_hit = float("inf"), 0
            for _ in range(repeats):
                reader = fresh(tiers)            # an empty pool: the hit can only come from the tier
                start = time.perf_counter()
                num_hit = _first_token(reader, "p", prompt)
                best = min(best, time.perf_counter() - start)
            if reader.metrics().num_tier_hits != num_hit or not num_hit:
                raise SystemExit(f"{name}: the hit did not come from the tier")
            rows.append([name, str(num_hit), f"{best * 1e3:.2f}", f"{baseline / best:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few blocks and repeats: a smoke run")
    args = parser.parse_args()
    num_blocks, repeats, num_requests = (32, 2, 200) if args.quick else (256, 5, 3000)
    num_tokens = 500 if args.quick else 2000
    print(header("bench_tiers: block store/load throughput per tier, host-tier policy hit rates", [
        f"blocks: {num_blocks} of 16 tokens x 8 kv heads x 128 x float32 x 4 layers (keys and values); "
        f"best of {repeats}; wall clock",
    ]))
    redis = _start_redis()
    try:
        with threadpool_limits(1):
            rows = throughput(num_blocks, repeats, None if redis is None else redis[1])
            ttft_rows = ttft(num_tokens, repeats, None if redis is None else redis[1])
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
    print(f"\n(c) time to first token of a cached {num_tokens}-token prompt (KV work only: no model; "
          "16 x 8 x 128 float32 blocks, 2 layers)")
    print(table(["from", "cached tokens", "ms", "recompute / this"], ttft_rows))
    print(footer())


if __name__ == "__main__":
    main()
