"""Manager bookkeeping per request and per step, side by side with vLLM's real ``KVCacheManager``.

Run: ``python benchmarks/bench_requests.py --vllm PATH`` (``--quick`` for a
smoke run), where ``PATH`` is a vLLM wheel or a folder holding its ``vllm/``
package. Get one without installing it (its dependencies, torch included, are
not needed)::

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm

vLLM's side is vLLM's own code, unmodified: ``vllm/v1/core/{kv_cache_manager,
kv_cache_coordinator, single_type_kv_cache_manager, block_pool,
kv_cache_utils, kv_cache_metrics}.py``, ``vllm/v1/request.py``,
``vllm/v1/kv_cache_interface.py`` and the few small modules they need are
imported straight from the wheel's files; every other import (torch, msgspec,
zmq, vLLM's config, logging and metrics) is a stub that does nothing, and two
tiny helpers the request needs (``ConstantList``,
``length_from_prompt_token_ids_or_embeds``) are compiled from their own source
in the wheel (``vllm_core.py``). Nothing of vLLM is copied into this
repository, and vLLM is not a dependency of pagedkv. Without ``--vllm`` the
vLLM columns are left empty.

Workloads (block_size 16, 4,096 blocks, one kv-cache group / one layer, tiny
storage: pagedkv's pool holds ``(1 head, head_dim 8)`` float32 per token and
``write`` copies it; vLLM moves no data at all):

* request cycle: a 512-token prompt admitted (vLLM: ``Request`` built,
  ``get_computed_blocks`` then ``allocate_slots``; pagedkv: ``add_sequence``
  with the prompt, ``reserve`` of the prompt, ``write``), 128 single-token
  decodes (vLLM: ``append_output_token_ids`` + ``allocate_slots(1)``; pagedkv:
  ``reserve`` + ``write``), then ``free``. Caching off, and caching on with
  every prompt new (a miss; vLLM hashes with sha256 over pickle, pagedkv with
  sha256 over packed int64, both every full block);
* one decode call: the per-call split of the cycle's decodes (median of
  samples of 128 calls), with the copy alone (``pool.write_token`` of one
  token's flat row, what ``write`` calls) measured apart so that "reserve +
  write - copy" is the bookkeeping;
* admission: the cycle's admission alone, caching off;
* a decode step of 64 sequences (128-token prompts): 64 separate calls versus
  one ``reserve`` of all 64 (and one ``write``).

pagedkv runs twice: the default manager, and ``trusted_inputs=True`` (the
engine vouches for its k/v values: their NaN/infinity/magnitude scan is
skipped; the batch, state, shape and dtype checks all stay).

Timings: CPU time (``process_time``) of whole samples, medians; the rows take
turns sample by sample (round-robin, the order rotating each round) so that
load on this shared machine hits every row alike. The cycle ratios are the
median over rounds of each round's ratio (the two samples of a round are taken
back to back, so drifting load cancels). pagedkv's pool is written once
before timing, as a running engine's is (a fresh pool's pages fault in on
first write). The per-call split inside a
sample reads ``perf_counter_ns`` around each call (a vDSO clock, its own cost
measured and subtracted). BLAS is pinned to one thread (nothing here calls
it). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from common import footer, header
from threadpoolctl import threadpool_limits
from vllm_core import load_vllm

from pagedkv import KVCacheManager, KVPool

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
PROMPT = 512
NUM_DECODES = 128
STEP_SEQS = 64
STEP_PROMPT = 128
HEAD_DIM = 8
DTYPE = np.float32

class VllmSide:
    """The workloads on vLLM's ``KVCacheManager``, as its scheduler calls it."""

    def __init__(self, vllm: types.SimpleNamespace, caching: bool) -> None:
        interface = vllm.interface
        spec = interface.FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_DIM, dtype="float32 (stubbed)"
        )
        config = interface.KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[interface.KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = vllm.manager.KVCacheManager(
            config, max_model_len=16384, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
            enable_caching=caching,
        )
        hash_fn = vllm.hashing.sha256
        vllm.utils.init_none_hash(hash_fn)
        self.hasher = vllm.utils.get_request_block_hasher(BLOCK_SIZE, hash_fn) if caching else None
        self.request_class = vllm.request.Request
        self.params = types.SimpleNamespace(  # the only SamplingParams fields the request reads
            max_tokens=NUM_DECODES, extra_args=None, skip_reading_prefix_cache=False
        )
        self.num_requests = 0

    def new_request(self, prompt: list[int]) -> Any:
        self.num_requests += 1
        request_id = str(self.num_requests)
        return self.request_class(request_id, prompt, self.params, None, block_hasher=self.hasher)

    def admit(self, request: Any) -> None:
        manager = self.manager
        blocks, num_hit, _ = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks) is None:
            raise AssertionError("vLLM ran out of blocks")
        request.num_computed_tokens = request.num_tokens

    def decode(self, request: Any, token: int) -> None:
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            raise AssertionError("vLLM ran out of blocks")
        request.num_computed_tokens += 1

    def cycle(self, prompt: list[int]) -> None:
        request = self.new_request(prompt)
        self.admit(request)
        for _ in range(NUM_DECODES):
            self.decode(request, 7)
        self.manager.free(request)


