"""The kernel's two arithmetic paths (BLAS below EINSUM_MIN_BYTES, einsum above).

Real workloads cross the threshold (H=8, d=128, float32: about 1k tokens), while
the property tests use tiny shapes, so each test here runs with the threshold
forced both ways and checks the contract on either side of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv.attention as attention
from pagedkv import KVCache, KVCacheManager, KVPool
from pagedkv.reference import attend_window
from pagedkv.testing.oracle import FLOAT32_EPS, FLOAT64_EPS, attend, within_tolerance

PATHS = pytest.mark.parametrize("path", ["blas", "einsum"])


def _force(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setattr(attention, "EINSUM_MIN_BYTES", 0 if path == "einsum" else 1 << 62)


@PATHS
@given(
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.integers(1, 9),
    block_size=st.integers(1, 5),
    max_size=st.one_of(st.none(), st.integers(1, 12)),
    use_float32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_the_recompute_bit_for_bit_on_both_paths(
    path: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_size: int | None,
    use_float32: bool,
    seed: int,
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _force(monkeypatch, path)
        _check_stream(num_kv_heads, group, head_dim, block_size, max_size, use_float32, seed)


def _check_stream(
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_size: int | None,
    use_float32: bool,
    seed: int,
) -> None:
    dtype = np.float32 if use_float32 else np.float64
    rng = np.random.default_rng(seed)
    pool = KVPool(64, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    shared, neighbour = KVCache(max_size=max_size, pool=pool), KVCache(max_size=4, pool=pool)
    private = KVCache(max_size=max_size, block_size=block_size, dtype=dtype)
    history = []
    for _ in range(20):
        q = rng.standard_normal((num_kv_heads * group, head_dim))
        k, v = rng.standard_normal((2, num_kv_heads, head_dim))
        outs = [shared.attend(q, k, v), private.attend(q, k, v)]
        neighbour.attend(q, k, v)  # interleaves allocations: shared's table fragments
        history.append((k, v))
        window = history if max_size is None else history[-max_size:]
        expected = attend_window(q, [a for a, _ in window], [b for _, b in window], dtype=dtype)
        for out in outs:
            assert np.array_equal(out, expected)
        head_q = q.tolist()
        want, peak = attend(head_q, [a.tolist() for a, _ in window], [b.tolist() for _, b in window])
        eps = FLOAT32_EPS if use_float32 else FLOAT64_EPS
        assert within_tolerance(outs[0].tolist(), want, peak, eps)


@PATHS
def test_manager_decode_equals_the_recompute_on_both_paths(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force(monkeypatch, path)
    rng = np.random.default_rng(3)
    pool = KVPool(32, block_size=4, num_layers=2, num_kv_heads=2, head_dim=3)
    manager = KVCacheManager(pool, num_q_heads=4, max_size=7)
    history: dict[str, list[list[tuple[np.ndarray, np.ndarray]]]] = {}
    for name in ("a", "b"):
        manager.add_sequence(name)
        history[name] = [[], []]
    for _ in range(12):
        batch = manager.reserve({"a": 1, "b": 1})
        for layer in range(2):
            keys, values = rng.standard_normal((2, 2, 2, 3))
            queries = rng.standard_normal((2, 4, 3))
            manager.write(layer, batch, keys, values)
            out = manager.attend(layer, batch, queries)
            for row, name in enumerate(("a", "b")):
                history[name][layer].append((keys[row], values[row]))
                window = history[name][layer][-7:]
                expected = attend_window(queries[row], [a for a, _ in window], [b for _, b in window])
                assert np.array_equal(out[row], expected)


def test_the_threshold_picks_the_path_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = np.einsum

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(str(args[0]))
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(attention.np, "einsum", spy)
    q = np.ones((1, 4))
    small = np.ones((1, 8, 4))
    attention.attend_dense(q, small, small)
    assert calls == []
    monkeypatch.setattr(attention, "EINSUM_MIN_BYTES", small.nbytes)
    attention.attend_dense(q, small, small)
    assert calls == ["hgd,hnd->hgn", "hgn,hnd->hgd"]
