"""Allocator throughput: blocks per second and request cycles per second.

Run: ``python benchmarks/bench_allocator.py`` (``--quick`` for a smoke run).

Measured, each side by side in one run and interleaved round-robin so that
machine noise hits every row alike:

* the raw :class:`pagedkv.BlockAllocator`;
* :class:`pagedkv.KVCacheManager` bookkeeping (``reserve`` / ``free``) on a
  pool with tiny storage, so its overhead over the allocator is visible;
* ``VllmStyleBlockPool``: a port, in this file, of the free path of vLLM v1's
  pure-Python block pool (``vllm/v1/core/kv_cache_utils.py``
  ``FreeKVCacheBlockQueue``/``KVCacheBlock``, ``vllm/v1/core/block_pool.py``
  ``get_new_blocks``/``free_blocks``, prefix caching off), so the anchor is
  also measured on this machine, not only quoted;
* (history) an earlier version of this script measured two prototypes: a
  LIFO list stack (only 1.1-1.2x faster than the deque-based allocator of the
  time) and a FIFO on a list with a head index plus a one-pass ``free``
  (2.8-3.6x faster). ``BlockAllocator`` now is the latter.

Workloads (block_size 16, a pool of 4096 blocks):

* single: 1024 blocks taken one call at a time, then freed one call at a time
  (oldest first); a block counts once for its allocate + free round trip;
* batch 16: 64 calls taking 16 blocks each, then 64 frees of 16;
* batch 1024: one call taking 1024 blocks, one free of 1024;
* request cycle: 32-block prefill, 8 single-block decode allocations, free
  all 40 tail first (as vLLM frees). vLLM has no single-block call, so its
  port's decode blocks are ``get_new_blocks(1)``.

Through the manager, "a block" is one ``reserve`` of a block's worth of tokens
(16), and every request is a sequence: ``add_sequence`` (outside the timing
for block rows, inside it for request cycles) and ``free``. ``reserve`` refuses
a sequence whose reserved tokens are not yet written in every layer; the
"bookkeeping" rows mark them written directly (private state, no k/v copy),
the "+ write" rows call the public ``write`` with (n, 1, 1) float32 k/v; the


Timings are medians of ``--repeats`` samples in CPU time (``process_time``,
which leaves out waiting for a core on a shared machine) and wall clock; the
verdicts use CPU time. ``--profile`` adds cProfile tables of the slow paths and
measures the pieces of ``reserve`` they point at, with the proposed
replacements. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import footer, header
from threadpoolctl import threadpool_limits

from pagedkv import BlockAllocator, KVCacheManager, KVPool

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
NUM_SINGLE = 1024
NUM_CYCLES = 256  # request cycles per timed sample

#: ANCHORS.md: vLLM's pure-Python block pool "measured on a machine like yours".
VLLM_ANCHOR = {
    "single": (1.0e6, 2.5e6),
    "batch 16": (4.0e6, 9.0e6),
    "batch 1024": (4.0e6, 9.0e6),
    "request cycle": (30e3, 55e3),
}


# ----------------------------------------------------------------------------
# vLLM v1's free path, ported (prefix caching off; no events, no metrics).
# ----------------------------------------------------------------------------


@dataclass
class KVCacheBlock:
    """One block as vLLM v1 keeps it: an object with intrusive list links."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: Any = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False


class FreeKVCacheBlockQueue:
    """vLLM v1's doubly linked free list with a fake head and tail."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(self.num_free_blocks):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < self.num_free_blocks - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = blocks[0]
        blocks[0].prev_free_block = self.fake_free_list_head
        self.fake_free_list_tail.prev_free_block = blocks[-1]
        blocks[-1].next_free_block = self.fake_free_list_tail

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        assert first is not None and first.next_free_block is not None
        self.fake_free_list_head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr = self.fake_free_list_head.next_free_block
        ret = []
        for _ in range(n):
            assert curr is not None
            ret.append(curr)
            last = curr
            curr = curr.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if curr is not None:
            self.fake_free_list_head.next_free_block = curr
            curr.prev_free_block = self.fake_free_list_head
        return ret

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)


class VllmStyleBlockPool:
    """vLLM v1 ``BlockPool.get_new_blocks`` / ``free_blocks`` with caching off.

    NOTE: recent vLLM puts freed blocks without a hash at the *front* of the
    queue (``prepend_n``); this port appends them (older vLLM, and pagedkv's
    FIFO), which costs the same.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks + 1)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()  # block 0, as vLLM
        self.null_block.is_null = True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks_list = list(ordered_blocks)
        for block in blocks_list:
            block.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks_list if b.ref_cnt == 0 and not b.is_null])

    # The BlockAllocator-shaped names the workloads call.
    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        return self.get_new_blocks(num_blocks)

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.free_blocks(blocks)

    def allocate_one(self) -> KVCacheBlock:
        return self.get_new_blocks(1)[0]

    def free_one(self, block: KVCacheBlock) -> None:
        self.free_blocks([block])