def has_trusted_inputs() -> bool:
    """Whether this checkout's manager has ``trusted_inputs`` (the script also measures older ones)."""
    return "trusted_inputs" in inspect.signature(KVCacheManager).parameters


class PagedSide:
    """The workloads on pagedkv's ``KVCacheManager``."""

    def __init__(self, caching: bool, trusted: bool) -> None:
        self.pool = KVPool(NUM_BLOCKS, block_size=BLOCK_SIZE, head_dim=HEAD_DIM, dtype=DTYPE)
        options: dict[str, Any] = {"enable_prefix_caching": caching}
        if trusted:
            options["trusted_inputs"] = True  # (see has_trusted_inputs for older checkouts)
        self.manager = KVCacheManager(self.pool, **options)
        self.caching = caching
        rng = np.random.default_rng(0)
        sizes = (1, STEP_SEQS, STEP_PROMPT, PROMPT)
        self.kv = {n: rng.standard_normal((n, 1, HEAD_DIM), dtype=DTYPE) for n in sizes}  # (n, 1, head_dim)
        self.num_seqs = 0
        self.touch_pool()

    def touch_pool(self) -> None:
        """Write every block once and free it: a running engine's pages are resident.

        A fresh pool's memory is mapped on first write (a page fault per
        4 KiB); without this the first hundred cycles would pay those faults.
        """
        manager, num_tokens = self.manager, NUM_BLOCKS * BLOCK_SIZE
        manager.add_sequence("touch", cache_blocks=False)
        zeros = np.zeros((num_tokens, 1, HEAD_DIM), DTYPE)
        manager.write(0, manager.reserve({"touch": num_tokens}), zeros, zeros)
        manager.free("touch")

    def admit(self, prompt: list[int]) -> int:
        manager = self.manager
        self.num_seqs += 1
        seq_id = self.num_seqs
        num_hit = manager.add_sequence(seq_id, prompt)
        rest = prompt[num_hit:]
        batch = manager.reserve({seq_id: rest if self.caching else len(rest)})
        manager.write(0, batch, self.kv[len(rest)], self.kv[len(rest)])
        return seq_id

    def decode(self, seq_id: int, token: int) -> None:
        batch = self.manager.reserve({seq_id: [token] if self.caching else 1})
        self.manager.write(0, batch, self.kv[1], self.kv[1])

    def cycle(self, prompt: list[int]) -> None:
        seq_id = self.admit(prompt)
        for _ in range(NUM_DECODES):
            self.decode(seq_id, 7)
        self.manager.free(seq_id)


