"""Two ways to page, side by side: gathering (vLLM) and mapped page views (vAttention); prints tables.

Every row attends one decode query per sequence, H=8 kv heads (8 query
heads), head_dim 128, float32, block_size 16 unless said, cache-cold (64 MiB
written before each call), BLAS pinned to one thread, medians. Rows:

* best contiguous: the faster of ``attend_dense`` and the einsum candidate on
  one contiguous head-major ``(H, n, d)`` array per sequence (no paging);
* views / gather: ``attention.attend_sequence`` (what ``KVCache.attend``
  and the manager's loop run) on a shared pool whose tables interleave, so
  no table is one run: ``KVPool(view_mode="views")`` or ``"gather"``.

(a) one cache at 1k / 4k / 16k tokens; (b) a batch of 64 sequences x 1024
tokens (the manager's loop); (c) prefill chunks of 128 tokens; (d) a windowed
cache (``max_size=1024``): per-token time late in a 64k stream vs a young cache's,
in turns, blocks held; (e) mapping costs; (f) areas and RSS of a 64-sequence x 4-layer
pool at 1024 tokens; (g) the block-size sweep at 4k tokens (three passes, their medians
combined), written to ``benchmarks/results/kernel_block_size.json`` only
with ``--save``; (h) where the views' gap comes
from: the same kernel on private anonymous memory, head-major or token-major,
with huge pages or 4 KiB pages (``madvise``), next to the views. Outputs are checked bit for
bit between views and gather. Nothing is asserted about time.

Run: ``python benchmarks/bench_views.py [--quick | --save]`` (Linux; views need it).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import mmap
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt
from candidates import attend_einsum
from common import Flusher, cpu_model, footer, header, table
from threadpoolctl import threadpool_limits

from pagedkv import KVCache, KVPool
from pagedkv.attention import attend_dense, attend_sequence
from pagedkv.blocks.table import BlockTable
from pagedkv.memory.vmem import map_budget

Array = npt.NDArray[np.float32]
H, D, BS = 8, 128, 16
F32 = np.dtype(np.float32)
SCALE = 1 / math.sqrt(D)
RESULTS = Path(__file__).parent / "results" / "kernel_block_size.json"


def median_ms(run: Callable[[], object], repeats: int, flush: Flusher | None) -> float:
    return interleaved_ms({"run": run}, repeats, flush)["run"]


def interleaved_ms(
    rows: Mapping[str, Callable[[], object]], repeats: int, flush: Flusher | None
) -> dict[str, float]:
    """Median milliseconds of each row, the rows taking turns within every repeat.

    NOTE: round-robin, not one row after another: on a box shared with other
    jobs the load drifts over seconds, and turns put every row of a ratio
    under the same load.
    """
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, run in rows.items():
            if flush is not None:
                flush()
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


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
    """Pools of each view mode holding ``num_seqs`` interleaved tables (and, for one, a second table).

    NOTE: one sequence alone would take consecutive ids, one run, which a
    gather pool reads as a zero-copy view of its storage: no gather at all.
    A second table taking every other block makes the first one fragmented,
    the case issue 12 asks about ("interleaved with another cache").
    """
    pools = {}
    num_tables = max(num_seqs, 2)
    for mode in ("views", "gather"):
        rng = np.random.default_rng(0)
        blocks = num_tables * -(-num_tokens // block_size) + 1
        pool = KVPool(blocks, block_size=block_size, num_kv_heads=H, head_dim=D, dtype=F32, view_mode=mode)
        tables = interleaved_tables(pool, num_tables, num_tokens, rng)
        if any(table.is_one_run for table in tables[:num_seqs]):
            raise AssertionError("a measured table is one run of ids: nothing would be gathered")
        pools[mode] = (pool, tables[:num_seqs])
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
    result = interleaved_ms(rows, repeats, flush)
    result["best contiguous"] = min(result["contiguous attend_dense"], result["contiguous einsum"])
    return result


_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # Linux <sys/mman.h>


def anonymous_copy(source: Array, huge: bool, keep: list[mmap.mmap]) -> Array:
    """``source`` copied into private anonymous memory asked for huge pages or for 4 KiB pages only.

    The mapping is appended to ``keep`` (the array must not outlive it).
    """
    buffer = mmap.mmap(-1, source.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(buffer)
    array = np.frombuffer(buffer, dtype=source.dtype).reshape(source.shape)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    advice = _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE
    if libc.madvise(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(source.nbytes), advice):
        raise OSError(ctypes.get_errno(), "madvise failed")
    array[...] = source
    return array


def page_rows(num_tokens: int, repeats: int, flush: Flusher) -> dict[str, float]:
    """ms of ``attend_dense`` on one sequence's keys and values in five memories (section (h)).

    NOTE: the views read token-major ``(n, H, d)`` arrays through the page
    file's 4 KiB pages; the best contiguous kernel reads head-major arrays
    that numpy puts on huge pages. These rows change one of the two at a
    time, on private memory, with the same numbers (token-major rows are
    checked bit-equal to the views).
    """
    pools = paged_pools(1, num_tokens)
    pool, (table,) = pools["views"]
    keys, values = contiguous_of(pool, table)  # head-major, numpy's own (huge pages from 4 MiB)
    token_keys, token_values = keys.transpose(1, 0, 2), values.transpose(1, 0, 2)
    query = np.random.default_rng(1).standard_normal((H, D), dtype=np.float32)
    keep: list[mmap.mmap] = []

    def copies(k: Array, v: Array, huge: bool) -> tuple[Array, Array]:
        return anonymous_copy(k, huge, keep), anonymous_copy(v, huge, keep)

    memories = {
        "head-major, huge pages": (keys, values, False),
        "head-major, 4 KiB pages": (*copies(keys, values, False), False),
        "token-major, huge pages": (*copies(token_keys, token_values, True), True),
        "token-major, 4 KiB pages": (*copies(token_keys, token_values, False), True),
    }
    rows: dict[str, Callable[[], Array]] = {}
    for name, (k, v, token_major) in memories.items():
        if token_major:
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)

        def run(k: Array = k, v: Array = v) -> Array:
            return attend_dense(query, k, v, SCALE)

        rows[name] = run
    rows["views (token-major, page file)"] = lambda: attend_sequence(pool, 0, table, None, query[None], SCALE)
    outputs = {name: run() for name, run in rows.items()}
    views = outputs["views (token-major, page file)"][0]
    if not all(np.array_equal(outputs[n], views) for n in outputs if n.startswith("token-major")):
        raise AssertionError("token-major kernels and views differ")
    return interleaved_ms(rows, repeats, flush)


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
    rows: dict[str, Callable[[], object]] = {}
    for mode, (pool, tables) in pools.items():

        def run(pool: KVPool = pool, table: BlockTable = tables[0]) -> Array:
            return attend_sequence(pool, 0, table, None, queries, SCALE)

        rows[mode] = run
    return interleaved_ms(rows, repeats, flush)


def windowed(num_tokens: int, window: int) -> tuple[float, float, int, int]:
    """µs per token of a young and of an old windowed cache, stepped in turns on one shared views pool.

    The old cache streams ``num_tokens`` tokens; the young one is closed and
    made again every ``2 * window`` tokens, and timed only while its window
    is full, so both time the same work (full windows) under the same load.
    The old one is timed over its last quarter. Returns their median µs per
    token, the most blocks the old one held, and the blocks mapped.
    """
    pool = KVPool(4 * window // BS + 16, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    other = KVCache(pool=pool)  # takes blocks in between early on, so the windows are fragmented
    old = KVCache(window, pool=pool, scale=SCALE)
    young = KVCache(window, pool=pool, scale=SCALE)
    kv = np.random.default_rng(3).standard_normal((512, H, D), dtype=np.float32)
    held, young_times, old_times = 0, [], []
    for t in range(num_tokens):
        x = kv[t % 512]
        if t < 64:
            other.attend(x, x, x)
        if t % (2 * window) == 0 and t:
            young.close()
            young = KVCache(window, pool=pool, scale=SCALE)
        start = time.perf_counter()
        young.attend(x, x, x)
        if t % (2 * window) >= window:
            young_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        old.attend(x, x, x)
        if t >= num_tokens * 3 // 4:
            old_times.append(time.perf_counter() - start)
        held = max(held, old.num_blocks)
    return (statistics.median(young_times) * 1e6, statistics.median(old_times) * 1e6, held,
            pool.view_stats.num_maps)


def mapping_costs(repeats: int) -> tuple[float, float, float]:
    """µs per newly mapped block, per read of an unchanged 1k-token table, per read after a new block."""
    pool = KVPool(4097, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32)
    t = interleaved_tables(pool, 2, 1024, np.random.default_rng(4))[0]
    start = time.perf_counter()
    pool.read(0, t, [(0, 1024)])
    per_block = (time.perf_counter() - start) / (2 * 64) * 1e6  # keys and values, 64 blocks each
    num_reads = 2000

    def unchanged() -> None:
        for _ in range(num_reads):
            pool.read(0, t, [(0, 1024)])

    sync = median_ms(unchanged, repeats, None) * 1e3 / num_reads
    steps = []
    for _ in range(32):  # each step: one more block (a decode step that crosses a block boundary)
        t.append(BS, [pool.allocator.allocate_one()])
        begin = time.perf_counter()
        pool.read(0, t, [(0, t.num_tokens)])
        steps.append(time.perf_counter() - begin)
    return per_block, sync, statistics.median(steps) * 1e6


def memory_kib() -> dict[str, int]:
    """Rss, Pss and Shmem of this process now, in KiB (``/proc/self/smaps_rollup``)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss", "Shmem") or name.startswith("Pss_"):
                fields[name] = int(rest.split()[0])
    return fields