# ----------------------------------------------------------------------------
# Prototypes of alternative allocators (same API and errors as BlockAllocator).
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Workloads. Each returns (units done, (wall seconds, CPU seconds)) for one sample.
# ----------------------------------------------------------------------------

Seconds = tuple[float, float]


def _now() -> Seconds:
    return time.perf_counter(), time.process_time()


def _since(start: Seconds) -> Seconds:
    wall, cpu = time.perf_counter(), time.process_time()
    return wall - start[0], cpu - start[1]



def raw_single(alloc: Any, variant: str) -> tuple[int, Seconds]:
    held = []
    if variant == "one":
        take, give = alloc.allocate_one, alloc.free_one
        t0 = _now()
        for _ in range(NUM_SINGLE):
            held.append(take())
        for block in held:
            give(block)
    else:
        take_n, give_n = alloc.allocate, alloc.free
        t0 = _now()
        for _ in range(NUM_SINGLE):
            held.append(take_n(1)[0])
        for block in held:
            give_n([block])
    return NUM_SINGLE, _since(t0)


def raw_batch(alloc: Any, size: int) -> tuple[int, Seconds]:
    take, give = alloc.allocate, alloc.free
    num_calls = max(1, NUM_SINGLE // size)
    t0 = _now()
    held = [take(size) for _ in range(num_calls)]
    for blocks in held:
        give(blocks)
    return num_calls * size, _since(t0)


def raw_cycle(alloc: Any) -> tuple[int, Seconds]:
    take, take_one, give = alloc.allocate, alloc.allocate_one, alloc.free
    t0 = _now()
    for _ in range(NUM_CYCLES):
        blocks = take(32)
        for _ in range(8):
            blocks.append(take_one())
        blocks.reverse()  # tail first
        give(blocks)
    return NUM_CYCLES, _since(t0)


def _mark_written(manager: KVCacheManager, batch: Any) -> None:
    """Record every layer of ``batch`` as written without copying k/v (private state)."""
    seqs = manager._seqs
    for seq_id in batch.seq_ids:
        seq = seqs[seq_id]
        seq.num_written = [seq.table.num_tokens] * len(seq.num_written)


class ManagerBench:
    """The manager's reserve/free on a pool whose storage is one float per slot."""

    def __init__(self, write: bool, allocator: Any = None) -> None:
        self.pool = KVPool(NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=1, dtype=np.float32)
        if allocator is not None:
            self.pool.allocator = allocator  # a prototype; the pool's check_invariants won't know it
        self.manager = KVCacheManager(self.pool)
        self.write = write
        self._next_id = 0
        sizes = (1, BLOCK_SIZE, 16 * BLOCK_SIZE, 32 * BLOCK_SIZE)
        self._kv = {n: np.zeros((n, 1, 1), np.float32) for n in sizes}
        self._kv[1024 * BLOCK_SIZE] = np.zeros((1024 * BLOCK_SIZE, 1, 1), np.float32)

    def _settle(self, batch: Any) -> None:
        if self.write:
            kv = self._kv[batch.num_tokens]
            self.manager.write(0, batch, kv, kv)
        else:
            _mark_written(self.manager, batch)

    def _new_ids(self, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for seq_id in ids:
            self.manager.add_sequence(seq_id)
        return ids

    def single(self) -> tuple[int, Seconds]:
        manager, settle = self.manager, self._settle
        reserve, free = manager.reserve, manager.free
        ids = self._new_ids(NUM_SINGLE)
        t0 = _now()
        for seq_id in ids:
            settle(reserve({seq_id: BLOCK_SIZE}))
        for seq_id in ids:
            free(seq_id)
        return NUM_SINGLE, _since(t0)

    def batch(self, size: int) -> tuple[int, Seconds]:
        manager, settle = self.manager, self._settle
        reserve, free = manager.reserve, manager.free
        ids = self._new_ids(max(1, NUM_SINGLE // size))
        t0 = _now()
        for seq_id in ids:
            settle(reserve({seq_id: size * BLOCK_SIZE}))
        for seq_id in ids:
            free(seq_id)
        return len(ids) * size, _since(t0)

    def batch_across(self, size: int) -> tuple[int, Seconds]:
        """One reserve for ``size`` sequences taking one block each (a decode step's shape)."""
        manager, settle = self.manager, self._settle
        ids = self._new_ids(NUM_SINGLE)
        groups = [{seq_id: BLOCK_SIZE for seq_id in ids[i : i + size]} for i in range(0, NUM_SINGLE, size)]
        t0 = _now()
        for group in groups:
            settle(manager.reserve(group))
        for seq_id in ids:
            manager.free(seq_id)
        return NUM_SINGLE, _since(t0)

    def token_cycle(self) -> tuple[int, Seconds]:
        """A request decoding one token per step: 32-block prefill, 128 one-token reserves, free."""
        manager, settle = self.manager, self._settle
        add, reserve, free = manager.add_sequence, manager.reserve, manager.free
        num_cycles = max(1, NUM_CYCLES // 8)
        ids = list(range(self._next_id, self._next_id + num_cycles))
        self._next_id += num_cycles
        t0 = _now()
        for seq_id in ids:
            add(seq_id)
            settle(reserve({seq_id: 32 * BLOCK_SIZE}))
            for _ in range(8 * BLOCK_SIZE):
                settle(reserve({seq_id: 1}))
            free(seq_id)
        return num_cycles, _since(t0)

    def cycle(self) -> tuple[int, Seconds]:
        manager, settle = self.manager, self._settle
        add, reserve, free = manager.add_sequence, manager.reserve, manager.free
        ids = list(range(self._next_id, self._next_id + NUM_CYCLES))
        self._next_id += NUM_CYCLES
        t0 = _now()
        for seq_id in ids:
            add(seq_id)
            settle(reserve({seq_id: 32 * BLOCK_SIZE}))
            for _ in range(8):
                settle(reserve({seq_id: BLOCK_SIZE}))
            free(seq_id)
        return NUM_CYCLES, _since(t0)


# ----------------------------------------------------------------------------
# Driver.
# ----------------------------------------------------------------------------


def run(rows: list[tuple[str, str, Callable[[], tuple[int, Seconds]]]], repeats: int) -> dict[str, Seconds]:
    """Interleave the rows round-robin; return each row's median (wall, CPU) units per second.

    NOTE: CPU time (``time.process_time``) leaves out the time this process
    waits for a core, most of the noise on a shared 2-core machine; the
    table's verdicts use it.
    """
    samples: dict[str, list[Seconds]] = {name: [] for _, name, _ in rows}
    for _, _, fn in rows:  # warm up
        fn()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for _, name, fn in rows:
                units, (wall, cpu) = fn()
                samples[name].append((units / wall, units / max(cpu, 1e-9)))
    finally:
        gc.enable()
    return {
        name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for name, values in samples.items()
    }


def fmt_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f} M" if rate >= 1e6 else f"{rate / 1e3:.1f} k"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--quick", action="store_true", help="few repeats; a smoke run")
    parser.add_argument("--profile", action="store_true", help="cProfile the slowest paths")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats


    raw = BlockAllocator(NUM_BLOCKS)
    vllm = VllmStyleBlockPool(NUM_BLOCKS)
    mgr = ManagerBench(write=False)
    mgr_w = ManagerBench(write=True)
    impls = [
        ("pagedkv BlockAllocator", raw),
        ("vLLM-style port", vllm),
    ]

    # (workload, implementation, fn)
    rows: list[tuple[str, str, Callable[[], tuple[int, Seconds]]]] = []  # (workload, name, fn)
    for label, alloc in impls:
        if alloc is not vllm:  # vLLM's pool has no single-block call
            rows.append(("single", f"{label}: allocate_one/free_one", lambda a=alloc: raw_single(a, "one")))
        rows.append(("single", f"{label}: allocate(1)/free([b])", lambda a=alloc: raw_single(a, "n")))
        rows.append(("batch 16", f"{label}: allocate(16)/free", lambda a=alloc: raw_batch(a, 16)))
        rows.append(("batch 1024", f"{label}: allocate(1024)/free", lambda a=alloc: raw_batch(a, 1024)))
        rows.append(("request cycle", f"{label}", lambda a=alloc: raw_cycle(a)))
    for label, bench in (("manager bookkeeping", mgr), ("manager + write", mgr_w)):
        rows.append(("single", f"{label}: reserve 16 tokens/free", bench.single))
        rows.append(("batch 16", f"{label}: reserve 256 tokens/free", lambda b=bench: b.batch(16)))
        rows.append(("batch 16", f"{label}: reserve 16 seqs x 16 tokens", lambda b=bench: b.batch_across(16)))
        rows.append(("batch 1024", f"{label}: reserve 16384 tokens/free", lambda b=bench: b.batch(1024)))
        rows.append(("request cycle", f"{label}: add, reserve x9, free", bench.cycle))
        rows.append(("request cycle", f"{label}: add, reserve 512 + 128 x 1 token, free", bench.token_cycle))

    rates = run(rows, repeats)
    assert raw.num_free_blocks == NUM_BLOCKS
    assert vllm.get_num_free_blocks() == NUM_BLOCKS
    raw.check_invariants()
    mgr.manager.check_invariants()
    mgr_w.manager.check_invariants()
    for bench in (mgr, mgr_w):
        assert bench.pool.num_free_blocks == NUM_BLOCKS

    parameters = [
        f"parameters: pool {NUM_BLOCKS} blocks, block_size {BLOCK_SIZE}; single = {NUM_SINGLE} blocks "
        f"taken one call each, then freed one call each (a block counts once for its round trip); "
        f"batch = {NUM_SINGLE} blocks in calls of 16 (or one call of 1024), then freed the same way; "
        f"request cycle = allocate 32 + 8 x allocate_one + free 40 tail first ({NUM_CYCLES} cycles "
        "per sample); manager rows: one sequence per request, 16 tokens per block",
        f"timing: medians of {repeats} interleaved samples, CPU time (process_time, which leaves out "
        "waiting for a core on this shared machine) and wall clock; verdicts from CPU time; "
        "GC off while timing",
    ]
    print(header("Allocator throughput (benchmarks/bench_allocator.py)", parameters))
    print()
    port = {workload: rates[name][1] for workload, name, _ in rows if name.startswith("vLLM-style port")}
    print("| workload | implementation | median (CPU time) | median (wall) | unit | x vLLM port | "
          "vs vLLM's figures (ANCHORS.md) |")
    print("|---|---|---:|---:|---|---:|---|")
    for workload, name, _ in rows:
        wall_rate, rate = rates[name]
        low, high = VLLM_ANCHOR[workload]
        unit = "cycles/s" if workload == "request cycle" else "blocks/s"
        verdict = f"{rate / high:.2f}x the top ({fmt_rate(low)}-{fmt_rate(high)})"
        if rate < low:
            verdict = f"**slower** than {fmt_rate(low)} ({rate / low:.2f}x)"
        elif rate < high:
            verdict = f"inside {fmt_rate(low)}-{fmt_rate(high)}"
        print(
            f"| {workload} | {name} | {fmt_rate(rate)} | {fmt_rate(wall_rate)} | {unit} | "
            f"{rate / port[workload]:.2f} | {verdict} |"
        )

    if args.profile:
        profile(raw, mgr)
    print()
    print(footer())


def profile(raw: BlockAllocator, mgr: ManagerBench) -> None:
    for title, fn in (
        ("raw BlockAllocator: batch 16", lambda: [raw_batch(raw, 16) for _ in range(300)]),
        ("raw BlockAllocator: request cycle", lambda: [raw_cycle(raw) for _ in range(40)]),
        ("manager bookkeeping: request cycle", lambda: [mgr.cycle() for _ in range(8)]),
        ("manager bookkeeping: one-token reserves", lambda: [mgr.token_cycle() for _ in range(4)]),
        ("manager bookkeeping: 16 seqs x 16 tokens", lambda: [mgr.batch_across(16) for _ in range(8)]),
    ):
        profiler = cProfile.Profile()
        profiler.enable()
        fn()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
        print(f"\n## cProfile: {title}\n")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])


if __name__ == "__main__":
    with threadpool_limits(limits=1, user_api="blas"):  # nothing here uses BLAS; pinned all the same
        main(sys.argv[1:])