# ----------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------


def prompts(length: int) -> Iterator[list[int]]:
    """New prompts forever (every one a prefix-cache miss)."""
    start = 1000
    while True:
        yield list(range(start, start + length))
        start += length


def _clock_cost_ns() -> float:
    """What one ``perf_counter_ns`` pair costs, to subtract from split timings."""
    clock = time.perf_counter_ns
    costs = []
    for _ in range(2000):
        t0 = clock()
        t1 = clock()
        costs.append(t1 - t0)
    return statistics.median(costs)


Sample = Callable[[], dict[str, float]]


def run_rounds(rows: dict[str, Sample], repeats: int) -> dict[str, list[dict[str, float]]]:
    """Every row's samples, in rounds: sample ``i`` of each row was taken in round ``i``, back to back."""
    names = list(rows)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for name in names:  # warm-up
        rows[name]()
    gc.collect()
    gc.disable()
    try:
        for index in range(repeats):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(rows[name]())
    finally:
        gc.enable()
    return samples


def row_medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Median of each row's reported values (seconds per unit) over its samples."""
    return {
        name: {key: statistics.median(s[key] for s in values) for key in values[0]}
        for name, values in rounds.items()
    }


def run_rows(rows: dict[str, Sample], repeats: int) -> dict[str, dict[str, float]]:
    """:func:`row_medians` of :func:`run_rounds`: rows interleaved round-robin."""
    return row_medians(run_rounds(rows, repeats))


def paired_ratio(rounds: dict[str, list[dict[str, float]]], name: str, key: str) -> str:
    """Median over rounds of vLLM's time / ``name``'s time, each round's two samples taken back to back.

    Load on a shared machine drifts over a run; a ratio of samples taken
    together cancels most of it, where a ratio of the two medians does not.
    """
    if "vLLM" not in rounds or name not in rounds:
        return NONE
    ratios = [theirs[key] / ours[key] for theirs, ours in zip(rounds["vLLM"], rounds[name])]
    return f"{statistics.median(ratios):.2f}"


_PAGED_ROWS = ("pagedkv", "pagedkv trusted")  # the manager by default, and with trusted_inputs=True


def _paged_variants() -> list[tuple[str, bool]]:
    """The pagedkv rows: the default manager, and ``trusted_inputs=True`` where the checkout has it."""
    return [(_PAGED_ROWS[0], False)] + ([(_PAGED_ROWS[1], True)] if has_trusted_inputs() else [])


def cycle_rows(vllm: types.SimpleNamespace | None, caching: bool, num_cycles: int) -> dict[str, Sample]:
    """Request cycles: CPU seconds per cycle."""
    sides: dict[str, Any] = {}
    if vllm is not None:
        sides["vLLM"] = VllmSide(vllm, caching)
    for name, trusted in _paged_variants():
        sides[name] = PagedSide(caching, trusted=trusted)
    rows: dict[str, Sample] = {}
    for name, side in sides.items():
        source = prompts(PROMPT)

        def sample(side: Any = side, source: Iterator[list[int]] = source) -> dict[str, float]:
            batch = [next(source) for _ in range(num_cycles)]
            t0 = time.process_time()
            for prompt in batch:
                side.cycle(prompt)
            return {"cycle": (time.process_time() - t0) / num_cycles}

        rows[name] = sample
    return rows


