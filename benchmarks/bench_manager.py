"""Batched decode through ``KVCacheManager.attend`` against loops and contiguous arrays.

Run: ``python benchmarks/bench_manager.py`` (``--quick`` for a smoke run).

This file measures attention. The manager's bookkeeping per call (``reserve``,
``write``, admission, request cycles) against vLLM's own ``KVCacheManager``,
issue 13's targets, is measured by ``benchmarks/bench_requests.py``.

One decode step: each of ``--num-seqs`` sequences holds ``context - 1`` tokens
and reserves, writes and attends one new token (so every query attends to
``context`` tokens), ``num_kv_heads`` = ``num_q_heads`` = 8, ``head_dim`` 128,
float32, block_size 16, one layer, scale ``1/sqrt(head_dim)``. Every row below
attends the *same* numbers; each output is checked against the contiguous
per-sequence result before anything is timed.

Rows, side by side and interleaved round-robin within one run:

(a) ``manager.attend(0, batch, q, method="loop")`` (the default);
(b) ``manager.attend(0, batch, q, method="padded")``;
(b') prototype, this file: like (b) but gathering whole blocks
    (``np.take`` of block ids into a preallocated buffer) instead of slots;
(c1) a Python loop of 64 ``KVCache.attend`` calls, each cache on its own
    fixed pool (its blocks one run of ids, so zero-copy views). This call
    also appends the new token, so its context grows by one per timed call
    (printed);
(c2) a Python loop over the manager's tables: ``pool.gather`` (a view when
    the table is one run of ids, else a gather into scratch) then
    ``attend_dense``: the loop's kernel floor without the manager's checks;
(d1) contiguous: one ``(H, context, d)`` array per sequence, ``attend_dense``
    per sequence;
(d2) contiguous, batched: one matmul over a ``(num_seqs, H, context, d)`` array.

Pool states: *fresh* (each sequence prefilled in one reservation, so its blocks
are consecutive ids: zero-copy views) and *fragmented* (every sequence
reserved block by block, round-robin: sequence ``s`` holds ids ``s, S+s,
2S+s, ...``, so every attend gathers). A sweep over context lengths then
shows where the padded (vectorized) path stops winning.

BLAS is pinned to one thread for every row (``threadpoolctl``); timings are
medians of interleaved samples, each sample one whole decode step, in wall
clock and in CPU time (ratios use CPU time, which leaves out the time spent
waiting for a core on a shared machine). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from common import footer, header
from threadpoolctl import threadpool_limits

from pagedkv import KVCache, KVCacheManager, KVPool
from pagedkv.attention import attend_dense, attend_padded

BLOCK_SIZE = 16
NUM_HEADS = 8
HEAD_DIM = 128
DTYPE = np.float32

Array = npt.NDArray[Any]


# ----------------------------------------------------------------------------
# Kernels that are not in the library.
# ----------------------------------------------------------------------------


def attend_batched(queries: Array, keys: Array, values: Array, scale: float) -> Array:
    """Decode attention for many sequences of one length in one matmul each way.

    ``queries`` ``(S, H, d)``, ``keys``/``values`` ``(S, H, T, d)``; returns ``(S, H, d)``.
    """
    scores = np.matmul(queries[:, :, None, :], keys.transpose(0, 1, 3, 2))  # (S, H, 1, T)
    scores *= scale
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.matmul(scores, values)[:, :, 0, :]  # (S, H, d)


class BlockGatherPadded:
    """Prototype of ``method="padded"`` that gathers whole blocks, not slots.

    The block ids of every table, padded to the longest, index axis 1 of the
    ``(H, num_blocks, block_size, d)`` storage in one ``np.take`` per k and v
    into a buffer kept between calls: 1/block_size as many indices as the
    slot gather, each copying a contiguous ``block_size * d`` run. Valid for
    tables without sinks or evicted blocks (what this benchmark builds).
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._keys = np.empty(0, pool.dtype)
        self._values = np.empty(0, pool.dtype)

    def __call__(self, tables: list[Any], queries: Array, scale: float) -> Array:
        pool = self.pool
        num_blocks = [table.num_blocks for table in tables]
        width = max(num_blocks)
        ids = np.zeros((len(tables), width), np.intp)
        for row, table in enumerate(tables):
            ids[row, : num_blocks[row]] = table.block_ids
        shape = (pool.num_kv_heads, len(tables) * width, pool.block_size, pool.head_dim)
        size = math.prod(shape)
        if self._keys.size < size:
            self._keys = np.empty(size, pool.dtype)
            self._values = np.empty(size, pool.dtype)
        keys = self._keys[:size].reshape(shape)
        values = self._values[:size].reshape(shape)
        np.take(pool.keys(0), ids.ravel(), axis=1, out=keys, mode="clip")
        np.take(pool.values(0), ids.ravel(), axis=1, out=values, mode="clip")
        padded = (pool.num_kv_heads, len(tables), width * pool.block_size, pool.head_dim)
        lengths = np.array([table.num_tokens for table in tables])
        return attend_padded(queries, keys.reshape(padded), values.reshape(padded), lengths, scale)


