"""Issue 12's first measurement: can virtual memory do the gathering (vAttention's idea) in numpy?

A throwaway prototype, NOT the library: pages live in one shared memory file
(``os.memfd_create``); each sequence reserves a virtual address range and maps
each of its blocks there with ``mmap(MAP_FIXED | MAP_SHARED)`` at the block's
file offset (through ctypes), so ``np.frombuffer`` over the range is one
contiguous ``(num_tokens, num_kv_heads, head_dim)`` array whatever the block
ids. Blocks are **token-major** ``(block_size, num_kv_heads, head_dim)``: a
block is then one 64 KiB stretch (16 x 8 x 128 x 4 bytes, a multiple of the
4 KiB page), which a head-major pool (pagedkv's layout today) cannot offer.

Rows, each one decode query (H=8, head_dim 128, float32, block_size 16) over
``n`` tokens whose blocks are random ids of a 4,096-block pool, cache-cold
(64 MiB written before each call), variants taking turns:

* best contiguous: ``attend_dense`` on a contiguous head-major ``(H, n, d)``
  array (pagedkv's kernel today: BLAS below 8 MiB of keys, einsum above);
* contiguous token-major: the einsum kernel on a contiguous ``(n, H, d)`` array;
* mapped token-major: the same kernel on the mapped views;
* gathered token-major: ``np.take`` of the blocks into ``(n, H, d)``, then the kernel.

"bit-exact" compares the mapped view's output with the contiguous
token-major one: the two arrays have identical shapes and strides, so the
same kernel rounds the same way. Mapping cost: wall time per
``mmap(MAP_FIXED)`` call. Nothing is asserted.

Run: ``python benchmarks/bench_vmem_prototype.py [--quick]`` (Linux only).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from common import Flusher, footer, format_us, header, table
from threadpoolctl import threadpool_limits

from pagedkv.attention import attend_dense, softmax_rows

Array = npt.NDArray[np.float32]
H, D, BS = 8, 128, 16
NUM_BLOCKS = 4096
DTYPE = np.dtype(np.float32)
BLOCK_BYTES = BS * H * D * DTYPE.itemsize
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000


class MappedPool:
    """Token-major pages in a memfd, and per-sequence virtual views of them."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
        ]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.fd = os.memfd_create("pagedkv-prototype", 0)
        os.ftruncate(self.fd, 2 * NUM_BLOCKS * BLOCK_BYTES)  # keys, then values
        self.buffer = mmap.mmap(self.fd, 2 * NUM_BLOCKS * BLOCK_BYTES, mmap.MAP_SHARED)
        # (side, block_id, block_size, num_kv_heads, head_dim)
        self.pages = np.frombuffer(self.buffer, DTYPE).reshape(2, NUM_BLOCKS, BS, H, D)
        self.map_seconds: list[float] = []

    def view(self, side: int, block_ids: npt.NDArray[np.intp]) -> tuple[Array, int]:
        """A contiguous ``(len(block_ids) * BS, H, D)`` view of the blocks, and its address."""
        size = len(block_ids) * BLOCK_BYTES
        base = self.libc.mmap(None, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "reserving the view's address range failed")
        for index, block_id in enumerate(block_ids):
            start = time.perf_counter()
            offset = (side * NUM_BLOCKS + int(block_id)) * BLOCK_BYTES
            got = self.libc.mmap(base + index * BLOCK_BYTES, BLOCK_BYTES, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_FIXED, self.fd, offset)
            self.map_seconds.append(time.perf_counter() - start)
            if got != base + index * BLOCK_BYTES:
                raise OSError(ctypes.get_errno(), "mapping a block failed")
        raw = (ctypes.c_char * size).from_address(base)
        return np.frombuffer(raw, DTYPE).reshape(len(block_ids) * BS, H, D), base

    def unmap(self, base: int, num_blocks: int) -> None:
        self.libc.munmap(base, num_blocks * BLOCK_BYTES)