def split_rows(vllm: types.SimpleNamespace | None, clock_ns: float) -> dict[str, Sample]:
    """Per-call times of admission and decode, caching off (seconds per call)."""
    clock = time.perf_counter_ns
    rows: dict[str, Sample] = {}
    if vllm is not None:
        side = VllmSide(vllm, caching=False)
        source = prompts(PROMPT)

        def vllm_sample() -> dict[str, float]:
            request = side.new_request(next(source))
            t0 = clock()
            side.admit(request)
            admit = clock() - t0 - clock_ns
            append = allocate = 0.0
            for _ in range(NUM_DECODES):
                t0 = clock()
                request.append_output_token_ids(7)
                t1 = clock()
                side.manager.allocate_slots(request, 1)
                request.num_computed_tokens += 1
                t2 = clock()
                append += t1 - t0 - clock_ns
                allocate += t2 - t1 - clock_ns
            side.manager.free(request)
            return {
                "admit": admit * 1e-9,
                "append": append / NUM_DECODES * 1e-9,
                "allocate": allocate / NUM_DECODES * 1e-9,
            }

        rows["vLLM"] = vllm_sample
    for name, trusted in _paged_variants():
        paged = PagedSide(caching=False, trusted=trusted)
        paged_source = prompts(PROMPT)

        def paged_sample(
            paged: PagedSide = paged, source: Iterator[list[int]] = paged_source
        ) -> dict[str, float]:
            manager, pool, kv = paged.manager, paged.pool, paged.kv[1]
            prompt = next(source)
            paged.num_seqs += 2
            seq_id, bare_id = paged.num_seqs - 1, paged.num_seqs
            t0 = clock()
            manager.add_sequence(bare_id)  # admission without the prompt: no lookup when caching is off
            manager.reserve({bare_id: PROMPT})
            t1 = clock()
            manager.add_sequence(seq_id, prompt)  # the prompt is validated, though not kept
            batch = manager.reserve({seq_id: PROMPT})
            t2 = clock()
            admit, admit_bare = t2 - t1 - clock_ns, t1 - t0 - clock_ns
            manager.free(bare_id)
            manager.write(0, batch, paged.kv[PROMPT], paged.kv[PROMPT])
            reserve = write = copy = 0.0
            spare_slot = (NUM_BLOCKS - 1) * BLOCK_SIZE + 3  # a block nobody reads
            copy_one = _copy_of_one_token(pool, kv)
            for _ in range(NUM_DECODES):
                t0 = clock()
                batch = manager.reserve({seq_id: 1})
                t1 = clock()
                manager.write(0, batch, kv, kv)
                t2 = clock()
                copy_one(spare_slot)
                t3 = clock()
                reserve += t1 - t0 - clock_ns
                write += t2 - t1 - clock_ns
                copy += t3 - t2 - clock_ns
            manager.free(seq_id)
            return {
                "admit": admit * 1e-9,
                "admit bare": admit_bare * 1e-9,
                "reserve": reserve / NUM_DECODES * 1e-9,
                "write": write / NUM_DECODES * 1e-9,
                "copy": copy / NUM_DECODES * 1e-9,
            }

        rows[name] = paged_sample
    return rows


def _copy_of_one_token(pool: KVPool, kv: Any) -> Callable[[int], None]:
    """The copy a decode ``write`` makes, alone: ``write_token`` of the token's flat row.

    ``write_one`` on checkouts older than ``write_token``.
    """
    if hasattr(pool, "write_token"):
        row = kv.reshape(-1)  # (num_kv_heads * head_dim,): what ``write`` hands over
        return lambda slot: pool.write_token(0, slot, row, row)
    return lambda slot: pool.write_one(0, *divmod(slot, BLOCK_SIZE), kv[0], kv[0])


