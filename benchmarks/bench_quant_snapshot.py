"""Quantized pages and snapshots: accuracy, decode speed, bytes per token, save/load throughput.

Run: ``python benchmarks/bench_quant_snapshot.py`` (``--quick`` for a smoke run).

1. **Accuracy** of attend outputs against float32 storage, relative error
   ``||out - out_f32|| / ||out_f32||`` per query (median and max over the
   queries), for each storage dtype and scale granularity (one scale per
   token per head, or per group of 32 or 16 head_dim values), on Gaussian
   keys/values and on heavy-tailed keys (4 fixed channels per head 100×
   larger, as real keys have; values Gaussian). Keys only, values only, and
   both quantized. Through the library's own path (quantize as the pool
   does, then the chunked kernel).
2. **Decode attention** through ``KVCacheManager.attend`` (one sequence,
   one new token attending to ``context`` tokens, H=8 query and kv heads,
   d=128, float32 compute, block_size 16, fresh pool so the table is one run
   of ids) for every storage dtype against float32 storage, with bytes per
   token. Rows interleaved round-robin; medians.
3. **Snapshots**: ``pagedkv.snapshot.save`` and ``load`` of a manager holding
   ``context`` tokens in float32 and int8, in MB/s of file size, against the
   raw write speed of the same number of bytes (``ndarray.tofile`` + fsync;
   "raw atomic" adds what ``save`` adds for atomicity: a fresh temporary
   file, rename, folder fsync) and raw read speed (``np.fromfile``), measured
   in the same run, same folder.

BLAS pinned to one thread (threadpoolctl) for every measurement. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import format_us, header, table
from threadpoolctl import threadpool_limits

import pagedkv.attention as attention
import pagedkv.memory.quantization as quantization
from pagedkv import KVCacheManager, KVPool, snapshot
from pagedkv.attention import attend_chunked
from pagedkv.memory.quantization import QuantizedTokens, Tokens, storage_format

NUM_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DTYPES: list[tuple[str, str | None, str | None]] = [
    ("float32", None, None),
    ("int8 K+V", "int8", "int8"),
    ("fp8 K+V", "float8_e4m3", "float8_e4m3"),
    ("int8 K, f32 V", "int8", None),
    ("fp8 K, int8 V", "float8_e4m3", "int8"),
]


# ------------------------------------------------------------------ accuracy


def _stored(dense: np.ndarray, name: str | None, group_size: int) -> Tokens:
    if name is None:
        return dense
    saved = quantization.GROUP_SIZE
    quantization.GROUP_SIZE = group_size
    try:
        storage = storage_format(name, dense.shape[-1])
    finally:
        quantization.GROUP_SIZE = saved
    codes, scales = storage.quantize(dense)
    return QuantizedTokens(codes, scales, storage)


def _data(kind: str, num_tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    keys = rng.standard_normal((NUM_HEADS, num_tokens, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((NUM_HEADS, num_tokens, HEAD_DIM)).astype(np.float32)
    if kind == "heavy":
        for head in range(NUM_HEADS):
            channels = rng.choice(HEAD_DIM, 4, replace=False)
            keys[head][:, channels] *= 100.0
    return keys, values


def accuracy(num_tokens: int, num_queries: int) -> str:
    rng = np.random.default_rng(0)
    scale = 1 / np.sqrt(HEAD_DIM)
    dtype = np.dtype(np.float32)
    rows = []
    for kind in ("gaussian", "heavy"):
        keys, values = _data(kind, num_tokens, rng)
        queries = rng.standard_normal((num_queries, NUM_HEADS, HEAD_DIM)).astype(np.float32)
        exact = [attend_chunked(q, keys, values, scale, dtype) for q in queries]
        for name in ("int8", "float8_e4m3"):
            granularities = ((HEAD_DIM, "per token per head"), (32, "group of 32"), (16, "group of 16"))
            for group_size, label in granularities:
                stored_keys = _stored(keys, name, group_size)
                stored_values = _stored(values, name, group_size)
                cells = []
                sides = ((stored_keys, values), (keys, stored_values), (stored_keys, stored_values))
                for k_side, v_side in sides:
                    errors = [
                        float(np.linalg.norm(attend_chunked(q, k_side, v_side, scale, dtype) - ref)
                              / np.linalg.norm(ref))
                        for q, ref in zip(queries, exact)
                    ]
                    cells.append(f"{statistics.median(errors):.2e} / {max(errors):.2e}")
                bytes_per_value = 1 + 4 / group_size
                chosen = " (default)" if group_size == quantization.GROUP_SIZE else ""
                rows.append([kind, name, label + chosen, f"{bytes_per_value:.3f}", *cells])
    return table(
        ["data", "storage", "scale granularity", "B/value", "K only: median / max",
         "V only: median / max", "K and V: median / max"],
        rows,
    )


# ------------------------------------------------------------------- decode


def _decode_manager(context: int, key_dtype: str | None, value_dtype: str | None,
                    rng: np.random.Generator) -> tuple[KVCacheManager, Any, np.ndarray]:
    num_blocks = -(-context // BLOCK_SIZE) + 1
    pool = KVPool(num_blocks, block_size=BLOCK_SIZE, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM,
                  dtype=np.float32, key_dtype=key_dtype, value_dtype=value_dtype)
    manager = KVCacheManager(pool, scale=1 / np.sqrt(HEAD_DIM))
    manager.add_sequence(0)
    for length in (context - 1, 1):
        batch = manager.reserve({0: length})
        kv = rng.standard_normal((length, NUM_HEADS, HEAD_DIM)).astype(np.float32)
        manager.write(0, batch, kv, kv)
    query = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    return manager, batch, query


def decode(contexts: list[int], rounds: int) -> str:
    rng = np.random.default_rng(1)
    rows = []
    for context in contexts:
        setups = {label: _decode_manager(context, k, v, rng) for label, k, v in DTYPES}
        samples: dict[str, list[float]] = {label: [] for label in setups}
        for _ in range(rounds):
            for label, (manager, batch, query) in setups.items():
                start = time.perf_counter()
                manager.attend(0, batch, query)
                samples[label].append(time.perf_counter() - start)
        base = statistics.median(samples["float32"])
        for label, (manager, _, _) in setups.items():
            median = statistics.median(samples[label])
            per_token = manager.pool.bytes_per_token
            gbs = per_token * context / median / 1e9
            rows.append([str(context), label, str(per_token), format_us(median * 1e6),
                         f"{median / base:.2f}x", f"{gbs:.1f}"])
        del setups
    return table(["context", "storage", "bytes/token", "attend (median)", "vs float32", "GB/s of K+V read"],
                 rows)


# ---------------------------------------------------------------- snapshots


def _best(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _raw_write(path: str, data: np.ndarray) -> None:
    with open(path, "wb") as handle:
        data.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _raw_atomic_write(path: str, data: np.ndarray) -> None:
    """The same bytes the way ``save`` writes them: a fresh temporary file, fsync, rename, folder fsync."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(handle, "wb") as stream:
        data.tofile(stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    folder = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)


