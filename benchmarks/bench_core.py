"""Core speed of pagedkv, measured side by side in one run; prints tables, asserts nothing.

(a) Seed-sized calls: head_dim 1, Python lists in and out. Microseconds per
    ``attend`` for ``KVCache`` and for the pure-Python oracle
    ``pagedkv.testing.oracle.OracleCache``, over streams of a few lengths.
(b) Numpy calls, H=8 heads, head_dim 128, float32, at 1k, 4k and 16k cached
    tokens: the paged ``KVCache`` on its private pool (its table is one run of
    block ids, read as a zero-copy view); the paged cache on a shared pool
    where a second cache took turns with it (its table is not one run: the
    pool's default ``view_mode`` reads it through mapped page views where
    the platform has them, else gathers into scratch); the no-cache recompute of the same step
    (``pagedkv.reference.attend_window``, rebuilding dense arrays from the
    token history); and a contiguous cache (one preallocated
    ``(H, max_tokens, d)`` array per K and V, appended in place) with two
    kernels: ``attend_dense`` (the library's, BLAS gemv through matmul) and an
    einsum kernel (``benchmarks/candidates.py``), the faster of which is "best
    contiguous".
(c) A windowed cache, ``max_size=1024``: per-token time at the end of a
    1.25k-token stream (its window just full) vs at the end of a 64k-token
    stream, both attending to 1024 tokens a call.
(d) Its memory: peak RSS and pool size after 10k vs after 1M tokens (measured
    in a fresh child process, with head_dim 8 so the run is short).

Pre-filling n tokens through ``attend`` costs O(n^2) attention, so (b) fills
its caches through the real ``attend`` with the attention itself switched off
(``attention_skipped`` below: every check, eviction, block allocation, pool
growth, compaction and write still runs). The timed calls then run the real
``attend``, and their outputs are checked bit for bit against the recompute,
which proves the pre-filled state is the real one.

Run: ``python benchmarks/bench_core.py [--quick]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
from candidates import attend_einsum
from common import (
    CLOCKS,
    Flusher,
    footer,
    format_us,
    header,
    median_us,
    now,
    table,
    time_once,
    use_clock,
)
from threadpoolctl import threadpool_limits

import pagedkv.attention as attention_module
from pagedkv import KVCache, KVPool
from pagedkv.attention import attend_dense
from pagedkv.reference import attend_window
from pagedkv.testing.oracle import OracleCache

NUM_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = np.float32
SCALE = 1.0 / math.sqrt(HEAD_DIM)
WINDOW = 1024
TAIL = 256  # the last tokens of each stream that (c) times


@contextlib.contextmanager
def attention_skipped() -> Iterator[None]:
    """Make ``KVCache.attend`` do all its bookkeeping but no attention (for pre-filling)."""
    saved_kernel, saved_gather = attention_module.attend_dense, KVPool.gather

    def no_gather(self: KVPool, layer: int, table: object) -> tuple[np.ndarray, np.ndarray]:
        empty = np.empty((self.num_kv_heads, 0, self.head_dim), self.dtype)
        return empty, empty

    attention_module.attend_dense = lambda query, keys, values, scale=1.0: np.zeros_like(query)
    KVPool.gather = no_gather  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        attention_module.attend_dense = saved_kernel
        KVPool.gather = saved_gather  # type: ignore[method-assign]


# --------------------------------------------------------------------- (a)


def _stream(cache: KVCache | OracleCache, tokens: list[tuple[list[float], ...]]) -> None:
    for q, k, v in tokens:
        cache.attend(q, k, v)


def seed_sized(lengths: list[int], repeats: int) -> str:
    """Table (a): µs per attend call, head_dim 1, lists, KVCache vs OracleCache."""
    rng = np.random.default_rng(1)
    rows = []
    for length in lengths:
        stream = rng.standard_normal((length, 3)).tolist()
        tokens = [([q], [k], [v]) for q, k, v in stream]
        timings: dict[str, list[float]] = {"KVCache": [], "OracleCache": []}
        for _ in range(repeats):
            for name, make in (("KVCache", KVCache), ("OracleCache", OracleCache)):
                elapsed = time_once(lambda make=make, tokens=tokens: _stream(make(), tokens))
                timings[name].append(elapsed / length)
        paged, oracle = median_us(timings["KVCache"]), median_us(timings["OracleCache"])
        rows.append([f"{length}", f"{paged:.1f} µs", f"{oracle:.1f} µs", f"{oracle / paged:.1f}x"])
    return table(
        ["stream length", "KVCache", "OracleCache (pure Python)", "oracle / KVCache"], rows
    )


# --------------------------------------------------------------------- (b)


class Contiguous:
    """One preallocated ``(H, max_tokens, d)`` array per K and V; append writes in place."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, num_filled: int,
                 kernel: Callable[..., np.ndarray]) -> None:
        num_max = len(keys)
        self.keys = np.zeros((NUM_HEADS, num_max, HEAD_DIM), DTYPE)  # (H, max_tokens, d)
        self.values = np.zeros_like(self.keys)
        self.keys[:, :num_filled] = keys[:num_filled].transpose(1, 0, 2)
        self.values[:, :num_filled] = values[:num_filled].transpose(1, 0, 2)
        self.length = num_filled
        self.kernel = kernel

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        self.keys[:, self.length] = k
        self.values[:, self.length] = v
        self.length += 1
        n = self.length
        return self.kernel(q, self.keys[:, :n], self.values[:, :n], SCALE)


