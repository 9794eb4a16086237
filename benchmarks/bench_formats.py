"""Every page storage format side by side: decode and a prefill chunk, as time, ÷ float32 and GB/s.

One table: each storage format (float32, float16, bfloat16, int8, float8_e4m3; keys and values
alike) x {views, gather} x {1k, 8k, 16k tokens} x {decode, prefill chunk of 128}. Each row runs
``attention.attend_sequence`` (what ``KVCache.attend`` and the manager's loop run) on a shared
pool whose two tables take blocks in turn, so the measured table is never one run; H=8 kv heads
(8 query heads, or ``--group`` times as many), head_dim 128, block_size 16, float32 compute,
cache-cold (64 MiB written before each call), BLAS pinned to one thread, medians, the rows of one
length taking turns in every repeat. "GB/s" is the stored bytes read (codes and scales of keys and
values) over the time, against a one-thread numpy gemv over a cold 64 MiB float32 matrix taking
turns with the rows ("of gemv"). A format a pool cannot map shows "gathers" in its views row.
Outputs are checked bit for bit between views and gather. Nothing is asserted about time.

Run: ``python benchmarks/bench_formats.py [--quick] [--save] [--kernel numba] [--group 4] [--warm]``
(``--save`` writes ``benchmarks/results/formats.json``; ``--warm`` times each call right after an
untimed one of the same row, no flush: the pages in cache as far as they fit, the kernel's own speed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
from common import CLOCKS, Flusher, footer, format_us, header, now, table, use_clock
from threadpoolctl import threadpool_limits

from pagedkv import KVPool
from pagedkv.attention import attend_sequence, set_kernel
from pagedkv.blocks.table import BlockTable
from pagedkv.errors import ConfigError

H, D, BS, PREFILL = 8, 128, 16, 128
F32 = np.dtype(np.float32)
SCALE = 1 / math.sqrt(D)
FORMATS = (None, "float16", "bfloat16", "int8", "float8_e4m3")
RESULTS = Path(__file__).parent / "results" / "formats.json"


def fragmented_pool(storage: str | None, mode: str, num_tokens: int) -> tuple[KVPool, BlockTable] | None:
    """A pool of ``storage`` pages in ``mode`` holding two interleaved tables; the first, or None.

    None when the pool cannot read in ``mode`` (a format views cannot map).
    """
    rng = np.random.default_rng(0)
    num_blocks = 2 * -(-num_tokens // BS) + 1
    try:
        pool = KVPool(num_blocks, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32,
                      key_dtype=storage, value_dtype=storage, view_mode=mode)
    except ConfigError:
        return None
    tables = [BlockTable(BS), BlockTable(BS)]
    while tables[0].num_tokens < num_tokens:
        for t in tables:
            t.append(min(BS, num_tokens - t.num_tokens), [pool.allocator.allocate_one()])
    for t in tables:
        pool.attach(t)
        keys = rng.standard_normal((num_tokens, H, D), dtype=np.float32)
        pool.write(0, t.slot_array(t.live_ranges()), keys, keys[::-1].copy())
    if tables[0].is_one_run:
        raise AssertionError("the measured table is one run of ids: nothing would be gathered")
    return pool, tables[0]


def stored_bytes(pool: KVPool, num_tokens: int) -> int:
    """Bytes of keys and values (codes and scales) ``num_tokens`` tokens take in one layer."""
    return pool.bytes_per_token * num_tokens // pool.num_layers


def gemv_probe() -> tuple[Callable[[], object], int]:
    """A one-thread numpy gemv over a 64 MiB float32 matrix (the read-bandwidth probe), and its bytes."""
    matrix = np.random.default_rng(1).standard_normal((1 << 14, 1 << 10), dtype=np.float32)
    vector = np.ones(1 << 10, np.float32)
    return (lambda: matrix @ vector), matrix.nbytes


def measure(rows: dict[str, Callable[[], object]], repeats: int, flush: Flusher | None) -> dict[str, float]:
    """Median microseconds of each row, the rows taking turns within every repeat.

    ``flush`` None: each timed call right after an untimed one of the same row (warm).
    """
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, run in rows.items():
            if flush is None:
                run()
            else:
                flush()
            start = now()
            run()
            samples[name].append(now() - start)
    return {name: statistics.median(times) * 1e6 for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 8k only, 3 repeats (a smoke run)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/formats.json")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall clock, or this thread's CPU time (leaves out time descheduled)")
    parser.add_argument("--lengths", type=int, nargs="+", help="token counts (default 1k 8k 16k)")
    parser.add_argument("--formats", nargs="+", help="storage formats besides float32 (default all)")
    parser.add_argument("--kernel", choices=("numpy", "numba"), default="numpy",
                        help="the decode kernel (numba: the jit extra; float32 pages keep numpy's einsum "
                             "for one query row a kv head)")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per kv head (grouped-query attention; default 1: 8 query heads)")
    parser.add_argument("--warm", action="store_true",
                        help="time each call right after an untimed one of the same row, no flush: "
                             "the pages in cache as far as they fit (the kernel's own speed)")
    args = parser.parse_args()
    set_kernel(args.kernel)
    clock = use_clock(args.clock)
    lengths = args.lengths or ((1024, 8192) if args.quick else (1024, 8192, 16384))
    formats = (None, *args.formats) if args.formats else FORMATS
    repeats = 3 if args.quick else 11
    caches = "warm (each call after one of its own)" if args.warm else "cache-cold"
    print(header("Storage formats: decode and prefill over fragmented shared pools",
                 [f"H={H} kv heads, {H * args.group} query heads, head_dim {D}, block_size {BS}, "
                  f"float32 compute, prefill chunk {PREFILL}, two interleaved tables, {caches}, "
                  f"medians of {repeats}",
                  f"clock: {clock}, decode kernel: {args.kernel}"]))
    flush = None if args.warm else Flusher()
    rng = np.random.default_rng(2)
    query = rng.standard_normal((1, H * args.group, D), dtype=np.float32)
    prefill = rng.standard_normal((PREFILL, H * args.group, D), dtype=np.float32)
    results = []
    probe_run, probe_bytes = gemv_probe()
    probes = {}
    with threadpool_limits(1):
        for num_tokens in lengths:
            rows: dict[str, Callable[[], object]] = {"gemv": probe_run}
            sizes: dict[str, int] = {}
            outputs: dict[tuple[str, str], list[npt.NDArray[np.float32]]] = {}
            for storage in formats:
                name = storage or "float32"
                for mode in ("views", "gather"):
                    made = fragmented_pool(storage, mode, num_tokens)
                    if made is None:
                        continue
                    pool, t = made
                    sizes[name] = stored_bytes(pool, num_tokens)
                    for op, queries in (("decode", query), ("prefill", prefill)):
                        def run(pool: KVPool = pool, t: BlockTable = t, q: npt.NDArray[np.float32] = queries
                                ) -> npt.NDArray[np.float32]:
                            return attend_sequence(pool, 0, t, None, q, SCALE)
                        rows[f"{name}|{mode}|{op}"] = run
                        outputs.setdefault((name, op), []).append(run())
            for (name, op), outs in outputs.items():
                if not all(np.array_equal(outs[0], out) for out in outs[1:]):
                    raise AssertionError(f"{name} {op}: views and gather differ")
            times = measure(rows, repeats, flush)
            probe = probes[num_tokens] = probe_bytes / times.pop("gemv") / 1e3
            for key, micros in times.items():
                name, mode, op = key.split("|")
                base = times.get(f"float32|{mode}|{op}", times[f"float32|gather|{op}"])
                float32_rows = (f"float32|views|{op}", f"float32|gather|{op}")
                best = min(times[row] for row in float32_rows if row in times)
                gbps = sizes[name] / micros / 1e3
                results.append({"format": name, "mode": mode, "tokens": num_tokens, "op": op,
                                "us": micros, "vs_float32": micros / base, "vs_best_float32": micros / best,
                                "gbps": gbps, "of_gemv": gbps / probe})
            for storage in formats:
                name = storage or "float32"
                if f"{name}|views|decode" not in rows:
                    results.append({"format": name, "mode": "views", "tokens": num_tokens, "op": "-"})
    columns = ["format", "mode", "tokens", "op", "time", "÷ float32", "÷ best float32", "GB/s stored",
               "of gemv"]
    order = {name or "float32": i for i, name in enumerate(FORMATS)}
    lines = []
    for row in sorted(results, key=lambda r: (r["tokens"], r["op"] != "decode", order[r["format"]],
                                               r["mode"] != "views")):
        if row["op"] == "-":
            tokens = f"{row['tokens'] // 1024}k"
            lines.append([row["format"], "views", tokens, "both", "gathers", "", "", "", ""])
            continue
        lines.append([row["format"], row["mode"], f"{row['tokens'] // 1024}k", row["op"],
                      format_us(row["us"]), f"{row['vs_float32']:.2f}x", f"{row['vs_best_float32']:.2f}x",
                      f"{row['gbps']:.1f}",
                      f"{row['of_gemv']:.2f}"])
    print("gemv probe (one thread, cold 64 MiB float32, taking turns with the rows): "
          + ", ".join(f"{probe:.1f} GB/s at {n // 1024}k" for n, probe in probes.items()) + "\n")
    print(table(columns, lines))
    print("\n÷ float32: against float32 pages in the same mode; ÷ best float32: against the faster "
          "float32 mode (views where the platform maps them)")
    print(footer())
    if args.save:
        RESULTS.write_text(json.dumps({"gemv_gbps": probes, "rows": results}, indent=1) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
