"""Two processes share a prompt's blocks through a real Redis on loopback, bit-identical.

Process A writes the blocks of a 2,000-token prompt into its pool and offers them
(as the device would on eviction); process B, with a pool of its own, finds the run
of keys in the store and loads it into fresh blocks. The manager-level version (B's
admission gets the hit, its outputs equal recomputing) waits for the manager hooks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from support.redis_server import redis_server

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from pagedkv.memory.pool import KVPool
    from pagedkv.prefix.cache import ROOT_KEY, block_keys, hash_function, token_bytes
    from pagedkv.tiers import BlockLayout, DeviceTiering, RedisStore, TieredStore

    def save(pool, path):
        pages = [side(layer) for layer in (0, 1) for side in (pool.key_pages, pool.value_pages)]
        np.save(path, np.stack(pages))

    role, port = sys.argv[1], int(sys.argv[2])
    BLOCK_SIZE, NUM_TOKENS = 16, 2000
    prompt = [(7 * t + 3) % 32000 for t in range(NUM_TOKENS)]
    keys = block_keys(ROOT_KEY, token_bytes(prompt), BLOCK_SIZE, b"", hash_function("sha256"))
    pool = KVPool(len(keys), block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8, num_layers=2,
                  dtype=np.float32)
    store = RedisStore(port=port, timeout_s=5)
    tiers = TieredStore(BlockLayout.of_pool(pool, "test-model"), stores=[store])
    tiering = DeviceTiering(pool, tiers)
    if role == "put":
        rng = np.random.default_rng(1)
        for layer in range(2):
            slots = np.arange(len(keys) * BLOCK_SIZE)
            shape = (len(slots), 2, 8)
            pool.write(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))
        for block_id, key in enumerate(keys):
            tiering.evicted(block_id, key)
        save(pool, sys.argv[3])
        print("stored", len(keys), tiers.num_store_errors)
    else:
        mediums = tiering.extend_hit(keys)
        fresh = list(range(len(keys)))[::-1]  # other block ids than A used
        loaded = tiering.load(keys, fresh)
        save(pool, sys.argv[3])
        print("loaded", loaded, set(mediums), len(mediums), tiers.num_hits)
''')


def test_a_second_process_loads_a_2000_token_prompts_blocks_bit_identical(tmp_path: Path) -> None:
    script = tmp_path / "side.py"
    script.write_text(SCRIPT)
    with redis_server() as server:
        runs = {}
        for role in ("put", "get"):
            done = subprocess.run([sys.executable, str(script), role, str(server.port), str(tmp_path / role)],
                                  capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            runs[role] = done.stdout.split()
    assert runs["put"] == ["stored", str(2000 // 16), "0"]
    assert runs["get"][:5] == ["loaded", str(2000 // 16), "{'REDIS'}", str(2000 // 16), "{'REDIS':"]
    put, got = np.load(tmp_path / "put.npy"), np.load(tmp_path / "get.npy")
    # A's block i sits in B's block n - 1 - i, byte for byte (B's pool starts zeroed; A's is random)
    assert put.any() and np.array_equal(got[:, ::-1].view(np.uint32), put.view(np.uint32))