NAMES = [
    "contiguous, attend_dense kernel",
    "contiguous, einsum kernel",
    "paged, private pool (one-run view)",
    "paged, shared fragmented pool (default view_mode)",
    "no-cache recompute (attend_window)",
]


def measure_size(
    n: int, repeats: int, flush: Flusher, rng: np.random.Generator
) -> tuple[dict[str, list[float]], bool, float, str]:
    """Time every variant of (b) at ``n`` cached tokens.

    Returns:
        Seconds per timed call for each variant, whether the bit-exact check
        held at every call, the einsum kernel's largest deviation, and a note
        on the two paged tables.
    """
    total = n + repeats + 1  # pre-filled, one warm-up call, the timed calls
    shape = (total, NUM_HEADS, HEAD_DIM)
    hq = rng.standard_normal(shape, dtype=DTYPE)  # (tokens, H, d)
    hk = rng.standard_normal(shape, dtype=DTYPE)
    hv = rng.standard_normal(shape, dtype=DTYPE)

    private = KVCache(dtype=DTYPE, scale=SCALE)
    num_blocks = 2 * (-(-total // BLOCK_SIZE)) + 2
    pool = KVPool(num_blocks, block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS,
                  head_dim=HEAD_DIM, dtype=DTYPE)
    fragmented = KVCache(pool=pool, scale=SCALE)
    other = KVCache(pool=pool, scale=SCALE)
    with attention_skipped():
        for t in range(n):
            private.attend(hq[t], hk[t], hv[t])
            other.attend(hq[t], hk[t], hv[t])  # takes turns: neither table is one run
            fragmented.attend(hq[t], hk[t], hv[t])
    contiguous = Contiguous(hk, hv, n, attend_dense)
    contiguous_einsum = Contiguous(hk, hv, n, attend_einsum)

    def step_recompute(t: int) -> np.ndarray:
        return attend_window(hq[t], hk[: t + 1], hv[: t + 1], scale=SCALE, dtype=DTYPE)

    steps: dict[str, Callable[[int], np.ndarray]] = {
        NAMES[0]: lambda t: contiguous.attend(hq[t], hk[t], hv[t]),
        NAMES[1]: lambda t: contiguous_einsum.attend(hq[t], hk[t], hv[t]),
        NAMES[2]: lambda t: private.attend(hq[t], hk[t], hv[t]),
        NAMES[3]: lambda t: fragmented.attend(hq[t], hk[t], hv[t]),
        NAMES[4]: step_recompute,
    }
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    exact = True
    einsum_error = 0.0
    for call in range(repeats + 1):
        t = n + call
        order = NAMES[call % len(NAMES) :] + NAMES[: call % len(NAMES)]
        outputs = {}
        for name in order:
            flush()
            start = now()
            outputs[name] = steps[name](t)
            elapsed = now() - start
            if call:  # call 0 is the warm-up (it may also grow the private pool)
                samples[name].append(elapsed)
        expected = outputs[NAMES[4]]
        for name in (NAMES[0], NAMES[2], NAMES[3]):
            exact = exact and np.array_equal(outputs[name], expected)
        einsum_error = max(einsum_error, float(np.abs(outputs[NAMES[1]] - expected).max()))
    private_pool = private.pool.num_blocks if private.pool else 0
    note = (
        f"n={n}: private table one run: {private.block_table.is_one_run} "
        f"({private.num_blocks} blocks, private pool {private_pool}); "
        f"fragmented table one run: {fragmented.block_table.is_one_run} "
        f"({fragmented.num_blocks} blocks of a {pool.num_blocks}-block pool)"
    )
    for cache in (private, fragmented, other):
        cache.close()
    return samples, exact, einsum_error, note


def numpy_calls(sizes: list[int], repeats: int, flush: Flusher) -> tuple[str, list[str]]:
    """Table (b) and the notes under it."""
    rng = np.random.default_rng(2)
    names = NAMES
    results: dict[str, dict[int, float]] = {name: {} for name in names}
    notes = []
    all_exact = True
    max_einsum_error = 0.0
    for n in sizes:
        samples, exact, einsum_error, note = measure_size(n, repeats, flush, rng)
        gc.collect()
        all_exact = all_exact and exact
        max_einsum_error = max(max_einsum_error, einsum_error)
        notes.append(note)
        for name in names:
            results[name][n] = median_us(samples[name])

    best = {n: min(results[names[0]][n], results[names[1]][n]) for n in sizes}
    dense = results[names[0]]
    columns = ["variant", *(f"{n // 1024}k tokens" for n in sizes),
               *(f"÷ best contig. {n // 1024}k" for n in sizes),
               *(f"÷ contig. attend_dense {n // 1024}k" for n in sizes)]
    rows = []
    for name in names:
        per_size = results[name]
        rows.append([
            name,
            *(format_us(per_size[n]) for n in sizes),
            *(f"{per_size[n] / best[n]:.2f}x" for n in sizes),
            *(f"{per_size[n] / dense[n]:.2f}x" for n in sizes),
        ])
    notes.append(
        "bit-exact: paged (private), paged (fragmented) and contiguous attend_dense outputs "
        f"equal the recompute bit for bit at every timed call: {'yes' if all_exact else 'NO'}; "
        f"einsum kernel differs from it by at most {max_einsum_error:.1e} (another summation order)"
    )
    for name in names[2:4]:
        verdicts = []
        for n in sizes:
            if n < 4096:
                continue
            ratio = results[name][n] / best[n]
            verdicts.append(f"{n // 1024}k {ratio:.2f}x {'met' if ratio <= 1.2 else 'NOT met'}")
        notes.append(f"target (issue 12) <= 1.2x best contiguous at 4k and 16k, {name}: "
                     + ", ".join(verdicts))
    return table(columns, rows), notes


# --------------------------------------------------------------------- (c)


def windowed_stream(long_length: int) -> tuple[str, list[str]]:
    """Table (c): per-token time at the end of a 1.25k-token and a long stream, max_size 1024.

    NOTE: both streams' timed calls attend to exactly ``WINDOW`` tokens. A
    stream timed before its window fills (tokens 769-1024) attends to fewer
    keys than ``attend_dense``'s einsum threshold (4 MiB, 1024 tokens at this
    shape) and runs BLAS, which is faster on warm keys (163 us at 1,023 tokens
    against 279 us at 1,024): that ratio measured the kernel switch, 1.35-1.64x
    on a Zen 5 machine, not the stream's age.
    """
    rng = np.random.default_rng(3)
    ring = rng.standard_normal((4096, 3, NUM_HEADS, HEAD_DIM), dtype=DTYPE)  # reused tokens
    long_cache = KVCache(WINDOW, block_size=BLOCK_SIZE, dtype=DTYPE, scale=SCALE)
    short_cache = KVCache(WINDOW, block_size=BLOCK_SIZE, dtype=DTYPE, scale=SCALE)
    short_length = WINDOW + TAIL
    for t in range(long_length - short_length):
        token = ring[t % len(ring)]
        long_cache.attend(token[0], token[1], token[2])
    timings: dict[str, list[float]] = {"short": [], "long": []}
    attended: dict[str, list[int]] = {"short": [], "long": []}
    for i in range(short_length):
        pairs = [("long", long_cache, long_length - short_length + i), ("short", short_cache, i)]
        if i % 2:
            pairs.reverse()
        for name, cache, t in pairs:
            token = ring[t % len(ring)]
            start = now()
            cache.attend(token[0], token[1], token[2])
            elapsed = now() - start
            if i >= short_length - TAIL:
                timings[name].append(elapsed)
                attended[name].append(len(cache))
    rows = []
    for name, length, cache in (("short", short_length, short_cache),
                                ("long", long_length, long_cache)):
        samples = np.array(timings[name]) * 1e6
        pool = cache.pool
        num_pool_blocks = pool.num_blocks if pool else 0
        pool_mib = num_pool_blocks * (pool.bytes_per_block if pool else 0) / 2**20
        rows.append([
            f"{length:,}-token stream",
            f"{int(min(attended[name]))}-{int(max(attended[name]))}",
            format_us(float(np.median(samples))),
            format_us(float(samples.mean())),
            format_us(float(samples.max())),
            f"{cache.num_blocks}",
            f"{num_pool_blocks} ({pool_mib:.1f} MiB)",
        ])
    ratio = float(np.median(timings["long"]) / np.median(timings["short"]))
    mean_ratio = float(np.mean(timings["long"]) / np.mean(timings["short"]))
    notes = [
        f"per-token time: the time of one attend call (append, evict, attend over the window), "
        f"over the last {TAIL} tokens of each stream (tokens {short_length - TAIL + 1}-{short_length} "
        f"of the short stream, {long_length - TAIL + 1}-{long_length} of the long one); the two "
        f"streams' last {short_length} tokens take turns, call by call, so both see the same machine state; "
        "no cache flush (each cache, 8 MiB, stays in L3)",
        f"ratio long / short: median {ratio:.2f} (target <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'}), "
        f"mean {mean_ratio:.2f}",
        "both streams' timed calls attend to the full window, so both run the same kernel "
        "(einsum from 4 MiB of keys; a stream timed before its window fills would run BLAS)",
    ]
    long_cache.close()
    short_cache.close()
    cols = ["stream", "tokens attended", "median", "mean", "max", "blocks held", "pool blocks"]
    return table(cols, rows), notes


# --------------------------------------------------------------------- (d)


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


_MEMORY_FIELDS = ("tokens", "peak_rss_kib", "rss_kib", "pool_blocks", "pool_bytes",
                  "blocks_held", "allocated_blocks", "seconds")


def memory_child(total: int) -> None:
    """Stream ``total`` tokens through a windowed cache; print JSON at 10k, 100k and the end."""
    head_dim, num_heads = 8, 1
    rng = np.random.default_rng(4)
    ring = rng.standard_normal((4096, 3, num_heads, head_dim), dtype=DTYPE)
    cache = KVCache(WINDOW, block_size=BLOCK_SIZE, dtype=DTYPE)
    checkpoints = sorted({10_000, min(100_000, total), total})
    # Preallocated, so recording a checkpoint allocates nothing that outlives it
    # (a record built after the first reading would itself show up in the next).
    readings = np.zeros((len(checkpoints) + 1, len(_MEMORY_FIELDS)))
    start = time.perf_counter()

    def record(row: int, num_tokens: int) -> None:
        pool = cache.pool
        assert pool is not None
        # sys.getallocatedblocks allocates nothing (gc.get_objects would)
        readings[row, 6] = sys.getallocatedblocks()
        readings[row, 1] = _status_kib("VmHWM")
        readings[row, 2] = _status_kib("VmRSS")
        readings[row, 0] = num_tokens
        readings[row, 3] = pool.num_blocks
        readings[row, 4] = pool.num_blocks * pool.bytes_per_block
        readings[row, 5] = cache.num_blocks
        readings[row, 7] = time.perf_counter() - start

    next_index = 0
    with threadpool_limits(1):
        for t in range(total):
            token = ring[t & 4095]
            cache.attend(token[0], token[1], token[2])
            if t == 0:
                record(len(checkpoints), 1)  # a dry run: first calls set up objects that stay
            if t + 1 == checkpoints[next_index]:
                record(next_index, t + 1)
                next_index = min(next_index + 1, len(checkpoints) - 1)
    records = [
        {name: (float(value) if name == "seconds" else int(value))
         for name, value in zip(_MEMORY_FIELDS, row)}
        for row in readings[: len(checkpoints)]
    ]
    print(json.dumps(records))


def memory_flat(total: int) -> tuple[str, list[str]]:
    """Table (d), from a fresh child process."""
    result = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(total)],
        capture_output=True, text=True, check=True,
    )
    records = json.loads(result.stdout)
    rows = [[
        f"{r['tokens']:,}",
        f"{r['peak_rss_kib'] / 1024:.1f} MiB",
        f"{r['rss_kib'] / 1024:.1f} MiB",
        f"{r['pool_blocks']} ({r['pool_bytes'] / 1024:.0f} KiB)",
        f"{r['blocks_held']}",
        f"{r['allocated_blocks']:,}",
        f"{r['seconds']:.1f} s",
    ] for r in records]
    first, middle, last = records[0], records[len(records) // 2], records[-1]
    grew = last["peak_rss_kib"] - first["peak_rss_kib"]
    grew_late = last["peak_rss_kib"] - middle["peak_rss_kib"]
    flat = grew <= 0 and last["pool_blocks"] <= first["pool_blocks"]
    verdict = "met" if flat else "NOT met"
    notes = [
        "measured: VmHWM (peak resident set) and VmRSS from /proc/self/status of a fresh child "
        "process, the private pool's blocks and bytes (keys + values), blocks the cache holds, "
        "and sys.getallocatedblocks() (live Python-heap objects); parameters: max_size 1024, "
        "block_size 16, 1 head, head_dim 8, float32",
        f"peak RSS after {last['tokens']:,} vs after {first['tokens']:,} tokens: "
        f"{'+' if grew >= 0 else ''}{grew} KiB; pool {last['pool_blocks']} vs {first['pool_blocks']} "
        f"blocks (target, no higher: {verdict}); from {middle['tokens']:,} to {last['tokens']:,} "
        f"tokens: {'+' if grew_late >= 0 else ''}{grew_late} KiB",
    ]
    cols = ["tokens streamed", "peak RSS", "RSS", "pool blocks", "blocks held",
            "Python heap blocks", "elapsed"]
    return table(cols, rows), notes


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Print tables (a) to (d)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions, a 16k-token long stream, 200k tokens for (d)")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (default) or cpu: this thread's CPU time, for a loaded machine")
    args = parser.parse_args(argv)
    clock = use_clock(args.clock)
    if args.memory_child is not None:
        memory_child(args.memory_child)
        return 0
    sizes = [1024, 4096, 16384]
    repeats = 7 if args.quick else 15
    seed_lengths = [16, 256, 1024]
    long_length = 16384 if args.quick else 65536
    memory_total = 200_000 if args.quick else 1_000_000
    print(header(
        "bench_core.py: pagedkv core speed" + (" (--quick)" if args.quick else ""),
        [
            f"(a) head_dim 1, Python lists, float64, unbounded KVCache (block_size 16); streams of "
            f"{seed_lengths} tokens through a fresh cache; µs per call = stream time / length; "
            f"median of {max(3, repeats // 3)} streams",
            f"(b) H={NUM_HEADS} q and kv heads, head_dim={HEAD_DIM}, float32, block_size={BLOCK_SIZE}, "
            f"scale=1/sqrt(head_dim); n in {sizes} tokens cached, then one warm-up call and "
            f"{repeats} timed calls (each appends a token: they see n+2 .. n+{repeats + 1} tokens); "
            "each call cache-cold (64 MiB written first); variants take turns; medians",
            f"(c) max_size={WINDOW}, same heads/head_dim/dtype, private pool; "
            f"{WINDOW + TAIL:,}-token stream vs {long_length // 1024}k-token stream",
            f"(d) max_size={WINDOW}, head_dim 8, 1 head; {memory_total:,} tokens",
            f"clock for (a)-(c): {clock}",
        ],
    ))
    flush = Flusher()
    with threadpool_limits(1):
        print("\n## (a) seed-sized calls: µs per attend, head_dim 1, lists\n")
        print(seed_sized(seed_lengths, max(3, repeats // 3)))
        print("\n## (b) numpy calls: time per attend call, H=8, head_dim 128, float32\n")
        text, notes = numpy_calls(sizes, repeats, flush)
        print(text)
        print()
        print("\n".join(f"- {note}" for note in notes))
        print(f"\n## (c) windowed cache, max_size {WINDOW}: per-token time as the stream grows\n")
        text, notes = windowed_stream(long_length)
        print(text)
        print()
        print("\n".join(f"- {note}" for note in notes))
    print(f"\n## (d) windowed cache, max_size {WINDOW}: memory as the stream grows\n")
    text, notes = memory_flat(memory_total)
    print(text)
    print()
    print("\n".join(f"- {note}" for note in notes))
    print()
    print(footer())
    return 0


if __name__ == "__main__":
    sys.exit(main())