def step_rows(vllm: types.SimpleNamespace | None, clock_ns: float) -> dict[str, Sample]:
    """One decode step of ``STEP_SEQS`` sequences (seconds per step), caching off."""
    clock = time.perf_counter_ns
    rows: dict[str, Sample] = {}
    num_tokens = 32  # tokens a batch of sequences decodes; then they are freed and new ones admitted
    if vllm is not None:
        side = VllmSide(vllm, caching=False)
        source = prompts(STEP_PROMPT)
        live: list[Any] = []
        done = [num_tokens]

        def vllm_step() -> dict[str, float]:
            if done[0] >= num_tokens:
                for request in live:
                    side.manager.free(request)
                live[:] = [side.new_request(next(source)) for _ in range(STEP_SEQS)]
                for request in live:
                    side.admit(request)
                done[0] = 0
            done[0] += 1
            t0 = clock()
            for request in live:
                side.decode(request, 7)
            return {"separate": (clock() - t0 - clock_ns) * 1e-9}

        rows["vLLM"] = vllm_step
    for name, trusted in _paged_variants():
        paged = PagedSide(caching=False, trusted=trusted)
        step_source = prompts(STEP_PROMPT)

        def paged_step(
            paged: PagedSide = paged,
            source: Iterator[list[int]] = step_source,
            live: list[int] = [],  # noqa: B006 (one list per row, bound once)
            done: list[int] = [num_tokens],  # noqa: B006
        ) -> dict[str, float]:
            manager = paged.manager
            if done[0] >= num_tokens:
                for seq_id in live:
                    manager.free(seq_id)
                live[:] = [paged.admit(next(source)) for _ in range(STEP_SEQS)]
                done[0] = 0
            done[0] += 2  # a step of separate calls, then a batched one
            kv, kv_all = paged.kv[1], paged.kv[STEP_SEQS]
            reserve = write = 0.0
            for seq_id in live:
                t0 = clock()
                batch = manager.reserve({seq_id: 1})
                t1 = clock()
                manager.write(0, batch, kv, kv)
                t2 = clock()
                reserve += t1 - t0 - clock_ns
                write += t2 - t1 - clock_ns
            requests = dict.fromkeys(live, 1)
            t0 = clock()
            batch = manager.reserve(requests)
            t1 = clock()
            manager.write(0, batch, kv_all, kv_all)
            t2 = clock()
            return {
                "separate reserve": reserve * 1e-9,
                "separate write": write * 1e-9,
                "batched reserve": (t1 - t0 - clock_ns) * 1e-9,
                "batched write": (t2 - t1 - clock_ns) * 1e-9,
            }

        rows[name] = paged_step
    return rows


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------

NONE = "-"


def _us(seconds: float | None) -> str:
    return NONE if seconds is None else f"{seconds * 1e6:.1f}"


def _rate(seconds: float | None) -> str:
    return NONE if seconds is None else f"{1 / seconds / 1e3:.2f} k"


def _cells(medians: dict[str, dict[str, float]], show: Callable[[dict[str, float]], str]) -> str:
    """One table row's cells: vLLM, pagedkv, pagedkv trusted (``-`` where a row was not run)."""
    return " | ".join(
        show(medians[name]) if name in medians else NONE for name in ("vLLM", *_PAGED_ROWS)
    )


