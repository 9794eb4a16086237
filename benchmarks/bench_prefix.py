"""Prefix caching: lookups per second, longest-prefix lookups of 2048-token prompts, memory saved.

Run: ``python benchmarks/bench_prefix.py`` (``--quick`` for a smoke run).

Tables, each measured side by side in one run, variants taking turns within
every repetition so a burst of load hits them alike:

* (a) single lookups per second: ``PrefixCache.block_for`` and a bare
  ``dict.get`` on the same map (4096 keyed blocks), with precomputed keys,
  for hits and misses; next to plain allocation, ``BlockAllocator``
  ``allocate_one`` + ``free_one`` round trips per second;
* (b) longest-prefix lookups per second for 2048-token prompts at block_size
  16 (128 full blocks, all cached, so every key is looked up): with the keys
  precomputed (``PrefixCache.longest_prefix``), then including hashing the
  prompt (``token_bytes`` + ``block_keys`` + the lookup) with SHA-256 and
  with xxh3_128, then the whole admission through the manager
  (``KVCacheManager.add_sequence`` with the hit shared, then ``free``); and
  the hash alone, per block;
* (d) what look-before-take (``lookup``), the windowed hit rule and KV
  events cost: lookups of a cached 2048-token prompt, admissions with and
  without a lookup first, and a request cycle with events off and on;
* (c) memory: N = 1, 8, 64 requests that share a 1000-token system prompt and
  each add their own question, prefilled through a real ``KVCacheManager``
  (block_size 16): blocks in use with prefix caching off and on.

The vLLM figures quoted next to (a) and (b) are issue 5's, for vLLM's
pure-Python prefix-cache code on a machine like this one (2 vCPUs): about
1.0-1.6 M lookups per second and 7-9 k longest-prefix lookups of 2048-token
prompts per second. Timings are medians of repeated samples in CPU time
(``process_time``, which leaves out waiting for a core on a shared machine),
with the wall clock beside them. BLAS plays no part in (a) or (b); (c) only
writes k/v. Every measurement still runs inside ``threadpool_limits(1)``, as
every script here does. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import header, table
from threadpoolctl import threadpool_limits

from pagedkv import BlockAllocator, KVCacheManager, KVPool
from pagedkv.prefix.cache import (
    ROOT_KEY,
    PrefixCache,
    block_keys,
    hash_function,
    token_bytes,
)
from pagedkv.prefix.keys import encode_extra_keys, field

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
NUM_KEYED = 4096
SYSTEM_PROMPT_TOKENS = 1000
QUESTION_TOKENS = 64


def measure(variants: dict[str, Callable[[], int]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (CPU, wall) seconds per operation of each variant; each call returns its op count."""
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            num_ops = run()
            cpu[name].append((time.process_time() - start_cpu) / num_ops)
            wall[name].append((time.perf_counter() - start_wall) / num_ops)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in variants}


def rate(seconds: float) -> str:
    per_second = 1.0 / seconds
    if per_second >= 1e6:
        return f"{per_second / 1e6:.2f} M/s"
    if per_second >= 1e3:
        return f"{per_second / 1e3:.1f} k/s"
    return f"{per_second:.0f} /s"


def prompt_tokens(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, num_tokens).tolist()


