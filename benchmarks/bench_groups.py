"""KV-cache groups: how many requests one memory budget holds, by layout, on real managers.

Three layouts of the same bytes (Gemma 3 270M's layers: 3 full, 15 sliding with window 512):

* uniform: one block table per sequence, every layer in every block (``KVCacheManager``; a
  full layer keeps every token, so every layer does);
* groups, one pool (``HybridKVCacheManager``, vLLM's layout): six groups of three layers draw
  blocks from one pool, so memory flows to whichever group needs it;
* groups, one pool per group: each group's own ``KVCacheManager`` and pool, the budget split in
  advance by what a request of ``--design-tokens`` needs in each.

Requests of one length are admitted (prefill in chunks of 256, then one decode token) until the
pool refuses (a refused request's blocks stay held, as a stalled request's would);
the table prints how many fit. No timing: counts are exact and machine-independent.

    python benchmarks/bench_groups.py [--budget-blocks 60000] [--design-tokens 4096]
"""

from __future__ import annotations

import argparse

from pagedkv import GroupLayout, HybridKVCacheManager, KVCacheManager, KVPool, PoolExhaustedError

WINDOWS = ([512] * 5 + [None]) * 3
BLOCK_SIZE = 16
CHUNK = 256  # prefill chunk: a window group holds at most its window plus one chunk


def fill(reserve_all, length: int) -> int:
    """How many requests of ``length`` tokens fit: ``reserve_all(seq, n)`` reserves in every table."""
    count = 0
    while True:
        try:
            for start in range(0, length, CHUNK):
                reserve_all(f"r{count}", min(CHUNK, length - start))
            reserve_all(f"r{count}", 1)
        except PoolExhaustedError:
            return count
        count += 1


def one_manager(manager: KVCacheManager | HybridKVCacheManager, length: int) -> int:
    """How many requests of ``length`` tokens ``manager`` holds (every model layer written)."""

    def reserve_all(seq: str, n: int) -> None:
        if seq not in manager:
            manager.add_sequence(seq)
        batch = manager.reserve({seq: n})
        for layer in range(len(WINDOWS)):
            manager.write(layer, batch, _zeros(n), _zeros(n))

    return fill(reserve_all, length)


def uniform(budget: int, length: int) -> int:
    pool = KVPool(budget // len(WINDOWS), block_size=BLOCK_SIZE, head_dim=1, num_layers=len(WINDOWS))
    return one_manager(KVCacheManager(pool, layer_max_sizes=WINDOWS), length)


def one_pool(budget: int, length: int) -> int:
    layout = GroupLayout.from_layer_windows(WINDOWS)
    pool = KVPool(
        budget // layout.layers_per_group,
        block_size=BLOCK_SIZE,
        head_dim=1,
        num_layers=layout.layers_per_group,
    )
    return one_manager(HybridKVCacheManager(pool, layout), length)


def pool_per_group(budget: int, length: int, design_tokens: int) -> int:
    layout = GroupLayout.from_layer_windows(WINDOWS)
    needs = [  # layer-blocks one request of design_tokens holds in each group
        len(group.layers)
        * _blocks(design_tokens if group.window is None else min(design_tokens, group.window + CHUNK))
        for group in layout.groups
    ]
    managers = []
    for group, need in zip(layout.groups, needs):
        layers = len(group.layers)
        pool = KVPool(
            max(1, budget * need // sum(needs) // layers),
            block_size=BLOCK_SIZE,
            head_dim=1,
            num_layers=layers,
        )
        managers.append(KVCacheManager(pool, max_size=group.window))

    def reserve_all(seq: str, n: int) -> None:
        if any(not manager.can_reserve({seq: n}) for manager in managers if seq in manager):
            raise PoolExhaustedError(n, 0, 0)
        for manager in managers:
            if seq not in manager:
                manager.add_sequence(seq)
            if not manager.can_reserve({seq: n}):
                raise PoolExhaustedError(n, 0, 0)
        for manager in managers:
            batch = manager.reserve({seq: n})
            for layer in range(manager.num_layers):
                manager.write(layer, batch, _zeros(n), _zeros(n))

    return fill(reserve_all, length)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE) + 1


def _zeros(n: int):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.zeros((n, 1, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget-blocks", type=int, default=60000, help="layer-blocks of memory (all layouts)"
    )
    parser.add_argument(
        "--design-tokens", type=int, default=4096, help="length the per-group split is sized for"
    )
    args = parser.parse_args()
    print(
        f"Gemma 3 270M layers (3 full + 15 sliding, window 512), block_size {BLOCK_SIZE}, "
        f"{args.budget_blocks} layer-blocks; per-group pools split for {args.design_tokens}-token requests"
    )
    print(
        f"{'tokens':>7} | {'uniform':>8} | {'one pool':>8} | {'pool/group':>10} | "
        "one pool ÷ uniform | ÷ pool/group"
    )
    for length in (256, 512, 1024, 2048, 4096, 8192, 16384):
        counts = (
            uniform(args.budget_blocks, length),
            one_pool(args.budget_blocks, length),
            pool_per_group(args.budget_blocks, length, args.design_tokens),
        )
        ratio_u = counts[1] / counts[0] if counts[0] else float("inf")
        ratio_p = counts[1] / counts[2] if counts[2] else float("inf")
        print(
            f"{length:>7} | {counts[0]:>8} | {counts[1]:>8} | {counts[2]:>10} | "
            f"{ratio_u:>18.2f} | {ratio_p:>12.2f}"
        )


if __name__ == "__main__":
    main()