# ----------------------------------------------------------------------------
# Building the states.
# ----------------------------------------------------------------------------


class Data:
    """The same tokens for every row: contiguous ``(S, H, T, d)`` k/v and ``(S, H, d)`` queries."""

    def __init__(self, num_seqs: int, context: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        shape = (num_seqs, NUM_HEADS, context, HEAD_DIM)
        self.keys = rng.standard_normal(shape, dtype=DTYPE)  # (S, H, T, d)
        self.values = rng.standard_normal(shape, dtype=DTYPE)
        self.queries = rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM), dtype=DTYPE)  # (S, H, d)
        # Tokens that KVCache rows append after the context (their context grows).
        self.extra_keys = rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM), dtype=DTYPE)
        self.extra_values = rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM), dtype=DTYPE)
        self.num_seqs, self.context = num_seqs, context
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def tokens(self, seqs: range | list[int], start: int, end: int) -> tuple[Array, Array]:
        """k/v of tokens ``start:end`` of ``seqs`` in batch order, ``(len(seqs) * n, H, d)``."""
        keys = self.keys[list(seqs), :, start:end].transpose(0, 2, 1, 3)  # (S, n, H, d)
        values = self.values[list(seqs), :, start:end].transpose(0, 2, 1, 3)
        flat = (-1, NUM_HEADS, HEAD_DIM)
        return keys.reshape(flat), values.reshape(flat)


