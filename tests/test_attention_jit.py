"""Grouped-query decode over float32 pages with the compiled kernel (``set_kernel("numba")``).

numpy's matmuls walk each kv head's plane of the token-major pages separately and read at a
third of the bandwidth with several query rows a head; the compiled kernel streams each token's
row once. Paged decode must equal the no-cache recompute (which takes the same path) bit for
bit, stay near numpy's result, and really be the kernel that ran. Skipped without numba.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.pools import interleaved

from pagedkv import reference
from pagedkv.attention import attend_sequence, set_kernel
from pagedkv.testing.oracle import FLOAT32_EPS, tolerance

pytest.importorskip("numba")
from pagedkv.kernels import compiled, jit


@pytest.fixture(autouse=True)
def numba_kernel() -> Iterator[None]:
    previous = set_kernel("numba")
    yield
    set_kernel(previous)


def decode(name: str, pool: Any, table: Any, query: np.ndarray) -> np.ndarray:
    """A decode through kernel ``name``: the previous kernel comes back whatever happens."""
    previous = set_kernel(name)
    try:
        return attend_sequence(pool, 0, table, None, query, 0.3)
    finally:
        set_kernel(previous)


def assert_near_numpy(pool: Any, table: Any, query: np.ndarray, keys: np.ndarray) -> None:
    """The compiled kernel's decode agrees with numpy's within float32 rounding (another summation order).

    Each kernel strays from the exact result by at most the oracle's float32
    tolerance for scores of magnitude ``S`` (without cancellation), so the two
    differ by at most twice that, relative to ``max(1, |numpy's|)``.
    """
    group = query.shape[1] // keys.shape[1]
    grouped = np.abs(query[0].astype(np.float64)).reshape(keys.shape[1], group, -1)
    magnitude = 0.3 * float(np.einsum("hrd,thd->hrt", grouped, np.abs(keys.astype(np.float64))).max())
    compiled_path, numpy_path = decode("numba", pool, table, query), decode("numpy", pool, table, query)
    bound = 2 * tolerance(magnitude, FLOAT32_EPS) * np.maximum(1.0, np.abs(numpy_path))
    assert np.all(np.abs(compiled_path - numpy_path) <= bound)


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 70),
    block_size=st.sampled_from([1, 4, 16]),
    head_dim=st.sampled_from([8, 64, 128]),
    group=st.integers(2, 6),
    view_mode=st.sampled_from(["auto", "gather"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_query_float32_decode_over_a_fragmented_pool_equals_the_recompute_bit_for_bit(
    num_tokens: int, block_size: int, head_dim: int, group: int, view_mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    pool, table, keys, values = interleaved(None, num_tokens, block_size, head_dim, rng, view_mode)
    query = rng.standard_normal((1, 2 * group, head_dim)).astype(np.float32)
    got = attend_sequence(pool, 0, table, None, query, 0.3)
    expected = reference.attend_window(query[0], list(keys), list(values), scale=0.3, dtype=np.float32)
    assert np.array_equal(got[0].view(np.uint32), expected.view(np.uint32))
    assert_near_numpy(pool, table, query, keys)


def test_the_compiled_kernel_runs_only_for_several_float32_query_rows_a_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, ...]] = []
    original = compiled.float_scores_into

    def spy(queries: Any, keys: Any, out: Any) -> None:
        calls.append(queries.shape)
        original(queries, keys, out)

    monkeypatch.setattr(compiled, "float_scores_into", spy)
    rng = np.random.default_rng(0)
    pool, table, _, _ = interleaved(None, 40, 4, 64, rng)
    attend_sequence(pool, 0, table, None, rng.standard_normal((1, 8, 64)).astype(np.float32), 0.3)
    assert calls == [(2, 4, 64)]
    # One query row a kv head stays on numpy's einsum, which reads at the gemv's speed already.
    single = rng.standard_normal((1, 2, 64)).astype(np.float32)
    assert np.array_equal(decode("numba", pool, table, single), decode("numpy", pool, table, single))
    assert calls == [(2, 4, 64)]


def test_a_float64_pool_keeps_numpys_path() -> None:
    from pagedkv import KVPool
    from pagedkv.blocks.table import BlockTable

    pool = KVPool(4, block_size=4, num_kv_heads=1, head_dim=8, dtype=np.float64)
    table = BlockTable(4)
    table.append(4, [pool.allocator.allocate_one()])
    pool.attach(table)
    rng = np.random.default_rng(1)
    pool.write(0, table.slot_array(table.live_ranges()), rng.standard_normal((4, 1, 8)),
               rng.standard_normal((4, 1, 8)))
    query = rng.standard_normal((1, 3, 8))
    assert np.array_equal(decode("numba", pool, table, query), decode("numpy", pool, table, query))


def test_a_planted_kernel_that_scores_the_next_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged and recompute share the kernel, so only the comparison with numpy sees a kernel bug."""
    original = jit.float_scores

    def shifted(grouped: Any, keys: Any) -> Any:
        return original(grouped, np.roll(keys, -1, axis=0))

    monkeypatch.setattr(jit, "float_scores", shifted)
    rng = np.random.default_rng(2)
    pool, table, keys, _ = interleaved(None, 30, 4, 64, rng)
    with pytest.raises(AssertionError):
        assert_near_numpy(pool, table, rng.standard_normal((1, 6, 64)).astype(np.float32), keys)