def num_areas() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def areas_and_rss(num_seqs: int, num_layers: int, num_tokens: int) -> dict[str, float]:
    """A ``num_seqs`` x ``num_layers`` pool at ``num_tokens`` each, every table read once per layer.

    Returns blocks mapped, memory areas (``/proc/self/maps`` lines) and the
    budget's count before and after the reads, and Rss / Pss (MiB) after
    filling the pages, after mapping them, and after reading every page
    through the views: Rss counts a page once per mapping that touched it, so
    reading through views doubles it; Pss, the memory actually used, does not.
    """
    blocks = num_seqs * num_tokens // BS
    pool = KVPool(blocks, block_size=BS, num_kv_heads=H, head_dim=D, dtype=F32, num_layers=num_layers)
    tables = interleaved_tables(pool, num_seqs, num_tokens, np.random.default_rng(5))
    filled, areas_before, budget_before = memory_kib(), num_areas(), map_budget().num_used
    for t in tables:
        for layer in range(num_layers):
            pool.read(layer, t, [(0, num_tokens)])
    mapped = memory_kib()
    for t in tables:  # touch every page of every view once (a token's H x d values are one page here)
        for layer in range(num_layers):
            keys, values = pool.read(layer, t, [(0, num_tokens)])
            float(keys[:, 0, 0].sum() + values[:, 0, 0].sum())
    read = memory_kib()
    return {
        "mapped_blocks": pool.num_mapped_blocks,
        "areas_before": areas_before,
        "areas_after": num_areas(),
        "budget_used": map_budget().num_used - budget_before,
        "budget_limit": map_budget().limit,
        "page_file_mib": 2 * num_layers * blocks * BS * H * D * 4 / 2**20,
        "rss_filled_mib": filled["Rss"] / 1024,
        "rss_mapped_mib": mapped["Rss"] / 1024,
        "pss_filled_mib": filled["Pss"] / 1024,
        "pss_mapped_mib": mapped["Pss"] / 1024,
        "rss_read_mib": read["Rss"] / 1024,
        "pss_read_mib": read["Pss"] / 1024,
    }