def _separate_over_batched(medians: dict[str, float]) -> str:
    if "batched reserve" not in medians:
        return NONE
    return f"{medians['separate reserve'] / medians['batched reserve']:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", help="a vLLM wheel, or a folder holding its vllm/ package")
    parser.add_argument("--repeats", type=int, default=31, help="samples per row")
    parser.add_argument("--cycles", type=int, default=8, help="request cycles per sample")
    parser.add_argument("--quick", action="store_true", help="3 samples of 2 cycles: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.cycles = 3, 2
    vllm, version = load_vllm(args.vllm) if args.vllm else (None, "not measured (no --vllm)")

    with threadpool_limits(limits=1, user_api="blas"):
        clock_ns = _clock_cost_ns()
        source = f", its real v1 core from {args.vllm} (heavy imports stubbed)" if vllm else ""
        parameters = [
            f"vLLM: {version}{source}",
            f"parameters: block_size {BLOCK_SIZE}, {NUM_BLOCKS} blocks, 1 layer; pagedkv pool "
            f"(1 kv head, head_dim {HEAD_DIM}, {np.dtype(DTYPE).name}); request cycle = {PROMPT}-token "
            f"prompt + {NUM_DECODES} single-token decodes + free; step = {STEP_SEQS} sequences "
            f"of {STEP_PROMPT}-token prompts, one token each",
            f"timing: medians of {args.repeats} interleaved samples, CPU time (process_time) for "
            f"cycles ({args.cycles} a sample), perf_counter_ns around each call for the splits "
            f"(its cost, {clock_ns:.0f} ns a pair, subtracted)",
        ]
        print(header("Manager bookkeeping against vLLM (benchmarks/bench_requests.py)", parameters))

        print(
            "\n### Request cycles (cycles per second; the ratios: pagedkv's rate / vLLM's, "
            "the median over rounds of each round's pair)\n"
        )
        print("| workload | vLLM | pagedkv | pagedkv trusted | pagedkv / vLLM | trusted / vLLM |")
        print("|---|---:|---:|---:|---:|---:|")
        for caching in (False, True):
            rounds = run_rounds(cycle_rows(vllm, caching, args.cycles), args.repeats)
            ratios = " | ".join(paired_ratio(rounds, name, "cycle") for name in _PAGED_ROWS)
            label = "caching on, a miss" if caching else "caching off"
            print(f"| {label} | {_cells(row_medians(rounds), lambda m: _rate(m['cycle']))} | {ratios} |")
        print("\nTargets (issue 13): >= 1.5 k cycles/s caching off, >= 1.1 k caching on.")

        splits = run_rows(split_rows(vllm, clock_ns), args.repeats * 2)
        print("\n### One call (µs), caching off\n")
        print("| call | vLLM | pagedkv | pagedkv trusted |")
        print("|---|---:|---:|---:|")
        rows: list[tuple[str, Callable[[dict[str, float]], str]]] = [
            (f"admission of {PROMPT} tokens: lookup (add_sequence with the prompt) + reserve",
             lambda m: _us(m["admit"])),
            (f"admission of {PROMPT} tokens: add_sequence without the prompt + reserve",
             lambda m: _us(m.get("admit bare"))),
            ("decode: append_output_token_ids (vLLM only)", lambda m: _us(m.get("append"))),
            ("decode: allocate_slots(1) / reserve(1)", lambda m: _us(m.get("allocate", m.get("reserve")))),
            ("decode: write(1), copy included", lambda m: _us(m.get("write"))),
            ("decode: the copy alone (pool.write_token)", lambda m: _us(m.get("copy"))),
            ("decode: reserve + write - copy (bookkeeping)",
             lambda m: _us(m["allocate"] if "allocate" in m else m["reserve"] + m["write"] - m["copy"])),
        ]
        for label, show in rows:
            print(f"| {label} | {_cells(splits, show)} |")
        print("\nTargets (issue 13): admission with the prompt <= 20 µs; decode bookkeeping <= 5 µs.")

        steps = run_rows(step_rows(vllm, clock_ns), args.repeats * 2)
        print(f"\n### A decode step of {STEP_SEQS} sequences (µs a step), caching off\n")
        print("| calls | vLLM | pagedkv | pagedkv trusted |")
        print("|---|---:|---:|---:|")
        rows = [
            (f"{STEP_SEQS} separate allocate_slots / reserve",
             lambda m: _us(m.get("separate", m.get("separate reserve")))),
            (f"{STEP_SEQS} separate reserve + write",
             lambda m: _us(m["separate reserve"] + m["separate write"]) if "separate write" in m else NONE),
            (f"one reserve of {STEP_SEQS}", lambda m: _us(m.get("batched reserve"))),
            (f"one reserve + one write of {STEP_SEQS}",
             lambda m: _us(m["batched reserve"] + m["batched write"]) if "batched write" in m else NONE),
            ("separate / batched reserve", _separate_over_batched),
        ]
        for label, show in rows:
            print(f"| {label} | {_cells(steps, show)} |")
        print("\nTarget (issue 13): separate / batched reserve <= 1.5.")
        print()
        print(footer())


if __name__ == "__main__":
    main(sys.argv[1:])