def build_manager(data: Data, layout: str) -> tuple[KVCacheManager, Any]:
    """A manager holding ``context - 1`` tokens per sequence, plus the reserved decode batch."""
    num_seqs, context = data.num_seqs, data.context
    blocks_per_seq = -(-context // BLOCK_SIZE)
    pool = KVPool(
        num_seqs * blocks_per_seq + num_seqs,
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
    )
    manager = KVCacheManager(pool, num_q_heads=NUM_HEADS, scale=data.scale)
    seqs = range(num_seqs)
    for seq_id in seqs:
        manager.add_sequence(seq_id)
    prefill = context - 1
    if layout == "fresh":
        for seq_id in seqs:
            batch = manager.reserve({seq_id: prefill})
            manager.write(0, batch, *data.tokens([seq_id], 0, prefill))
    else:  # round-robin, one block's worth of tokens per sequence per step
        for start in range(0, prefill, BLOCK_SIZE):
            end = min(start + BLOCK_SIZE, prefill)
            batch = manager.reserve(dict.fromkeys(seqs, end - start))
            manager.write(0, batch, *data.tokens(seqs, start, end))
    batch = manager.reserve(dict.fromkeys(seqs, 1))
    manager.write(0, batch, *data.tokens(seqs, prefill, context))
    one_run = [manager.block_table(seq_id).is_one_run for seq_id in seqs]
    expected = layout == "fresh" or blocks_per_seq == 1
    if not all(run == expected for run in one_run):
        raise AssertionError(f"layout {layout!r}: is_one_run {one_run[:4]}..., expected {expected}")
    return manager, batch


def build_kvcaches(data: Data, num_extra: int) -> list[KVCache]:
    """One KVCache per sequence, each on its own fixed pool, holding ``context - 1`` tokens."""
    caches = []
    num_blocks = -(-(data.context + num_extra) // BLOCK_SIZE) + 1
    for seq_id in range(data.num_seqs):
        pool = KVPool(
            num_blocks, block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM, dtype=DTYPE
        )
        cache = KVCache(pool=pool, scale=data.scale)
        keys = data.keys[seq_id].transpose(1, 0, 2)  # (T, H, d)
        values = data.values[seq_id].transpose(1, 0, 2)
        zero_query = np.zeros((NUM_HEADS, HEAD_DIM), DTYPE)
        for position in range(data.context - 1):
            cache.attend(zero_query, keys[position], values[position])
        caches.append(cache)
    return caches


# ----------------------------------------------------------------------------
# Rows.
# ----------------------------------------------------------------------------


def rows_for(
    data: Data, manager: KVCacheManager, batch: Any, caches: list[KVCache] | None
) -> dict[str, Callable[[], Array]]:
    """The timed callables; each returns ``(S, H, d)`` outputs."""
    pool = manager.pool
    seqs = range(data.num_seqs)
    tables = [manager.block_table(seq_id) for seq_id in seqs]
    queries, scale = data.queries, data.scale
    keys, values = data.keys, data.values
    block_padded = BlockGatherPadded(pool)

    def loop() -> Array:
        return manager.attend(0, batch, queries, method="loop")

    def padded() -> Array:
        return manager.attend(0, batch, queries, method="padded")

    def padded_blocks() -> Array:
        return block_padded(tables, queries, scale)

    def gather_loop() -> Array:
        out = np.empty_like(queries)
        for row, table in enumerate(tables):
            k, v = pool.gather(0, table.read_plan())
            out[row] = attend_dense(queries[row], k, v, scale)
        return out

    def contiguous_loop() -> Array:
        out = np.empty_like(queries)
        for row in seqs:
            out[row] = attend_dense(queries[row], keys[row], values[row], scale)
        return out

    def contiguous_batched() -> Array:
        return attend_batched(queries, keys, values, scale)

    rows = {
        "(a) manager.attend loop": loop,
        "(b) manager.attend padded": padded,
        "(b') padded, block gather (prototype)": padded_blocks,
    }
    if caches is not None:
        extra_keys, extra_values = data.extra_keys, data.extra_values

        def kvcache_loop() -> Array:
            out = np.empty_like(queries)
            for row, cache in enumerate(caches):
                out[row] = cache.attend(queries[row], extra_keys[row], extra_values[row])
            return out

        rows["(c1) loop of KVCache.attend (own pools)"] = kvcache_loop
    rows["(c2) loop of pool.gather + attend_dense"] = gather_loop
    rows["(d1) contiguous, attend_dense per seq"] = contiguous_loop
    rows["(d2) contiguous, one batched matmul"] = contiguous_batched
    return rows


def check_rows(rows: dict[str, Callable[[], Array]], reference: Array) -> None:
    """Every row (except the KVCache one, whose context differs) matches the reference."""
    for name, fn in rows.items():
        if name.startswith("(c1)"):
            continue
        out = fn()
        if not np.allclose(out, reference, rtol=1e-4, atol=1e-5):
            worst = float(np.abs(out - reference).max())
            raise AssertionError(f"{name} differs from contiguous attend_dense by {worst:.3g}")


def time_rows(rows: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per call of each row, interleaved round-robin (the order rotates each round).

    NOTE: the CPU time (``time.process_time``; BLAS runs on this one thread)
    leaves out the time this process waits for a core, which on a shared
    2-core machine is most of the noise; the ratios use it.
    """
    names = list(rows)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for name in names:  # warm-up: scratch buffers, page faults
        rows[name]()
    gc.collect()
    gc.disable()
    try:
        for round_index in range(repeats):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                c0, t0 = time.process_time(), time.perf_counter()
                rows[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                samples[name].append((t1 - t0, c1 - c0))
    finally:
        gc.enable()
    return samples


def cpu_medians(samples: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    return {name: statistics.median(cpu for _, cpu in values) for name, values in samples.items()}


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def git_revision() -> str:
    """The checkout the numbers come from (the tree is shared and changes under us)."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5, check=False
        )
    except OSError:
        return "?"
    return done.stdout.strip() or "?"


def print_table(
    title: str, samples: dict[str, list[tuple[float, float]]], data: Data, baseline: str, notes: list[str]
) -> dict[str, float]:
    medians = cpu_medians(samples)
    num_bytes = 2 * data.num_seqs * data.context * NUM_HEADS * HEAD_DIM * np.dtype(DTYPE).itemsize
    loop = medians["(a) manager.attend loop"]
    print(f"\n### {title}\n")
    for note in notes:
        print(note)
    print()
    print("| row | wall ms (p25-p75) | CPU ms | us / seq | K+V GB/s | x (d1) contiguous | x (a) loop |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, values in samples.items():
        walls = [wall for wall, _ in values]
        wall = statistics.median(walls)
        q1, _, q3 = statistics.quantiles(walls, n=4) if len(walls) > 1 else (wall, 0, wall)
        median = medians[name]
        print(
            f"| {name} | {wall * 1e3:.2f} ({q1 * 1e3:.2f}-{q3 * 1e3:.2f}) | {median * 1e3:.2f} | "
            f"{median / data.num_seqs * 1e6:.1f} | {num_bytes / median / 1e9:.1f} | "
            f"{median / medians[baseline]:.2f} | {median / loop:.2f} |"
        )
    return medians


def run_case(
    data: Data, layout: str, repeats: int, caches: list[KVCache] | None, title: str, notes: list[str]
) -> dict[str, float]:
    manager, batch = build_manager(data, layout)
    rows = rows_for(data, manager, batch, caches)
    reference = rows["(d1) contiguous, attend_dense per seq"]()
    check_rows(rows, reference)
    samples = time_rows(rows, repeats)
    medians = print_table(title, samples, data, "(d1) contiguous, attend_dense per seq", notes)
    manager.check_invariants()
    del manager, batch, rows
    gc.collect()
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--short-context", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--sweep", default="32,64,128,256,512", help="contexts for the loop-vs-padded sweep")
    parser.add_argument("--quick", action="store_true", help="8 sequences, 2 repeats: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_seqs, args.repeats, args.sweep = 8, 2, "64"

    with threadpool_limits(limits=1, user_api="blas"):
        parameters = [
            f"parameters: {args.num_seqs} sequences, num_kv_heads = num_q_heads = {NUM_HEADS}, "
            f"head_dim {HEAD_DIM}, {np.dtype(DTYPE).name}, block_size {BLOCK_SIZE}, 1 layer, "
            "scale 1/sqrt(head_dim); one decode step per sample",
            f"timing: medians of {args.repeats} interleaved samples, wall clock and CPU time "
            "(process_time, which leaves out waiting for a core on this shared machine); "
            "us/seq, GB/s and every ratio from CPU time",
            f"checkout: git {git_revision()}",
        ]
        print(header("Batched decode (benchmarks/bench_manager.py)", parameters))
        summary = []
        for context in (args.context, args.short_context):
            data = Data(args.num_seqs, context)
            num_timed = 1 + 2 * (args.repeats + 1) if context > BLOCK_SIZE else 1 + (args.repeats + 1)
            t0 = time.perf_counter()
            caches = build_kvcaches(data, num_timed)
            first = np.stack([c.attend(data.queries[i], data.keys[i, :, -1], data.values[i, :, -1])
                              for i, c in enumerate(caches)])
            reference = np.stack([attend_dense(data.queries[i], data.keys[i], data.values[i], data.scale)
                                  for i in range(data.num_seqs)])
            if not np.allclose(first, reference, rtol=1e-4, atol=1e-5):
                raise AssertionError("KVCache output differs from contiguous attend_dense")
            build_s = time.perf_counter() - t0
            layouts = ("fresh", "fragmented") if context > BLOCK_SIZE else ("fresh",)
            for layout in layouts:
                grown = caches[0].num_tokens
                notes = [
                    f"context {context} tokens ({-(-context // BLOCK_SIZE)} block(s) per sequence); "
                    f"pool {layout}: "
                    + ("each table one run of ids (zero-copy views)" if layout == "fresh"
                       else "tables interleaved round-robin (every attend gathers)"),
                    f"(c1) contexts {grown + 2}-{grown + args.repeats + 1} (each call appends one token; "
                    f"{args.num_seqs} KVCache prefills took {build_s:.1f} s)",
                ]
                if context <= BLOCK_SIZE:
                    notes.append("one block per sequence: every table is one run, 'fragmented' cannot occur")
                title = f"context {context}, {layout} pool"
                medians = run_case(data, layout, args.repeats, caches, title, notes)
                summary.append((context, layout, medians))
            del caches, data
            gc.collect()

        sweep = [int(c) for c in args.sweep.split(",") if c]
        if sweep:
            print("\n### Sweep: loop vs padded by context length\n")
            print(
                f"({args.num_seqs} sequences, other parameters as above; "
                f"median CPU ms of {args.repeats} samples)\n"
            )
            print(
                "| context | pool | (a) loop | (b) padded | (b') block-gather padded | "
                "(d1) contiguous/seq | (d2) contiguous batched | (b)/(a) | (b')/(a) |"
            )
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
            for context in sweep:
                data = Data(args.num_seqs, context)
                for layout in ("fresh", "fragmented"):
                    manager, batch = build_manager(data, layout)
                    rows = rows_for(data, manager, batch, None)
                    rows.pop("(c2) loop of pool.gather + attend_dense")
                    check_rows(rows, rows["(d1) contiguous, attend_dense per seq"]())
                    med = cpu_medians(time_rows(rows, args.repeats))
                    summary.append((context, layout, med))
                    del manager, batch, rows
                del data
                gc.collect()
            for context, layout, med in sorted(summary, key=lambda item: (item[0], item[1])):
                a = med["(a) manager.attend loop"]
                b = med["(b) manager.attend padded"]
                b2 = med["(b') padded, block gather (prototype)"]
                print(
                    f"| {context} | {layout} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b2 * 1e3:.2f} | "
                    f"{med['(d1) contiguous, attend_dense per seq'] * 1e3:.2f} | "
                    f"{med['(d2) contiguous, one batched matmul'] * 1e3:.2f} | {b / a:.2f} | {b2 / a:.2f} |"
                )
        print()
        print(footer())


if __name__ == "__main__":
    main(sys.argv[1:])