def attend_token_major(query: Array, keys: Array, values: Array, scale: float) -> Array:
    """The decode kernel on token-major ``(n, H, d)`` keys and values."""
    grouped = query.reshape(H, -1, D)
    scores = np.einsum("hgd,nhd->hgn", grouped, keys)
    weights = softmax_rows(scores, scale)
    out: Array = np.einsum("hgn,nhd->hgd", weights, values).reshape(query.shape)
    return out


def _variants(
    pool: MappedPool, ids: npt.NDArray[np.intp], keys: Array, values: Array, query: Array
) -> dict[str, Callable[[], Array]]:
    """The four ways to attend ``query`` over the mapped ``keys``/``values`` (same numbers each)."""
    n = len(keys)
    scale = 1 / np.sqrt(D)
    contiguous_keys, contiguous_values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
    head_keys = np.ascontiguousarray(keys.transpose(1, 0, 2))  # (H, n, d)
    head_values = np.ascontiguousarray(values.transpose(1, 0, 2))

    def gathered() -> Array:
        gathered_keys = np.take(pool.pages[0], ids, axis=0).reshape(n, H, D)
        gathered_values = np.take(pool.pages[1], ids, axis=0).reshape(n, H, D)
        return attend_token_major(query, gathered_keys, gathered_values, scale)

    return {
        "best contiguous (head-major attend_dense)": lambda: attend_dense(
            query, head_keys, head_values, scale
        ),
        "contiguous token-major": lambda: attend_token_major(
            query, contiguous_keys, contiguous_values, scale
        ),
        "mapped token-major": lambda: attend_token_major(query, keys, values, scale),
        "gathered token-major": gathered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("this prototype needs Linux (memfd_create, mmap MAP_FIXED)")
        return
    repeats = 5 if args.quick else 11
    lengths = (1024, 4096, 16384)
    print(header("bench_vmem_prototype.py: virtual-memory views over token-major pages",
                 [f"H={H}, head_dim {D}, float32, block_size {BS}, pool {NUM_BLOCKS} blocks, "
                  f"random block ids, cache-cold, medians of {repeats}, BLAS 1 thread"]))
    pool = MappedPool()
    flush = Flusher()
    rng = np.random.default_rng(0)
    rows = []
    with threadpool_limits(1):
        for n in lengths:
            num = n // BS
            ids = rng.permutation(NUM_BLOCKS)[:num]
            pool.pages[:, ids] = rng.standard_normal((2, num, BS, H, D), dtype=np.float32)
            (keys, key_base), (values, value_base) = pool.view(0, ids), pool.view(1, ids)
            variants = _variants(pool, ids, keys, values, rng.standard_normal((H, D), dtype=np.float32))
            exact = np.array_equal(variants["mapped token-major"](), variants["contiguous token-major"]())
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(repeats):
                for name, run in variants.items():
                    flush()
                    start = time.perf_counter()
                    run()
                    samples[name].append(time.perf_counter() - start)
            best = statistics.median(samples["best contiguous (head-major attend_dense)"])
            for name, times in samples.items():
                median = statistics.median(times)
                rows.append([f"{n}", name, format_us(median * 1e6), f"{median / best:.2f}x",
                             "yes" if exact or name != "mapped token-major" else "NO"])
            pool.unmap(key_base, num)
            pool.unmap(value_base, num)
    print()
    print(table(["tokens", "variant", "time", "÷ best contiguous", "bit-exact"], rows))
    mapping = sorted(pool.map_seconds)
    print(f"\n- mmap(MAP_FIXED) per block: median {format_us(statistics.median(mapping) * 1e6)} "
          f"({len(mapping)} calls through ctypes)")
    with open("/proc/sys/vm/max_map_count") as limit:
        max_map_count = limit.read().strip()
    print(f"- each view maps one area per block unless neighbouring ids merge: "
          f"{len(mapping)} areas here; vm.max_map_count is {max_map_count}")
    print(footer())


if __name__ == "__main__":
    main()
