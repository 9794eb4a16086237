"""Snapshots of pools that store float16 or bfloat16 pages: saved, loaded, and continued bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.managers import manager_state

from pagedkv import KVCacheManager, KVPool
from pagedkv.snapshot import load, save

pytest.importorskip("safetensors")


@pytest.mark.parametrize("key_dtype, value_dtype", [("float16", "float16"), ("bfloat16", "float16"),
                                                    ("float16", "bfloat16"), ("bfloat16", "bfloat16")])
def test_a_narrow_float_pool_round_trips_and_continues_identically(
    tmp_path: Path, key_dtype: str, value_dtype: str
) -> None:
    if "bfloat16" in (key_dtype, value_dtype):
        pytest.importorskip("ml_dtypes")
    def step(manager: KVCacheManager, n: int, seed: int) -> np.ndarray:
        local = np.random.default_rng(seed)
        batch = manager.reserve({"a": n})
        k, v, q = (local.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(3))
        manager.write(0, batch, k, v)
        out: np.ndarray = manager.attend(0, batch, q)
        return out

    pool = KVPool(8, block_size=4, num_kv_heads=2, head_dim=8, dtype=np.float32,
                  key_dtype=key_dtype, value_dtype=value_dtype)
    manager = KVCacheManager(pool)
    manager.add_sequence("a")
    for seed, n in enumerate([5, 1, 3]):
        step(manager, n, seed)
    path = tmp_path / "narrow.safetensors"
    save(manager, path)
    loaded = load(path)
    assert isinstance(loaded, KVCacheManager)
    assert manager_state(loaded) == manager_state(manager)
    for seed in range(10, 14):
        np.testing.assert_array_equal(step(loaded, 1, seed), step(manager, 1, seed))