def snapshots(context: int, repeats: int) -> str:
    rng = np.random.default_rng(2)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("PAGEDKV_BENCH_DIR")) as folder:
        for label, key_dtype, value_dtype in DTYPES[:2]:
            manager, _, _ = _decode_manager(context, key_dtype, value_dtype, rng)
            path = os.path.join(folder, f"snap-{key_dtype}.safetensors")
            save_s = _best(lambda m=manager, p=path: snapshot.save(m, p), repeats)
            size = os.path.getsize(path)
            load_s = _best(lambda p=path: snapshot.load(p), repeats)
            raw = np.frombuffer(rng.bytes(size), np.uint8)
            raw_path = os.path.join(folder, "raw.bin")
            write_s = _best(lambda p=raw_path, data=raw: _raw_write(p, data), repeats)
            atomic_s = _best(lambda p=raw_path, data=raw: _raw_atomic_write(p, data), repeats)
            read_s = _best(lambda p=raw_path: np.fromfile(p, np.uint8), repeats)
            mb = size / 1e6
            rows.append([label, f"{mb:.1f}", f"{mb / save_s:.0f}", f"{mb / write_s:.0f}",
                         f"{mb / atomic_s:.0f}", f"{save_s / write_s:.2f}x", f"{mb / load_s:.0f}",
                         f"{mb / read_s:.0f}", f"{load_s / read_s:.2f}x"])
    return table(["pages", "file MB", "save MB/s", "raw write+fsync MB/s", "raw atomic MB/s",
                  "save vs raw", "load MB/s", "raw read MB/s", "load vs raw"], rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    contexts = [256, 1024] if args.quick else [4096, 16384]
    acc_tokens, acc_queries = (256, 4) if args.quick else (4096, 64)
    rounds = 3 if args.quick else 40
    print(header(
        "Quantized pages and snapshots",
        [f"parameters: num_kv_heads = num_q_heads = {NUM_HEADS}, head_dim {HEAD_DIM}, block_size "
         f"{BLOCK_SIZE}, float32 compute, scale 1/sqrt(head_dim), CHUNK_TOKENS {attention.CHUNK_TOKENS}, "
         f"GROUP_SIZE {quantization.GROUP_SIZE}"],
    ))
    with threadpool_limits(1):
        print(f"\n## Accuracy: relative error of attend outputs vs float32 storage "
              f"({acc_tokens} tokens, {acc_queries} queries)\n")
        print(accuracy(acc_tokens, acc_queries))
        print(f"\n## Decode attention, one token over `context` tokens ({rounds} interleaved rounds)\n")
        print(decode(contexts, rounds))
        print(f"\n## Snapshots of a manager holding {contexts[-1]} tokens (medians of 5)\n")
        print(snapshots(contexts[-1], 2 if args.quick else 5))


if __name__ == "__main__":
    main(sys.argv[1:])