def lookups(repeats: int, num_ops: int) -> list[list[str]]:
    sha256 = hash_function("sha256")
    allocator = BlockAllocator(NUM_KEYED)
    cache = PrefixCache(allocator)
    tokens = token_bytes(prompt_tokens(0, NUM_KEYED * BLOCK_SIZE))
    keys = block_keys(ROOT_KEY, tokens, BLOCK_SIZE, b"", sha256)
    for block_id, key in zip(allocator.allocate(NUM_KEYED), keys):
        cache.register(block_id, key)
    allocator.free(list(range(NUM_KEYED)))  # cached free, as after the requests finished
    missing = block_keys(ROOT_KEY, tokens, BLOCK_SIZE, b"salt", sha256)
    hits = (keys * (num_ops // len(keys) + 1))[:num_ops]
    misses = (missing * (num_ops // len(missing) + 1))[:num_ops]
    block_for, get = cache.block_for, cache._block_of.get
    plain = BlockAllocator(NUM_KEYED)

    def loop(function: Callable[[bytes], object], batch: list[bytes]) -> Callable[[], int]:
        def run() -> int:
            for key in batch:
                function(key)
            return len(batch)

        return run

    def allocate_free() -> int:
        allocate_one, free_one = plain.allocate_one, plain.free_one
        for _ in range(num_ops):
            free_one(allocate_one())
        return num_ops

    results = measure(
        {
            "hit": loop(block_for, hits),
            "miss": loop(block_for, misses),
            "dict hit": loop(get, hits),
            "dict miss": loop(get, misses),
            "alloc": allocate_free,
        },
        repeats,
    )
    assert all(block_for(key) is not None for key in keys) and block_for(missing[0]) is None
    rows = []
    labels = {
        "hit": ("PrefixCache.block_for, hit", "1.0-1.6 M/s"),
        "miss": ("PrefixCache.block_for, miss", "1.0-1.6 M/s"),
        "dict hit": ("dict.get on the same map, hit", ""),
        "dict miss": ("dict.get on the same map, miss", ""),
        "alloc": ("BlockAllocator allocate_one + free_one", ""),
    }
    for name, (cpu, wall) in results.items():
        label, vllm = labels[name]
        rows.append([label, rate(cpu), f"{cpu * 1e9:.0f} ns", rate(wall), vllm])
    return rows


def longest_prefix(repeats: int, num_ops: int) -> tuple[list[list[str]], list[list[str]]]:
    prompt = prompt_tokens(1, PROMPT_TOKENS)
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE
    extras = encode_extra_keys(None)
    variants: dict[str, Callable[[], int]] = {}
    hash_variants: dict[str, Callable[[], int]] = {}
    available = ["sha256"]
    try:
        hash_function("xxh3_128")
        available.append("xxh3_128")
    except ImportError:
        print("xxhash is not installed: the xxh3_128 rows are skipped (pip install 'pagedkv[xxhash]')")
    managers = []
    for name in available:
        hasher = hash_function(name)
        allocator = BlockAllocator(num_blocks)
        cache = PrefixCache(allocator)
        keys = block_keys(ROOT_KEY, token_bytes(prompt), BLOCK_SIZE, extras, hasher)
        for block_id, key in zip(allocator.allocate(num_blocks), keys):
            cache.register(block_id, key)
        allocator.free(list(range(num_blocks)))
        if name == "sha256":

            def precomputed(cache: PrefixCache = cache, keys: list[bytes] = keys) -> int:
                for _ in range(num_ops):
                    cache.longest_prefix(keys)
                return num_ops

            variants["precomputed"] = precomputed

        def hashed(cache: PrefixCache = cache, hasher: Callable[[bytes], bytes] = hasher) -> int:
            for _ in range(num_ops):
                found = cache.longest_prefix(
                    block_keys(ROOT_KEY, token_bytes(prompt), BLOCK_SIZE, extras, hasher)
                )
            assert len(found) == num_blocks
            return num_ops

        variants[f"hashed {name}"] = hashed
        def hash_only(hasher: Callable[[bytes], bytes] = hasher) -> int:
            for _ in range(num_ops):
                block_keys(ROOT_KEY, token_bytes(prompt), BLOCK_SIZE, extras, hasher)
            return num_ops * num_blocks

        # One block's hash input exactly as block_keys builds it (178 bytes with no extras).
        block_input = field(b"P", keys[0]) + field(b"T", token_bytes(prompt[:BLOCK_SIZE])) + extras

        def raw(hasher: Callable[[bytes], bytes] = hasher, data: bytes = block_input) -> int:
            for _ in range(num_ops * 16):
                hasher(data)
            return num_ops * 16

        hash_variants[f"prompt {name}"] = hash_only
        hash_variants[f"raw {name}"] = raw
        # The whole admission through the manager: lookup, sharing, a new table; then free.
        # Two cached prompts taken in turn: the manager remembers the last prompt's keys
        # (lookup then add_sequence hashes once), which one prompt repeated would hit every time.
        other = prompt_tokens(1, PROMPT_TOKENS)
        pool = KVPool(2 * num_blocks + 2, block_size=BLOCK_SIZE, head_dim=1, dtype=np.float32)
        manager = KVCacheManager(pool, enable_prefix_caching=True, hash_algorithm=name)
        for warm in (prompt, other):
            manager.add_sequence("warm", warm)
            batch = manager.reserve({"warm": warm})
            kv = np.zeros((len(warm), 1, 1), np.float32)
            manager.write(0, batch, kv, kv)
            manager.free("warm")
        managers.append(manager)

        def admit(manager: KVCacheManager = manager, prompts: tuple[list[int], ...] = (prompt, other)) -> int:
            for i in range(num_ops):
                manager.add_sequence(i, prompts[i % 2])
                manager.free(i)
            return num_ops

        variants[f"manager {name}"] = admit
    results = measure(variants, repeats)
    hashes = measure(hash_variants, repeats)
    for manager in managers:
        assert manager.add_sequence("check", prompt) == (num_blocks - 1) * BLOCK_SIZE  # last token left
    labels = {
        "precomputed": "PrefixCache.longest_prefix, keys precomputed",
        "hashed sha256": "hash the prompt (sha256) + longest_prefix",
        "hashed xxh3_128": "hash the prompt (xxh3_128) + longest_prefix",
        "manager sha256": "KVCacheManager.add_sequence + free (sha256)",
        "manager xxh3_128": "KVCacheManager.add_sequence + free (xxh3_128)",
    }
    rows = []
    for name, (cpu, wall) in results.items():
        vllm = "7-9 k/s" if name == "precomputed" else ""
        rows.append([labels[name], rate(cpu), f"{cpu * 1e6:.1f} µs", rate(wall), vllm])
    hash_rows = []
    for name, (cpu, _) in hashes.items():
        kind, algorithm = name.split()
        what = (
            "token_bytes + block_keys of the prompt" if kind == "prompt" else "the hash call alone, 178 bytes"
        )
        hash_rows.append(
            [f"{algorithm}: {what}", f"{cpu * 1e9:.0f} ns", f"{cpu * num_blocks * 1e6:.1f} µs", rate(cpu)]
        )
    return rows, hash_rows


def features(repeats: int, num_ops: int) -> list[list[str]]:
    """(d) What issue 15's additions cost: look-before-take, the windowed hit rule, KV events."""
    prompts = (prompt_tokens(0, PROMPT_TOKENS), prompt_tokens(1, PROMPT_TOKENS))
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE

    def warmed(**options: Any) -> KVCacheManager:
        pool = KVPool(2 * num_blocks + 64, block_size=BLOCK_SIZE, head_dim=1, dtype=np.float32)
        manager = KVCacheManager(pool, enable_prefix_caching=True, **options)
        for prompt in prompts:
            manager.add_sequence("warm", prompt)
            batch = manager.reserve({"warm": prompt})
            kv = np.zeros((len(prompt), 1, 1), np.float32)
            manager.write(0, batch, kv, kv)
            manager.free("warm")
        return manager

    plain, windowed = warmed(), warmed(max_size=1024)

    def lookup(manager: KVCacheManager) -> Callable[[], int]:
        def run() -> int:
            for i in range(num_ops):
                manager.lookup(prompts[i % 2])
            return num_ops
        return run

    def look_then_admit() -> int:
        for i in range(num_ops):
            plain.lookup(prompts[i % 2])
            plain.add_sequence(i, prompts[i % 2])
            plain.free(i)
        return num_ops

    def admit_only() -> int:
        for i in range(num_ops):
            plain.add_sequence(i, prompts[i % 2])
            plain.free(i)
        return num_ops

    kv1 = np.zeros((1, 1, 1), np.float32)

    def cycles(events: bool) -> Callable[[], int]:
        manager = KVCacheManager(KVPool(64, block_size=BLOCK_SIZE, head_dim=1, dtype=np.float32),
                                 enable_prefix_caching=True, kv_events=events)
        prompt = prompt_tokens(5, 128)
        kv = np.zeros((len(prompt), 1, 1), np.float32)

        def run() -> int:
            for i in range(num_ops):
                manager.add_sequence(i, [*prompt[:-1], i])  # a new last block each time: stored, then evicted
                batch = manager.reserve({i: [*prompt[:-1], i]})
                manager.write(0, batch, kv, kv)
                for token in range(32):  # two more blocks fill and are keyed
                    batch = manager.reserve({i: [token]})
                    manager.write(0, batch, kv1, kv1)
                manager.free(i)
                if events:
                    manager.drain_kv_events()
            return num_ops
        return run

    variants = {
        "lookup": lookup(plain),
        "lookup windowed": lookup(windowed),
        "add_sequence + free": admit_only,
        "lookup + add_sequence + free": look_then_admit,
        "cycle events off": cycles(False),
        "cycle events on": cycles(True),
    }
    results = measure(variants, repeats)
    labels = {
        "lookup": f"lookup() of a cached {PROMPT_TOKENS}-token prompt (hashing included)",
        "lookup windowed": "the same, sliding window 1024 (the windowed hit rule)",
        "add_sequence + free": "add_sequence + free of it (the admission itself)",
        "lookup + add_sequence + free": "lookup, then add_sequence (keys reused) + free",
        "cycle events off": "request cycle: 128-token prompt, 32 decodes, free; events off",
        "cycle events on": "the same with kv_events=True, drained every cycle",
    }
    return [
        [labels[name], rate(cpu), f"{cpu * 1e6:.1f} µs", rate(wall)] for name, (cpu, wall) in results.items()
    ]


def memory(counts: list[int]) -> list[list[str]]:
    system_prompt = prompt_tokens(2, SYSTEM_PROMPT_TOKENS)
    rows = []
    for num_requests in counts:
        used = []
        for caching in (False, True):
            per_request = -(-(SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS) // BLOCK_SIZE)
            pool = KVPool(num_requests * per_request, block_size=BLOCK_SIZE, head_dim=1, dtype=np.float32)
            manager = KVCacheManager(pool, enable_prefix_caching=caching)
            num_cached = 0
            for i in range(num_requests):
                prompt = system_prompt + prompt_tokens(100 + i, QUESTION_TOKENS)
                num_hit = manager.add_sequence(i, prompt)
                num_cached += num_hit
                rest = prompt[num_hit:]
                batch = manager.reserve({i: rest})
                kv = np.zeros((len(rest), 1, 1), np.float32)
                manager.write(0, batch, kv, kv)
            manager.check_invariants()
            used.append(manager.pool.num_used_blocks)
        saved = 1 - used[1] / used[0]
        rows.append(
            [str(num_requests), str(used[0]), str(used[1]), f"{saved:.1%}", f"{num_cached}"]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer, shorter samples")
    args = parser.parse_args(argv)
    repeats, num_ops, num_prefix = (3, 20_000, 100) if args.quick else (9, 200_000, 1000)
    print(
        header(
            "bench_prefix: prefix-cache lookups, longest-prefix lookups, memory saved",
            [
                f"parameters: block_size {BLOCK_SIZE}; (a) {NUM_KEYED} keyed blocks, {num_ops} lookups "
                f"or round trips per sample; (b) {PROMPT_TOKENS}-token prompts "
                f"({PROMPT_TOKENS // BLOCK_SIZE} full blocks, all cached), {num_prefix} lookups per sample; "
                "(c) a "
                f"{SYSTEM_PROMPT_TOKENS}-token system prompt + {QUESTION_TOKENS} tokens per request; "
                f"{repeats} samples, medians",
            ],
        )
    )
    with threadpool_limits(1):
        print("\n## (a) single lookups (precomputed keys) next to plain allocation\n")
        print(table(["operation", "rate (CPU)", "per op (CPU)", "rate (wall)", "vLLM (issue 5)"],
                    lookups(repeats, num_ops)))
        rows, hash_rows = longest_prefix(repeats, num_prefix)
        print(f"\n## (b) longest-prefix lookups of {PROMPT_TOKENS}-token prompts\n")
        columns = ["operation", "prompts/s (CPU)", "per prompt (CPU)", "prompts/s (wall)", "vLLM (issue 5)"]
        print(table(columns, rows))
        print(f"\nhashing without the lookup, per block of {BLOCK_SIZE} tokens (a block's hash input is 178 "
              "bytes: the parent key, 16 int64 ids, length fields)\n")
        print(table(["hash", "per block (CPU)", f"per {PROMPT_TOKENS}-token prompt", "blocks/s (CPU)"],
                    hash_rows))
        print("\n## (d) look before you take, the windowed hit rule, KV events\n")
        print(table(["operation", "rate (CPU)", "per op (CPU)", "rate (wall)"],
                    features(repeats, max(10, num_prefix // 10))))
        print(f"\n## (c) memory: N requests sharing a {SYSTEM_PROMPT_TOKENS}-token system prompt\n")
        print(table(["N", "blocks, caching off", "blocks, caching on", "saved", "tokens served from cache"],
                    memory([1, 8, 64])))
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