def sweep(block_sizes: list[int], repeats: int, flush: Flusher, passes: int = 3) -> dict[str, list[float]]:
    """ms per call at each block size: the median over ``passes`` passes of each pass's median.

    NOTE: one pass over the sizes takes about 40 s, and the load on a shared
    machine drifts over that time more than a size changes the kernel (one
    run's contiguous column, which does not depend on the size, spread
    1.39-2.20 ms), so the passes alternate and their medians are combined.
    """
    cells: dict[int, list[dict[str, float]]] = {bs: [] for bs in block_sizes}
    for _ in range(passes):
        for bs in block_sizes:
            cells[bs].append(decode_rows(1, 4096, repeats, flush, block_size=bs))
    out: dict[str, list[float]] = {"block_size": [], "gather_ms": [], "view_ms": [], "contiguous_ms": []}
    for bs, runs in cells.items():
        gather, views, contiguous = (
            statistics.median(r[name] for r in runs) for name in ("gather", "views", "best contiguous")
        )
        out["block_size"].append(bs)
        out["gather_ms"].append(round(gather, 4))
        out["view_ms"].append(round(views, 4))
        out["contiguous_ms"].append(round(contiguous, 4))
        print(
            f"  block_size {bs:>3}: gather {gather:.2f} ms, views {views:.2f} ms, "
            f"contiguous {contiguous:.2f} ms (medians of {passes} passes)",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a 16k windowed stream")
    parser.add_argument(
        "--save",
        action="store_true",
        help="write the block-size sweep (g) to benchmarks/results/kernel_block_size.json",
    )
    args = parser.parse_args()
    if args.quick and args.save:
        # NOTE: the file is the measured record the simulator reads; a smoke run once overwrote it.
        parser.error("--save records the full block-size sweep; run it without --quick")
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
        young_us, old_us, held, maps = windowed(long, 1024)
        print(
            f"\n(d) windowed caches max_size=1024 on a shared views pool, stepped in turns: "
            f"{young_us:.0f} µs/token for one never older than 2k tokens, {old_us:.0f} µs/token late in a "
            f"{long // 1024}k stream ({old_us / young_us:.2f}x); blocks held at most {held} "
            f"(ceil(1024/16) + 1 = {math.ceil(1024 / BS) + 1}); {maps} blocks mapped over both streams"
        )
        per_block, sync, grown = mapping_costs(repeats)
        print(
            f"\n(e) mapping: {per_block:.1f} µs per newly mapped block (first read of a 1k-token table, "
            f"K and V); {sync:.1f} µs per read of an unchanged 1k-token table (a decode step within a "
            f"block); {grown:.1f} µs per read after a new block (K and V mapped)"
        )
        mem = areas_and_rss(64, 4, 1024)
        print(
            f"\n(f) 64 sequences x 4 layers x 1024 tokens ({mem['page_file_mib']:.0f} MiB of pages): "
            f"{mem['mapped_blocks']:.0f} blocks mapped; /proc/self/maps {mem['areas_before']:.0f} -> "
            f"{mem['areas_after']:.0f} lines; map budget {mem['budget_used']:.0f} areas charged of "
            f"{mem['budget_limit']:.0f}; filled -> mapped -> read through the views: Rss "
            f"{mem['rss_filled_mib']:.0f} -> {mem['rss_mapped_mib']:.0f} -> {mem['rss_read_mib']:.0f} MiB, "
            f"Pss {mem['pss_filled_mib']:.0f} -> {mem['pss_mapped_mib']:.0f} -> {mem['pss_read_mib']:.0f} MiB"
        )
        print("\n(g) block-size sweep, one sequence of 4096 tokens")
        passes = 1 if args.quick else 3
        result = sweep([1, 2, 4, 8, 16, 32, 64, 128, 256], repeats, flush, passes)
        print("\n(h) where the views' gap comes from: attend_dense on one sequence in five memories")
        pages = {f"{n // 1024}k tokens": page_rows(n, repeats, flush) for n in (4096, 16384)}
        names = list(next(iter(pages.values())))
        print(
            table(
                ["memory"] + [f"{label} (÷ first row)" for label in pages],
                [
                    [name] + [f"{r[name]:.2f} ms ({r[name] / r[names[0]]:.2f}x)" for r in pages.values()]
                    for name in names
                ],
            )
        )
    if args.save:
        machine = (
            f"{cpu_model()}, {os.cpu_count()} cores, BLAS 1 thread, cache-cold, medians of {passes} passes"
        )
        result["machine"] = machine  # type: ignore[assignment]
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\n  (g) written to {RESULTS}")
    else:
        print(f"\n  (g) not saved: pass --save to write it to {RESULTS}")
    print(footer())


if __name__ == "__main__":
    main()
