"""``pagedkv demo``: three windowed caches stream tokens through one small pool.

It prints the pool's page map at a few moments (which block belongs to which
cache, which block was just freed) and checks every output against the no-cache
recompute, counting exact (bit-for-bit) matches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv.cache import KVCache
from pagedkv.counts import check_count, window_blocks
from pagedkv.memory.pool import KVPool
from pagedkv.reference import attend_window

__all__ = ["page_map", "run_demo"]


def page_map(pool: KVPool, caches: dict[str, KVCache], just_freed: set[int] | None = None) -> str:
    """A text picture of ``pool``: one column per block, its owner and how full it is.

    Owners are the keys of ``caches``; ``.`` is a free block and ``*`` marks a
    block freed by the step just taken.
    """
    just_freed = just_freed or set()
    owner = ["."] * pool.num_blocks
    fill = [" "] * pool.num_blocks
    for name, cache in caches.items():
        table = cache.block_table
        whole, masks = table.live_blocks()
        for block_id in table.block_ids:
            owner[block_id] = name
            live = pool.block_size if block_id in whole else masks.get(block_id, 0).bit_count()
            fill[block_id] = str(live)
    for block_id in just_freed:
        if owner[block_id] == ".":
            owner[block_id] = "*"
    width = max(2, len(str(pool.num_blocks - 1)))
    lines = [
        "  block " + " ".join(f"{i:>{width}}" for i in range(pool.num_blocks)),
        "  owner " + " ".join(f"{o:>{width}}" for o in owner),
        "  held  " + " ".join(f"{f:>{width}}" for f in fill),
    ]
    return "\n".join(lines)


def run_demo(
    num_tokens: int = 300,
    *,
    seed: int = 0,
    print_fn: Callable[[str], None] = print,
) -> int:
    """Run the demo; return how many outputs differed from the recompute (0 when all match).

    Raises:
        ConfigError, InputTypeError: ``num_tokens`` is not an int >= 1, or ``seed`` not an int >= 0.
    """
    num_tokens = check_count("num_tokens", num_tokens)
    seed = check_count("seed", seed, minimum=0)
    block_size, head_dim = 4, 8
    windows = {"A": 6, "B": 9, "C": 13}
    num_blocks = sum(window_blocks(w, block_size) for w in windows.values())
    pool = KVPool(num_blocks, block_size=block_size, head_dim=head_dim)
    caches = {name: KVCache(max_size=w, pool=pool, scale=head_dim**-0.5) for name, w in windows.items()}
    history: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {name: [] for name in caches}
    rng = np.random.default_rng(seed)

    say = print_fn
    say("pagedkv demo: three windowed caches share one pool of fixed-size blocks.")
    say(
        f"pool: {num_blocks} blocks x {block_size} token slots; windows (max_size): "
        + ", ".join(f"{n}={w}" for n, w in windows.items())
    )
    say(
        "Each cache holds at most ceil(W / block_size) + 1 blocks, so the pool is exactly big "
        "enough;\nwhen every entry of a cache's oldest block has slid out of its window, the "
        "block goes\nback to the pool at once and the next cache to need a block takes it."
    )
    say("Legend: owner A/B/C, '.' free, '*' freed by this step; 'held' = live entries in the block.\n")

    num_exact = num_checked = 0
    worst = 0.0
    freed_by: dict[int, str] = {}
    shown = {"first": False, "full": False, "freed": False, "reused": False}
    for step in range(1, num_tokens + 1):
        name = "ABC"[(step - 1) % 3]
        cache = caches[name]
        before = set(cache.block_ids)
        q, k, v = (rng.standard_normal(head_dim) for _ in range(3))
        out = cache.attend(q, k, v)
        history[name].append((k, v))
        window = history[name][-windows[name] :]
        expected = attend_window(
            q, [kv[0] for kv in window], [kv[1] for kv in window], scale=cache.scale
        )
        num_checked += 1
        num_exact += bool(np.array_equal(out, expected))
        worst = max(worst, float(np.abs(out - expected).max()))
        after = set(cache.block_ids)
        freed, taken = before - after, after - before
        reused = {b: freed_by[b] for b in taken if b in freed_by and freed_by[b] != name}
        for block_id in taken:
            freed_by.pop(block_id, None)
        freed_by.update(dict.fromkeys(freed, name))
        moment = ""
        if not shown["first"]:
            shown["first"] = True
            moment = "the first token takes the pool's first free block"
        elif not shown["full"] and len(cache) == block_size and cache.num_blocks == 1:
            shown["full"] = True
            moment = f"cache {name}'s first block is exactly full; its next entry takes a new block"
        elif freed and not shown["freed"]:
            shown["freed"] = True
            moment = (
                f"block {sorted(freed)} freed: every entry of cache {name}'s oldest block "
                "has slid out of its window"
            )
        elif reused and not shown["reused"]:
            shown["reused"] = True
            moment = ", ".join(
                f"block {b}, freed by cache {who}, is now cache {name}'s" for b, who in reused.items()
            )
        elif step == num_tokens:
            moment = "the end of the stream"
        if moment:
            say(f"after token {step} (cache {name} holds {len(cache)} entries): {moment}")
            say(page_map(pool, caches, freed))
            say(f"  free blocks {pool.num_free_blocks} of {pool.num_blocks}\n")
        pool.check_invariants()
    num_diff = num_checked - num_exact
    say(
        f"checked {num_checked} outputs against a full no-cache recompute: "
        f"{num_exact} matched exactly (bit for bit), {num_diff} differed "
        f"(largest difference {worst:.3g})."
    )
    for cache in caches.values():
        cache.close()
    say(f"all caches closed: {pool.num_free_blocks} of {pool.num_blocks} blocks free again.")
    return num_diff
