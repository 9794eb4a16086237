"""The measurement behind pagedkv's storage layout: decode attention over paged storage.

One query token (H=8 heads, head_dim 128, float32) attends over n cached
tokens (1k, 4k, 16k) held in 16-token blocks laid out three ways:

* head-major ``(num_kv_heads, num_blocks, block_size, head_dim)`` — pagedkv's
  choice: a table whose ids form one run is a zero-copy ``(H, n, d)`` view,
  each head's tokens contiguous;
* token-major / NHD ``(num_blocks, block_size, num_kv_heads, head_dim)`` (vLLM's
  CPU layout): a one-run view exists, but each head's rows are strided;
* block-major HND ``(num_blocks, num_kv_heads, block_size, head_dim)``: each
  block holds all heads, so a head's tokens are never one array; it needs a
  gather or one small matmul per block and head.

and, for a fragmented table (every other block of the pool, as when two
sequences take turns), gathers on the head-major pool: pagedkv's
``KVPool.gather`` (``np.take(..., out=scratch, mode="clip")``), ``np.take``
with the default ``mode="raise"``, fancy indexing, the candidate per-head
gathers of ``benchmarks/candidates.py``, and (vi) both fragmented paths with the
einsum kernel of ``candidates.py`` instead of ``attend_dense``.

Every call is timed cache-cold (64 MiB written before it) and the variants
take turns within each repetition; the table shows medians. "bit-exact" says
whether the output equals ``pagedkv.reference.attend_window`` (the contract's
no-cache recompute) bit for bit. Nothing here is asserted; it only prints.

It also measured ``pagedkv.attention.EINSUM_MIN_BYTES`` (the BLAS/einsum
switch at 8 MiB of keys). On a 2-vCPU AMD EPYC (Zen 4), OpenBLAS 0.3.31
(SkylakeX kernel), one thread, H=8, head_dim 128, float32: gemv streamed keys
at 11-14 GB/s and einsum was 1.6-1.8x faster from 8 MiB of keys on, warm or
cold (2k tokens: 757 vs 611 us warm, 1.31 vs 0.74 ms cold; 16k: 10.5 vs
6.1 ms); with 4 MiB of keys that stay in cache BLAS was faster (1k tokens
warm: 165 vs 331 us).

Run: ``python benchmarks/bench_layout.py [--quick]``
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import numpy as np
from candidates import attend_einsum, attend_per_head, attend_per_head_staged, check_bit_exact
from common import (
    CLOCKS,
    Flusher,
    footer,
    format_us,
    header,
    median_us,
    table,
    time_once,
    use_clock,
)
from threadpoolctl import threadpool_limits

from pagedkv import BlockTable, KVPool
from pagedkv.attention import attend_dense
from pagedkv.reference import attend_window

NUM_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPE = np.float32
SCALE = 1.0 / math.sqrt(HEAD_DIM)

Variant = tuple[str, str, Callable[[], np.ndarray]]


def build_variants(num_tokens: int, rng: np.random.Generator) -> tuple[list[Variant], np.ndarray]:
    """Every layout and gather variant over the same ``num_tokens`` tokens; and the reference."""
    h, d, bs = NUM_HEADS, HEAD_DIM, BLOCK_SIZE
    num_held = num_tokens // bs
    keys = rng.standard_normal((num_tokens, h, d), dtype=DTYPE)  # (n, H, d), token order
    values = rng.standard_normal((num_tokens, h, d), dtype=DTYPE)
    query = rng.standard_normal((h, d), dtype=DTYPE)
    reference = attend_window(query, keys, values, scale=SCALE, dtype=DTYPE)

    # Head-major pool, one run: blocks 1 .. num_held of a real KVPool.
    run_pool = KVPool(num_held + 2, block_size=bs, num_kv_heads=h, head_dim=d, dtype=DTYPE)
    run_table = _fill(run_pool, keys, values, num_held, stride=1)

    # Head-major pool, fragmented: every other block (ids 1, 3, 5, ...).
    frag_pool = KVPool(2 * num_held + 2, block_size=bs, num_kv_heads=h, head_dim=d, dtype=DTYPE)
    frag_table = _fill(frag_pool, keys, values, num_held, stride=2)
    frag_ids = np.array(frag_table.block_ids, np.intp)
    frag_keys, frag_values = frag_pool.keys(0), frag_pool.values(0)
    take_keys = np.empty((h, num_held, bs, d), DTYPE)
    take_values = np.empty_like(take_keys)

    # Token-major (NHD) pool (num_blocks, block_size, H, d), one run at blocks 1 .. num_held.
    nhd_keys = np.zeros((num_held + 2, bs, h, d), DTYPE)
    nhd_values = np.zeros_like(nhd_keys)
    nhd_keys[1 : num_held + 1] = keys.reshape(num_held, bs, h, d)
    nhd_values[1 : num_held + 1] = values.reshape(num_held, bs, h, d)

    # Token-major (NHD) pool, fragmented like frag_pool: data in blocks 1, 3, 5, ...
    nhd_frag_keys = np.zeros((2 * num_held + 2, bs, h, d), DTYPE)
    nhd_frag_values = np.zeros_like(nhd_frag_keys)
    nhd_frag_keys[frag_ids] = keys.reshape(num_held, bs, h, d)
    nhd_frag_values[frag_ids] = values.reshape(num_held, bs, h, d)
    nhd_take_keys = np.empty((num_held, bs, h, d), DTYPE)
    nhd_take_values = np.empty_like(nhd_take_keys)

    # Block-major (HND) pool (num_blocks, H, block_size, d), one run at blocks 1 .. num_held.
    bm_keys = np.zeros((num_held + 2, h, bs, d), DTYPE)
    bm_values = np.zeros_like(bm_keys)
    bm_keys[1 : num_held + 1] = keys.reshape(num_held, bs, h, d).transpose(0, 2, 1, 3)
    bm_values[1 : num_held + 1] = values.reshape(num_held, bs, h, d).transpose(0, 2, 1, 3)
    scratch_keys = np.empty((h, num_tokens, d), DTYPE)
    scratch_values = np.empty_like(scratch_keys)

    def head_major_view() -> np.ndarray:
        return attend_dense(query, *run_pool.gather(0, run_table.read_plan()), SCALE)

    def head_major_view_einsum() -> np.ndarray:
        return attend_einsum(query, *run_pool.gather(0, run_table.read_plan()), SCALE)

    def nhd_views() -> tuple[np.ndarray, np.ndarray]:
        k = nhd_keys[1 : num_held + 1].reshape(num_tokens, h, d).transpose(1, 0, 2)  # (H, n, d) view
        v = nhd_values[1 : num_held + 1].reshape(num_tokens, h, d).transpose(1, 0, 2)
        return k, v

    def nhd_view() -> np.ndarray:
        return attend_dense(query, *nhd_views(), SCALE)

    def nhd_view_einsum() -> np.ndarray:
        return attend_einsum(query, *nhd_views(), SCALE)

    def nhd_copy() -> np.ndarray:
        k, v = nhd_views()
        np.copyto(scratch_keys, k)
        np.copyto(scratch_values, v)
        return attend_dense(query, scratch_keys, scratch_values, SCALE)

    def bm_copy() -> np.ndarray:
        k = bm_keys[1 : num_held + 1].transpose(1, 0, 2, 3)  # (H, num_held, bs, d) view
        v = bm_values[1 : num_held + 1].transpose(1, 0, 2, 3)
        np.copyto(scratch_keys.reshape(h, num_held, bs, d), k)
        np.copyto(scratch_values.reshape(h, num_held, bs, d), v)
        return attend_dense(query, scratch_keys, scratch_values, SCALE)

    def bm_per_block() -> np.ndarray:
        k, v = bm_keys[1 : num_held + 1], bm_values[1 : num_held + 1]  # (num_held, H, bs, d)
        scores = np.matmul(k, query[:, :, None])  # (num_held, H, bs, 1): one gemv per block and head
        scores = scores.reshape(num_held, h, bs).transpose(1, 0, 2).reshape(h, 1, num_tokens)
        scores = scores * SCALE
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        weights = scores.reshape(h, num_held, 1, bs).transpose(1, 0, 2, 3)  # (num_held, H, 1, bs)
        partial = np.matmul(weights, v)  # (num_held, H, 1, d)
        return partial.sum(axis=0).reshape(h, d)

    def bm_einsum() -> np.ndarray:
        k, v = bm_keys[1 : num_held + 1], bm_values[1 : num_held + 1]  # (num_held, H, bs, d)
        scores = np.einsum("hd,bhtd->hbt", query, k) * SCALE  # (H, num_held, bs)
        scores -= scores.max(axis=(1, 2), keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=(1, 2), keepdims=True)
        return np.einsum("hbt,bhtd->hd", scores, v)

    def frag_library() -> np.ndarray:
        return attend_dense(query, *frag_pool.gather(0, frag_table.read_plan()), SCALE)

    def frag_take_raise() -> np.ndarray:
        np.take(frag_keys, frag_ids, axis=1, out=take_keys)
        np.take(frag_values, frag_ids, axis=1, out=take_values)
        shape = (h, num_tokens, d)
        return attend_dense(query, take_keys.reshape(shape), take_values.reshape(shape), SCALE)

    def frag_fancy() -> np.ndarray:
        shape = (h, num_tokens, d)
        k = frag_keys[:, frag_ids].reshape(shape)  # a fresh (H, n, d) copy
        v = frag_values[:, frag_ids].reshape(shape)
        return attend_dense(query, k, v, SCALE)

    def frag_nhd_take() -> np.ndarray:
        np.take(nhd_frag_keys, frag_ids, axis=0, out=nhd_take_keys, mode="clip")
        np.take(nhd_frag_values, frag_ids, axis=0, out=nhd_take_values, mode="clip")
        k = nhd_take_keys.reshape(num_tokens, h, d).transpose(1, 0, 2)  # (H, n, d), strided rows
        v = nhd_take_values.reshape(num_tokens, h, d).transpose(1, 0, 2)
        return attend_dense(query, k, v, SCALE)

    def frag_per_head() -> np.ndarray:
        return attend_per_head(frag_pool, frag_table, query, SCALE)

    def frag_per_head_staged() -> np.ndarray:
        return attend_per_head_staged(frag_pool, frag_table, query, SCALE)

    def frag_library_einsum() -> np.ndarray:
        return attend_einsum(query, *frag_pool.gather(0, frag_table.read_plan()), SCALE)

    def frag_per_head_einsum() -> np.ndarray:
        return attend_per_head(frag_pool, frag_table, query, SCALE, kernel=attend_einsum)

    variants: list[Variant] = [
        ("(i)", "head-major (H, blocks, bs, d), one-run view [pagedkv]", head_major_view),
        ("(i')", "head-major one-run view, einsum kernel", head_major_view_einsum),
        ("(ii)", "token-major NHD (blocks, bs, H, d), one-run view", nhd_view),
        ("(ii')", "token-major NHD one-run view, einsum kernel", nhd_view_einsum),
        ("(ii'')", "token-major NHD, copied head-major into scratch", nhd_copy),
        ("(iii)", "block-major HND (blocks, H, bs, d), copied into scratch", bm_copy),
        ("(iii')", "block-major HND, one matmul per block and head", bm_per_block),
        ("(iii'')", "block-major HND, einsum over blocks", bm_einsum),
        ("(iv)", "fragmented: np.take(out=, mode='clip') [pagedkv KVPool.gather]", frag_library),
        ("(iv')", "fragmented: np.take(out=), default mode='raise'", frag_take_raise),
        ("(iv'')", "fragmented: fancy indexing pool[:, ids]", frag_fancy),
        ("(iv''')", "fragmented, token-major NHD pool: np.take(out=, mode='clip')",
         frag_nhd_take),
        ("(v)", "fragmented: per-head gather, attend_dense per head [candidate]", frag_per_head),
        ("(v')", "fragmented: per-head staged, one buffer [candidate]", frag_per_head_staged),
        ("(vi)", "fragmented: np.take(mode='clip') + einsum kernel", frag_library_einsum),
        ("(vi')", "fragmented: per-head gather + einsum kernel", frag_per_head_einsum),
    ]
    return variants, reference


def _fill(pool: KVPool, keys: np.ndarray, values: np.ndarray, num_held: int, stride: int) -> BlockTable:
    """Store ``keys``/``values`` ``(n, H, d)`` in blocks ``1, 1 + stride, ...`` of ``pool``."""
    taken = pool.allocator.allocate(pool.num_blocks)
    block_ids = taken[1 : 1 + stride * num_held : stride]
    held = set(block_ids)
    pool.allocator.free([b for b in taken if b not in held])
    block_table = BlockTable(pool.block_size)
    block_table.append(len(keys), block_ids)
    slots = (np.array(block_ids, np.intp)[:, None] * pool.block_size + np.arange(pool.block_size)).ravel()
    pool.write(0, slots, keys, values)
    return block_table


def main(argv: list[str] | None = None) -> int:
    """Print the layout table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no 16k column")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant and size")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (default) or cpu: this thread's CPU time, for a loaded machine")
    args = parser.parse_args(argv)
    clock = use_clock(args.clock)
    sizes = [1024, 4096] if args.quick else [1024, 4096, 16384]
    repeats = args.repeats or (5 if args.quick else 15)
    print(header(
        "bench_layout.py: decode attention over paged storage layouts",
        [
            f"parameters: H={NUM_HEADS} kv heads = q heads, head_dim={HEAD_DIM}, float32, "
            f"block_size={BLOCK_SIZE}, scale=1/sqrt(head_dim), n in {sizes} cached tokens",
            f"timing: median of {repeats} calls per cell, each cache-cold (64 MiB written first); "
            "variants take turns within each repetition; times are the whole call "
            "(gather + attention)",
            f"clock: {clock}",
        ],
    ))
    flush = Flusher()
    rng = np.random.default_rng(0)
    results: dict[str, dict[int, float]] = {}
    exact: dict[str, bool] = {}
    labels: dict[str, str] = {}
    with threadpool_limits(1):
        for num_tokens in sizes:
            variants, reference = build_variants(num_tokens, rng)
            samples: dict[str, list[float]] = {tag: [] for tag, _, _ in variants}
            for tag, label, function in variants:
                labels[tag] = label
                same = np.array_equal(function(), reference)  # also warms the code paths
                exact[tag] = exact.get(tag, True) and same
            for repeat in range(repeats):
                order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                for tag, _, function in order:
                    flush()
                    samples[tag].append(time_once(function))
            for tag, timings in samples.items():
                results.setdefault(tag, {})[num_tokens] = median_us(timings)
            del variants
    base = results["(i)"]
    columns = ["", "variant", *(f"{n // 1024}k tokens" for n in sizes),
               *(f"ratio {n // 1024}k" for n in sizes), "bit-exact"]
    rows = []
    for tag, per_size in results.items():
        rows.append([
            tag,
            labels[tag],
            *(format_us(per_size[n]) for n in sizes),
            *(f"{per_size[n] / base[n]:.2f}x" for n in sizes),
            "yes" if exact[tag] else "no",
        ])
    print()
    print(table(columns, rows))
    print()
    print("ratio: time / time of (i), the head-major one-run view, at the same n.")
    print("bit-exact: output == pagedkv.reference.attend_window (np.array_equal) at every size.")
    num_trials, num_fragmented, num_bad = check_bit_exact(100 if args.quick else 300)
    print(
        f"per-head candidates (v), (v') vs attend_window on {num_trials} random caches "
        f"({num_fragmented} with fragmented tables; 1-4 kv heads, grouped-query, head_dim 1-128, "
        f"block_size 1-32, windows, float32/float64): {num_bad} mismatches"
    )
    print(footer())
    return 0


if __name__ == "__main__":
    sys.exit(main())
