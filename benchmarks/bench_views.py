"""Two ways to page, side by side: gathering (vLLM) and mapped page views (vAttention); prints tables.

Every row attends one decode query per sequence, H=8 kv heads (8 query
heads), head_dim 128, float32, block_size 16 unless said, cache-cold (64 MiB
written before each call), BLAS pinned to one thread, medians. Rows:

* best contiguous: the faster of ``attend_dense`` and the einsum candidate on
  one contiguous head-major ``(H, n, d)`` array per sequence (no paging);
* views / gather: ``paged_attention.attend_sequence`` (what ``KVCache.attend``
  and the manager's loop run) on a shared pool whose tables interleave, so
  no table is one run: ``KVPool(view_mode="views")`` or ``"gather"``.

(a) one cache at 1k / 4k / 16k tokens; (b) a batch of 64 sequences x 1024
tokens (the manager's loop); (c) prefill chunks of 128 tokens; (d) a windowed
cache (``max_size=1024``): per-token time late in a 64k stream vs in a 1k one,
blocks held; (e) mapping costs; (f) areas and RSS of a 64-sequence x 4-layer
pool; (g) the block-size sweep at 4k tokens, also written to
``benchmarks/results/kernel_block_size.json``. Outputs are checked bit for
bit between views and gather. Nothing is asserted about time.

Run: ``python benchmarks/bench_views.py [--quick]`` (Linux; views need it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
from candidates import attend_einsum
from common import Flusher, cpu_model, footer, header, table
from threadpoolctl import threadpool_limits

from pagedkv import KVCache, KVPool
from pagedkv.attention import attend_dense
from pagedkv.block_table import BlockTable
from pagedkv.paged_attention import attend_sequence

Array = npt.NDArray[np.float32]
H, D, BS = 8, 128, 16
F32 = np.dtype(np.float32)
SCALE = 1 / math.sqrt(D)
RESULTS = Path(__file__).parent / "results" / "kernel_block_size.json"


def median_ms(run: Callable[[], object], repeats: int, flush: Flusher | None) -> float:
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def interleaved_tables(
    pool: KVPool, num_seqs: int, num_tokens: int, rng: np.random.Generator
) -> list[BlockTable]:
    """``num_seqs`` tables taking blocks in turn (none is one run), filled with random pages."""
    tables = [BlockTable(pool.block_size) for _ in range(num_seqs)]
    num_blocks = -(-num_tokens // pool.block_size)
    for _ in range(num_blocks):
        for t in tables:
            t.append(min(pool.block_size, num_tokens - t.num_tokens), [pool.allocator.allocate_one()])
    for t in tables:
        pool.attach(t)
        slots = t.slot_array(t.live_ranges())
        for layer in range(pool.num_layers):
            k = rng.standard_normal((num_tokens, pool.num_kv_heads, pool.head_dim), dtype=np.float32)
            pool.write(layer, slots, k, k[::-1].copy())
    return tables


def paged_pools(
    num_seqs: int, num_tokens: int, block_size: int = BS
) -> dict[str, tuple[KVPool, list[BlockTable]]]:
    pools = {}
    for mode in ("views", "gather"):
        rng = np.random.default_rng(0)
        blocks = num_seqs * -(-num_tokens // block_size) + 1
        pool = KVPool(blocks, block_size=block_size, num_kv_heads=H, head_dim=D, dtype=F32, view_mode=mode)
        pools[mode] = (pool, interleaved_tables(pool, num_seqs, num_tokens, rng))
    return pools


def contiguous_of(pool: KVPool, t: BlockTable) -> tuple[Array, Array]:
    keys, values = pool.gather(0, t.read_plan())
    return np.ascontiguousarray(keys), np.ascontiguousarray(values)


def decode_rows(
    num_seqs: int, num_tokens: int, repeats: int, flush: Flusher, block_size: int = BS
) -> dict[str, float]:
    """Milliseconds per batch (one query per sequence) for each method."""
    pools = paged_pools(num_seqs, num_tokens, block_size)
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((num_seqs, 1, H, D), dtype=np.float32)
    pool, tables = pools["views"]
    dense = [contiguous_of(pool, t) for t in tables]
    rows: dict[str, Callable[[], object]] = {
        "contiguous attend_dense": lambda: [
            attend_dense(queries[i, 0], *dense[i], SCALE) for i in range(num_seqs)
        ],
        "contiguous einsum": lambda: [
            attend_einsum(queries[i, 0], *dense[i], SCALE) for i in range(num_seqs)
        ],
    }
    outs = {}
    for mode, (p, ts) in pools.items():

        def run(p: KVPool = p, ts: list[BlockTable] = ts) -> list[Array]:
            return [attend_sequence(p, 0, ts[i], None, queries[i], SCALE) for i in range(num_seqs)]

        outs[mode] = run()  # maps the views once (the cost of (e), not of a step)
        rows[mode] = run
    if not all(np.array_equal(a, b) for a, b in zip(outs["views"], outs["gather"])):
        raise AssertionError("views and gather differ")
    result = {name: median_ms(run, repeats, flush) for name, run in rows.items()}
    result["best contiguous"] = min(result["contiguous attend_dense"], result["contiguous einsum"])
    return result


def ratio_table(title: str, results: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    names = ["contiguous attend_dense", "contiguous einsum", "views", "gather"]
    rows = []
    for label, res in results.items():
        best = res["best contiguous"]
        rows.append([label] + [f"{res[n]:.2f} ms ({res[n] / best:.2f}x)" for n in names])
    print(table(["case"] + [f"{n} (÷ best contiguous)" for n in names], rows))


def prefill_rows(num_tokens: int, chunk: int, repeats: int, flush: Flusher) -> dict[str, float]:
    pools = paged_pools(2, num_tokens)
    queries = np.random.default_rng(2).standard_normal((chunk, H, D), dtype=np.float32)
    res = {}
    for mode, (pool, tables) in pools.items():

        def run(pool: KVPool = pool, table: BlockTable = tables[0]) -> Array:
            return attend_sequence(pool, 0, table, None, queries, SCALE)

        res[mode] = median_ms(run, repeats, flush)
    return res


def windowed(num_tokens: int, window: int) -> tuple[float, int, int]:
    """µs per token over the last 256 tokens of a stream on a shared views pool; max blocks held; maps."""
    pool = KVPool(2 * window // BS + 8, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    other = KVCache(pool=pool)  # takes blocks in between early on, so the window is fragmented
    cache = KVCache(window, pool=pool, scale=SCALE)
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((512, H, D), dtype=np.float32)
    held, times = 0, []
    for t in range(num_tokens):
        x = kv[t % 512]
        if t < 64:
            other.attend(x, x, x)
        start = time.perf_counter()
        cache.attend(x, x, x)
        if t >= num_tokens - 256:
            times.append(time.perf_counter() - start)
        held = max(held, cache.num_blocks)
    return statistics.median(times) * 1e6, held, pool.view_stats.num_maps


def mapping_costs(repeats: int) -> tuple[float, float]:
    """µs per newly mapped block, and µs of a decode step's view sync when nothing changed."""
    pool = KVPool(4097, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    t = interleaved_tables(pool, 1, 1024, np.random.default_rng(4))[0]
    start = time.perf_counter()
    pool.read(0, t, [(0, 1024)])
    per_block = (time.perf_counter() - start) / (2 * 64) * 1e6  # keys and values, 64 blocks each
    sync = median_ms(lambda: pool.read(0, t, [(0, 1024)]), repeats, None) * 1e3
    return per_block, sync


def areas_and_rss(num_seqs: int, num_layers: int, num_tokens: int) -> tuple[int, int, int, float]:
    """Blocks mapped, areas in /proc/self/maps before and after, RSS (MiB) of a many-layer pool read once."""
    with open("/proc/self/maps") as maps:
        before = sum(1 for _ in maps)
    blocks = num_seqs * num_tokens // BS
    pool = KVPool(blocks, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, num_layers=num_layers)
    tables = interleaved_tables(pool, num_seqs, num_tokens, np.random.default_rng(5))
    for t in tables:
        for layer in range(num_layers):
            pool.read(layer, t, [(0, num_tokens)])
    with open("/proc/self/maps") as maps:
        after = sum(1 for _ in maps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return pool.num_mapped_blocks, before, after, rss


def sweep(block_sizes: list[int], repeats: int, flush: Flusher) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"block_size": [], "gather_ms": [], "view_ms": [], "contiguous_ms": []}
    for bs in block_sizes:
        res = decode_rows(1, 4096, repeats, flush, block_size=bs)
        out["block_size"].append(bs)
        out["gather_ms"].append(round(res["gather"], 4))
        out["view_ms"].append(round(res["views"], 4))
        out["contiguous_ms"].append(round(res["best contiguous"], 4))
        print(
            f"  block_size {bs:>3}: gather {res['gather']:.2f} ms, views {res['views']:.2f} ms, "
            f"contiguous {res['best contiguous']:.2f} ms",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a 16k windowed stream")
    args = parser.parse_args()
    repeats = 5 if args.quick else 11
    print(
        header(
            "bench_views.py: gather vs mapped page views vs contiguous",
            [
                f"H={H} (8 query heads), head_dim {D}, float32, block_size {BS}, interleaved tables, "
                f"cache-cold, medians of {repeats}, BLAS 1 thread"
            ],
        )
    )
    flush = Flusher()
    with threadpool_limits(1):
        ratio_table(
            "(a) one sequence on a shared pool",
            {f"{n // 1024}k tokens": decode_rows(1, n, repeats, flush) for n in (1024, 4096, 16384)},
        )
        ratio_table(
            "(b) a batch of 64 sequences x 1024 tokens (ms per batch)",
            {"64 x 1024": decode_rows(64, 1024, repeats, flush)},
        )
        prefill = {n: prefill_rows(n, 128, repeats, flush) for n in (1024, 4096)}
        print("\n(c) prefill chunk of 128 queries over a fragmented table")
        print(
            table(
                ["tokens", "views", "gather", "gather ÷ views"],
                [
                    [
                        str(n),
                        f"{r['views']:.2f} ms",
                        f"{r['gather']:.2f} ms",
                        f"{r['gather'] / r['views']:.2f}x",
                    ]
                    for n, r in prefill.items()
                ],
            )
        )
        long = 16384 if args.quick else 65536
        short_us, _, _ = windowed(1024, 1024)
        long_us, long_held, maps = windowed(long, 1024)
        print(
            f"\n(d) windowed cache max_size=1024 on a shared views pool: {short_us:.0f} µs/token at 1k, "
            f"{long_us:.0f} µs/token at {long // 1024}k ({long_us / short_us:.2f}x); blocks held at most "
            f"{long_held} (ceil(1024/16) + 1 = {math.ceil(1024 / BS) + 1}); "
            f"{maps} blocks mapped over the stream"
        )
        per_block, sync = mapping_costs(repeats)
        print(
            f"\n(e) mapping: {per_block:.1f} µs per newly mapped block (first read of a 1k-token table, "
            f"K and V); {sync:.1f} µs per decode-step sync of an unchanged 1k-token table"
        )
        mapped, before, after, rss = areas_and_rss(64, 4, 256)
        print(
            f"\n(f) 64 sequences x 4 layers x 256 tokens: {mapped} blocks mapped, /proc/self/maps "
            f"{before} -> {after} lines, peak RSS {rss:.0f} MiB"
        )
        print("\n(g) block-size sweep, one sequence of 4096 tokens")
        result = sweep([1, 2, 4, 8, 16, 32, 64, 128, 256], repeats, flush)
    result["machine"] = f"{cpu_model()}, {os.cpu_count()} cores, BLAS 1 thread, cache-cold"  # type: ignore[assignment]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"  written to {RESULTS}")
    print(footer())


if __name__ == "__main__":
    main()
