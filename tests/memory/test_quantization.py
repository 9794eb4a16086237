"""Quantized pages: the rounding bound, the contract inside one dtype, and the state machines.

Tolerances here are derived from the quantization bound, never tuned. For a
group of values whose largest magnitude is ``a``, computing in a float dtype
with unit roundoff ``eps`` (2^-24 for float32, 2^-53 for float64; below we use
the looser machine epsilon ``2 * u``)::

  int8   s = fl(a / 127), y = fl(x / s), q = rint(y), x^ = fl(q * s)
         |x - x^| <= |x - y s| + |y s - q s| + |q s - x^|
                  <= eps |x|   + s / 2       + 127 s eps
                  <= a (1/254 + 3 eps)                    (s <= a/127 (1 + eps))

  fp8    s = fl(a / 448), y = fl(x / s), y^ = e4m3(y) (round to nearest),
  e4m3   x^ = fl(y^ * s); e4m3 has 3 mantissa bits, so |y - y^| <= 2^-4 |y|
         for normals and <= 2^-10 (half the subnormal step 2^-9) below 2^-6;
         ml_dtypes casts float64 through float32, which adds <= 2^-24 |y|:
         |x - x^| <= (2^-4 + max(2 eps, 2^-23)) |x| + (2^-10 / 448 + 2 eps) a

Attention over quantized keys and values (exact arithmetic): a key error
``|dk_ij| <= tk_ij`` moves score ``i`` by at most
``D_i = |scale| * sum_j |q_j| tk_ij``; with ``D = max_i D_i`` every softmax
weight changes by a factor within ``[e^-2D, e^2D]``, so the weights move by
at most ``e^2D - 1`` in total, and for output element ``m``::

  |out^_m - out_m| <= (e^2D - 1) max_i |v_im| + max_i tv_im

The tests add the float tolerance of ``pagedkv.testing.oracle`` on top (the
kernel's own rounding). Inputs are drawn with magnitudes 0 or in
[1e-3, 1e3], so no scale is subnormal (the bound assumes normal scales).
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from support.managers import make_manager

import pagedkv.attention
import pagedkv.cache
import pagedkv.memory.quantization as quantization
from pagedkv import KVCache, KVCacheManager, KVPool, reference
from pagedkv.attention import attend_dense
from pagedkv.errors import ConfigError, InputTypeError, PoolExhaustedError
from pagedkv.memory.quantization import bytes_per_token, head_bytes, storage_format
from pagedkv.testing import oracle

pytest.importorskip("ml_dtypes")

STORAGE = ["int8", "float8_e4m3"]
DTYPES = [np.float32, np.float64]


def eps_of(dtype: Any) -> float:
    return float(np.finfo(dtype).eps)


def element_bound(x: np.ndarray, name: str, dtype: Any) -> np.ndarray:
    """The derived bound on |x - x^| for every element of ``x`` ``(..., head_dim)`` (see above)."""
    storage = storage_format(name, x.shape[-1])
    groups = np.abs(x.astype(np.float64)).reshape(*x.shape[:-1], storage.num_groups, storage.group_size)
    a = groups.max(axis=-1, keepdims=True) + np.zeros_like(groups)  # each value's group maximum
    eps = eps_of(dtype)
    if name == "int8":
        bound = a * (1 / 254 + 3 * eps)
    else:
        bound = (2**-4 + max(2 * eps, 2**-23)) * groups + (2**-10 / 448 + 2 * eps) * a
    return bound.reshape(x.shape)


def roundtrip(x: np.ndarray, name: str) -> np.ndarray:
    storage = storage_format(name, x.shape[-1])
    codes, scales = storage.quantize(x)
    return storage.dequantize(codes, scales, x.dtype)


magnitudes = st.one_of(st.just(0.0), st.floats(1e-3, 1e3))
values = st.builds(lambda m, negative: -m if negative else m, magnitudes, st.booleans())


# ------------------------------------------------------------ the rounding bound


@settings(max_examples=60)
@given(
    name=st.sampled_from(STORAGE),
    dtype=st.sampled_from(DTYPES),
    head_dim=st.sampled_from([1, 3, 32, 40, 64]),
    data=st.data(),
)
def test_dequantized_values_are_within_the_derived_bound(
    name: str, dtype: Any, head_dim: int, data: Any
) -> None:
    rows = data.draw(st.integers(1, 4))
    x = np.array(data.draw(st.lists(values, min_size=rows * head_dim, max_size=rows * head_dim)), dtype)
    x = x.reshape(rows, head_dim)
    error = np.abs(roundtrip(x, name).astype(np.float64) - x.astype(np.float64))
    assert (error <= element_bound(x, name, dtype)).all()


def test_the_bound_is_nearly_reached_so_it_is_not_loose() -> None:
    # A value halfway between two int8 steps lands exactly s/2 away.
    x = np.array([[127.0, 0.5]])  # s = 1: 0.5 rounds to 0 (half to even), error 0.5 = a/254
    assert np.abs(roundtrip(x, "int8") - x).max() == pytest.approx(127 / 254)
    rng = np.random.default_rng(0)
    y = rng.standard_normal((1000, 32))
    ratio = np.abs(roundtrip(y, "float8_e4m3") - y) / element_bound(y, "float8_e4m3", np.float64)
    assert 0.9 < ratio.max() <= 1.0


def test_zero_groups_and_group_maxima_round_trip_exactly() -> None:
    x = np.zeros((2, 64))
    x[1, :32] = np.linspace(-3, 3, 32)
    out = roundtrip(x, "int8")
    assert (out[0] == 0).all() and (out[1, 32:] == 0).all()
    assert out[1, 0] == pytest.approx(-3.0, rel=1e-15) and out[1, 31] == pytest.approx(3.0, rel=1e-15)


@pytest.mark.parametrize("head_dim, group_size", [(128, 32), (64, 32), (40, 20), (7, 7), (3, 3), (96, 32)])
def test_group_size_is_the_largest_divisor_of_head_dim_up_to_32(head_dim: int, group_size: int) -> None:
    assert storage_format("int8", head_dim).group_size == group_size


def test_the_int8_largest_magnitude_of_a_group_counts_its_negative_codes() -> None:
    # One group of head_dim 2: [-8, 0.5] -> s = 8/127, codes [-127, 8]. The
    # largest |key| (8) is held by a negative code; the bound the snapshot check
    # reads (group_max_abs) must see it, not the largest positive code (0.5).
    storage = storage_format("int8", 2)
    codes, scales = storage.quantize(np.array([[-8.0, 0.5]]))
    assert codes.tolist() == [[-127, 8]]
    largest = storage.group_max_abs(codes, scales, np.dtype(np.float64))
    dequantized = storage.dequantize(codes, scales, np.float64)
    assert largest.tolist() == [[np.abs(dequantized).max()]]
    assert largest[0, 0] == pytest.approx(8.0)


def test_fp8_never_produces_nan_for_large_values() -> None:
    x = np.array([[1e30, -1e30, 3.0, 448.0]])
    out = roundtrip(x, "float8_e4m3")
    assert np.isfinite(out).all() and out[0, 0] == pytest.approx(1e30)


# ------------------------------------------------------------ bytes per token


@pytest.mark.parametrize(
    "dtype, key_dtype, value_dtype, expected",
    [
        # H=8, d=128: codes 8*128 bytes per side, scales 8*4 per side in the compute dtype
        (np.float32, None, None, 8192),
        (np.float32, "int8", "int8", 2 * (1024 + 8 * 4 * 4)),  # 2304
        (np.float32, "float8_e4m3", "float8_e4m3", 2304),
        (np.float32, "int8", None, 1024 + 128 + 4096),
        (np.float64, "int8", "int8", 2 * (1024 + 8 * 4 * 8)),  # 2560
        (np.float64, None, None, 16384),
        # float16 / bfloat16: 2 bytes a value, no scales
        (np.float32, "float16", "bfloat16", 2 * 8 * 128 * 2),  # 4096
        (np.float32, "bfloat16", None, 2048 + 4096),
        (np.float64, "float16", "int8", 2048 + 1024 + 8 * 4 * 8),
    ],
)
def test_bytes_per_token(dtype: Any, key_dtype: str | None, value_dtype: str | None, expected: int) -> None:
    assert bytes_per_token(num_kv_heads=8, head_dim=128, dtype=dtype, key_dtype=key_dtype,
                           value_dtype=value_dtype) == expected
    pool = KVPool(2, block_size=16, num_kv_heads=8, head_dim=128, num_layers=3, dtype=dtype,
                  key_dtype=key_dtype, value_dtype=value_dtype)
    assert pool.bytes_per_token == 3 * expected
    assert pool.bytes_per_block == 16 * 3 * expected
    manager = KVCacheManager(pool)
    assert manager.metrics().bytes_per_token == 3 * expected


# ------------------------------------------------------------ options and errors


@pytest.mark.parametrize(
    "bad, error",
    [("int4", ConfigError), ("fp8", ConfigError), (np.int8, InputTypeError), (8, InputTypeError)],
)
def test_unknown_storage_dtypes_are_refused(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="key_dtype"):
        KVPool(2, head_dim=4, key_dtype=bad)
    with pytest.raises(error, match="value_dtype"):
        KVCache(value_dtype=bad)


def test_a_cache_must_agree_with_its_pools_storage() -> None:
    pool = KVPool(2, block_size=2, head_dim=4, key_dtype="int8")
    assert KVCache(pool=pool).key_dtype == "int8"  # None means the pool's
    with pytest.raises(ConfigError, match="key_dtype='float8_e4m3' but the pool stores 'int8'"):
        KVCache(pool=pool, key_dtype="float8_e4m3")
    with pytest.raises(ConfigError, match=r"host_pool\.key_dtype"):
        KVCacheManager(KVPool(2, block_size=2, head_dim=4), host_pool=pool)


def test_missing_ml_dtypes_names_the_fp8_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    with pytest.raises(ImportError, match=r'pip install "pagedkv\[fp8\]"'):
        KVPool(2, head_dim=4, value_dtype="float8_e4m3")
    with pytest.raises(ImportError, match=r"pagedkv\[fp8\]"):
        KVCache(key_dtype="float8_e4m3")  # at construction, not at the first attend
    assert KVCache(key_dtype="int8").attend([1.0], [1.0], [2.0]) == [pytest.approx(2.0, rel=1e-2)]


def test_import_pagedkv_needs_numpy_alone() -> None:
    script = (
        "import sys\n"
        "for name in ('ml_dtypes', 'safetensors'): sys.modules[name] = None\n"
        "import pagedkv, pagedkv.snapshot, pagedkv.memory.quantization\n"
        "print(pagedkv.KVCache(key_dtype='int8').attend([1.0], [1.0], [4.0]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[4.0]"


def test_float_pools_are_untouched() -> None:
    pool = KVPool(4, block_size=2, head_dim=3)
    assert not pool.quantized and pool.key_dtype is None and pool.keys(0).dtype == np.float64
    assert "key_dtype" not in repr(pool)
    with pytest.raises(ConfigError, match="not quantized"):
        pool.key_scales(0)


# ------------------------------------------------------------ the kernel


def test_attention_dequantizes_chunk_by_chunk_never_the_whole_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagedkv.attention, "CHUNK_TOKENS", 4)
    seen: list[int] = []
    original = quantization.StorageFormat.widen_into

    def spy(self: Any, codes: np.ndarray, out: np.ndarray) -> None:
        seen.append(codes.shape[0])  # (num_tokens, num_kv_heads, head_dim): the kernel's chunk
        original(self, codes, out)

    monkeypatch.setattr(quantization.StorageFormat, "widen_into", spy)
    cache = KVCache(block_size=2, key_dtype="int8", value_dtype="float8_e4m3")
    for i in range(11):
        cache.attend([[1.0, 0.0]], [[0.1 * i, 1.0]], [[float(i), 2.0]])
    assert seen and max(seen) == 4
    # 11 tokens: chunks 4, 4, 3 for keys and again for values
    seen.clear()
    cache.attend([[1.0, 0.0]], [[0.1, 1.0]], [[1.0, 2.0]])
    assert seen == [4, 4, 4, 4, 4, 4]


@pytest.mark.parametrize("key_dtype, value_dtype", [("int8", "int8"), ("float8_e4m3", None), (None, "int8")])
def test_chunk_boundaries_follow_logical_positions_not_block_placement(
    monkeypatch: pytest.MonkeyPatch, key_dtype: str | None, value_dtype: str | None
) -> None:
    """Two interleaved caches on one pool: fragmented tables, windows sliding, chunks of 3 tokens."""
    monkeypatch.setattr(pagedkv.attention, "CHUNK_TOKENS", 3)
    rng = np.random.default_rng(7)
    pool = KVPool(12, block_size=2, num_kv_heads=2, head_dim=8, dtype=np.float32,
                  key_dtype=key_dtype, value_dtype=value_dtype)
    caches = [KVCache(max_size=9, pool=pool), KVCache(max_size=None, pool=pool)]
    history: list[tuple[list[Any], list[Any]]] = [([], []), ([], [])]
    for step in range(24):
        which = step % 2 if step < 12 else 0
        cache, (keys, vals) = caches[which], history[which]
        q, k, v = (rng.standard_normal((4, 8)).astype(np.float32) * 3 for _ in range(3))
        out = cache.attend(q, k[:2], v[:2])
        keys.append(k[:2])
        vals.append(v[:2])
        start = 0 if cache.max_size is None else max(0, len(keys) - cache.max_size)
        expected = reference.attend_window(q, keys[start:], vals[start:], dtype=np.float32,
                                           key_dtype=key_dtype, value_dtype=value_dtype)
        assert np.array_equal(out, expected), step
        pool.check_invariants()
    assert not caches[0].block_table.is_one_run or not caches[1].block_table.is_one_run


def test_a_private_windowed_cache_compacts_quantized_blocks_with_their_scales() -> None:
    rng = np.random.default_rng(3)
    cache = KVCache(max_size=7, block_size=2, key_dtype="int8", value_dtype="int8")
    keys: list[Any] = []
    vals: list[Any] = []
    for _ in range(120):
        q, k, v = (rng.standard_normal(5) * 10 for _ in range(3))
        out = cache.attend(q, k, v)
        keys.append(k)
        vals.append(v)
        expected = reference.attend_window(q, keys[-7:], vals[-7:], key_dtype="int8", value_dtype="int8")
        assert np.array_equal(out, expected)
    cache.check_invariants()
    assert cache.pool is not None and cache.pool.num_blocks <= 64


# ------------------------------------------------------------ the manager


@pytest.mark.parametrize("key_dtype, value_dtype",
                         [("int8", "int8"), ("float8_e4m3", "int8"), ("float16", "bfloat16")])
def test_manager_decode_is_bit_exact_through_fork_copy_on_write_swap_windows_and_sinks(
    monkeypatch: pytest.MonkeyPatch, key_dtype: str, value_dtype: str
) -> None:
    monkeypatch.setattr(pagedkv.attention, "CHUNK_TOKENS", 5)
    rng = np.random.default_rng(11)
    manager = make_manager(40, host_blocks=40, block_size=4, num_kv_heads=2, head_dim=16, num_layers=2,
                           dtype=np.float32, key_dtype=key_dtype, value_dtype=value_dtype, max_size=9,
                           num_sink_tokens=2, num_q_heads=4)
    history: dict[str, list[list[np.ndarray]]] = {}

    def step(seq_id: str, num_new: int, method: str = "loop") -> None:
        batch = manager.reserve({seq_id: num_new})
        for layer in range(2):
            k = rng.standard_normal((num_new, 2, 16)).astype(np.float32)
            v = rng.standard_normal((num_new, 2, 16)).astype(np.float32)
            q = rng.standard_normal((num_new, 4, 16)).astype(np.float32)
            manager.write(layer, batch, k, v)
            out = manager.attend(layer, batch, q, method=method)
            history[seq_id][layer].extend(np.stack([k, v], 1))
            tokens = history[seq_id][layer]
            for row in range(num_new):
                position = len(tokens) - num_new + row
                visible = [j for j in range(position + 1) if j < 2 or j > position - 9]
                expected = reference.attend_window(
                    q[row], [tokens[j][0] for j in visible], [tokens[j][1] for j in visible],
                    dtype=np.float32, key_dtype=key_dtype, value_dtype=value_dtype)
                if num_new == 1:
                    assert np.array_equal(out[row], expected)
                else:  # the masked prefill kernel: equal within the float tolerance
                    np.testing.assert_allclose(out[row], expected, rtol=1e-5, atol=1e-5)

    for seq_id, prompt in (("a", 7), ("b", 3)):
        manager.add_sequence(seq_id)
        history[seq_id] = [[], []]
        step(seq_id, prompt)
    for t in range(16):
        step("a", 1)
        step("b", 1, method="padded")
        if t == 3:  # "a" holds 11 tokens: its last block is partly full, so "c" copies it on write
            manager.fork("a", "c")
            history["c"] = [list(history["a"][0]), list(history["a"][1])]
        if t > 3:
            step("c", 1)
        if t == 6:
            manager.preempt("b", "swap")
            manager.resume("b")
        manager.check_invariants()
    metrics = manager.metrics()
    assert metrics.num_copy_on_write >= 1 and metrics.num_swaps_in == 1


# ------------------------------------------------------------ state machine


class QuantizedCaches(RuleBasedStateMachine):
    """Several quantized caches on one small shared pool, every output checked three ways.

    1. bit for bit against the quantized no-cache recompute (``reference``);
    2. against the pure-Python oracle over the dequantized values, within the
       float tolerance of ``pagedkv.testing.oracle``;
    3. against the oracle over the original values, within the derived
       quantization bound plus that float tolerance.
    """

    caches = Bundle("caches")

    def __init__(self) -> None:
        super().__init__()
        self.saved_chunk = pagedkv.attention.CHUNK_TOKENS
        self.entries: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    @initialize(
        num_blocks=st.integers(1, 8),
        block_size=st.integers(1, 4),
        head_dim=st.sampled_from([1, 2, 3, 4, 40]),
        heads=st.sampled_from([(None, 1), (1, 1), (2, 2), (4, 2)]),
        dtype=st.sampled_from(DTYPES),
        storage=st.sampled_from([("int8", "int8"), ("float8_e4m3", "float8_e4m3"), ("int8", None),
                                 (None, "float8_e4m3"), ("float8_e4m3", "int8")]),
        chunk=st.integers(1, 5),
    )
    def setup(self, num_blocks: int, block_size: int, head_dim: int, heads: tuple[int | None, int],
              dtype: Any, storage: tuple[str | None, str | None], chunk: int) -> None:
        pagedkv.attention.CHUNK_TOKENS = chunk  # tiny chunks: boundaries inside and across blocks
        self.num_q_heads, self.num_kv_heads = heads
        self.head_dim, self.dtype = head_dim, dtype
        self.key_dtype, self.value_dtype = storage
        self.pool = KVPool(num_blocks, block_size=block_size, num_kv_heads=self.num_kv_heads,
                           head_dim=head_dim, dtype=dtype, key_dtype=self.key_dtype,
                           value_dtype=self.value_dtype)
        note(f"pool {self.pool!r}, chunk {chunk}")

    def teardown(self) -> None:
        pagedkv.attention.CHUNK_TOKENS = self.saved_chunk

    @rule(target=caches, max_size=st.one_of(st.none(), st.integers(1, 12)))
    def create(self, max_size: int | None) -> KVCache:
        cache = KVCache(max_size, pool=self.pool)
        self.entries[id(cache)] = ([], [])
        return cache

    def vectors(self, data: Any, num_heads: int | None) -> np.ndarray:
        shape = (self.head_dim,) if num_heads is None else (num_heads, self.head_dim)
        flat = data.draw(st.lists(values, min_size=math.prod(shape), max_size=math.prod(shape)))
        return np.array(flat, self.dtype).reshape(shape) / self.dtype(1000)

    @rule(cache=caches, data=st.data())
    def attend(self, cache: KVCache, data: Any) -> None:
        if cache.closed:
            return
        kv_heads = None if self.num_q_heads is None else self.num_kv_heads
        q = self.vectors(data, self.num_q_heads)
        k, v = self.vectors(data, kv_heads), self.vectors(data, kv_heads)
        try:
            out = cache.attend(q, k, v)
        except PoolExhaustedError:
            return
        keys, vals = self.entries[id(cache)]
        keys.append(k)
        vals.append(v)
        if cache.max_size is not None:
            del keys[: -cache.max_size], vals[: -cache.max_size]
        self.check(out, q, keys, vals)

    def check(self, out: np.ndarray, q: np.ndarray, keys: list[np.ndarray], vals: list[np.ndarray]) -> None:
        exact = reference.attend_window(q, keys, vals, dtype=self.dtype, key_dtype=self.key_dtype,
                                        value_dtype=self.value_dtype)
        assert np.array_equal(out, exact)
        stored_k = [self.stored(k, self.key_dtype) for k in keys]
        stored_v = [self.stored(v, self.value_dtype) for v in vals]
        eps = eps_of(self.dtype)
        want, peak = oracle.attend(q.tolist(), [k.tolist() for k in stored_k], [v.tolist() for v in stored_v])
        assert oracle.within_tolerance(out.tolist(), want, peak, eps)
        original, peak0 = oracle.attend(q.tolist(), [k.tolist() for k in keys], [v.tolist() for v in vals])
        bound = self.attention_bound(q, keys, vals)
        floats = oracle.tolerance(peak0 + float(bound[1]), eps)
        got, expected = np.asarray(out, np.float64), np.asarray(original, np.float64)
        assert (np.abs(got - expected) <= bound[0] + floats * np.maximum(1.0, np.abs(expected))).all()

    def stored(self, x: np.ndarray, name: str | None) -> np.ndarray:
        return x if name is None else roundtrip(x.reshape(-1, self.head_dim), name).reshape(x.shape)

    def attention_bound(
        self, q: np.ndarray, keys: list[np.ndarray], vals: list[np.ndarray]
    ) -> tuple[Any, Any]:
        """The derived bound per output element, and the largest score shift D (see the module doc)."""
        heads = q.reshape(-1, self.head_dim).astype(np.float64)  # (num_q_heads, d)
        k = np.stack([x.reshape(-1, self.head_dim) for x in keys]).astype(np.float64)  # (n, kv_heads, d)
        v = np.stack([x.reshape(-1, self.head_dim) for x in vals]).astype(np.float64)
        zero = np.zeros_like(k)
        tk = element_bound(k, self.key_dtype, self.dtype) if self.key_dtype else zero
        tv = element_bound(v, self.value_dtype, self.dtype) if self.value_dtype else zero
        group = heads.shape[0] // k.shape[1]
        kv_of = np.arange(heads.shape[0]) // group
        shift = np.einsum("hd,nhd->hn", np.abs(heads), tk[:, kv_of]).max(axis=1)  # D per query head
        bound = np.expm1(2 * shift)[:, None] * np.abs(v[:, kv_of]).max(axis=0) + tv[:, kv_of].max(axis=0)
        return bound.reshape(q.shape), shift.max()

    @rule(cache=consumes(caches))
    def close(self, cache: KVCache) -> None:
        cache.close()

    @invariant()
    def pool_invariants(self) -> None:
        if hasattr(self, "pool"):
            self.pool.check_invariants()


TestQuantizedCaches = QuantizedCaches.TestCase


# ------------------------------------------------------------ planted bugs


def hunt() -> settings:
    return settings(
        max_examples=200, stateful_step_count=20, deadline=None, database=None, derandomize=True,
        report_multiple_bugs=False, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )


def test_the_machine_catches_a_kernel_that_ignores_the_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache alone dequantizes its whole window and runs attend_dense: same values, other rounding."""

    def whole_window(query: Any, keys: Any, values: Any, scale: float, dtype: Any) -> Any:
        def floats(side: Any) -> Any:
            if isinstance(side, quantization.QuantizedTokens):
                return side.dequantize(0, side.shape[1], dtype)
            return np.ascontiguousarray(side)

        return attend_dense(query, floats(keys), floats(values), scale)

    monkeypatch.setattr(pagedkv.attention, "attend_chunked", whole_window)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(QuantizedCaches, settings=hunt())


def test_the_machine_catches_quantization_beyond_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes clipped at half the range (a planted off-by-a-bit clip): values above a/2 lose up to
    a/2, in the cache and the reference alike, so only the derived bound can tell."""
    original = quantization.StorageFormat.quantize

    def clipping(self: Any, x: np.ndarray) -> Any:
        codes, scales = original(self, x)
        half = self.max_code / 2
        return np.clip(codes.astype(np.float32), -half, half).astype(self.code_dtype), scales

    monkeypatch.setattr(quantization.StorageFormat, "quantize", clipping)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(QuantizedCaches, settings=hunt())


# ------------------------------------------- scale-free storage: float16, bfloat16


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32: bit arithmetic, no ml_dtypes."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def stored_as(x: np.ndarray, name: str | None) -> np.ndarray:
    if name is None:
        return x
    return x.astype(np.float16).astype(np.float32) if name == "float16" else round_to_bfloat16(x)


def plain_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One query (H, d) over keys/values (n, H, d), float64 throughout."""
    scores = np.einsum("hd,nhd->hn", q.astype(np.float64), keys.astype(np.float64))
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", weights, values.astype(np.float64))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_scale_free_storage_keeps_the_nearest_value_and_reads_it_back_exactly(name: str) -> None:
    x = np.random.default_rng(0).standard_normal((50, 2, 8)).astype(np.float32) * 10
    storage = storage_format(name, 8)
    codes, scales = storage.quantize(x)
    assert (storage.scaled, storage.num_groups, scales.shape) == (False, 0, (50, 2, 0))
    assert codes.dtype.itemsize == 2
    widened = storage.dequantize(codes, None, np.dtype(np.float32))
    assert np.array_equal(widened, stored_as(x, name))
    pool = KVPool(16, block_size=4, num_kv_heads=2, head_dim=8, dtype=np.float32, key_dtype=name)
    assert pool.key_scales(0).shape == (2, 16, 4, 0)  # zero-width: nothing to store
    with pytest.raises(ConfigError, match="stored as float32"):
        pool.value_scales(0)


def test_float16_past_its_largest_value_is_infinite_without_a_warning() -> None:
    codes, _ = storage_format("float16", 2).quantize(np.array([[1e5, -70000.0]], np.float32))
    assert codes.tolist() == [[np.inf, -np.inf]]


@pytest.mark.parametrize("key_dtype, value_dtype", [("float16", "bfloat16"), ("bfloat16", None),
                                                     (None, "float16"), ("float16", "int8")])
@pytest.mark.parametrize("max_size", [None, 9])
def test_caches_storing_float16_or_bfloat16_equal_the_recompute(
    key_dtype: str | None, value_dtype: str | None, max_size: int | None
) -> None:
    n, heads, head_dim = 30, 2, 8
    pool = KVPool(64, block_size=4, num_kv_heads=heads, head_dim=head_dim, dtype=np.float32,
                  key_dtype=key_dtype, value_dtype=value_dtype)
    caches = [KVCache(max_size, pool=pool) for _ in range(2)]  # interleaved on one pool
    data = [np.random.default_rng(seed).standard_normal((3, n, heads, head_dim)).astype(np.float32)
            for seed in range(2)]
    outs: list[list[np.ndarray]] = [[], []]
    for t in range(n):
        for which, cache in enumerate(caches):
            q, k, v = (part[t] for part in data[which])
            outs[which].append(cache.attend(q, k, v))
    pool.check_invariants()
    for which in range(2):
        q, k, v = data[which]
        expected = reference.recompute(q, k, v, max_size=max_size, dtype=np.float32,
                                       key_dtype=key_dtype, value_dtype=value_dtype)
        assert all(np.array_equal(a, b) for a, b in zip(outs[which], expected))
        if value_dtype == "int8":
            continue  # the plain oracle below knows only the scale-free roundings
        for t in (0, n // 2, n - 1):
            start = 0 if max_size is None else max(0, t + 1 - max_size)
            window = slice(start, t + 1)
            keys, values = stored_as(k[window], key_dtype), stored_as(v[window], value_dtype)
            oracle_out = plain_attention(q[t], keys, values)
            np.testing.assert_allclose(outs[which][t], oracle_out, rtol=1e-4, atol=1e-5)


def test_bfloat16_names_the_extra_and_float16_needs_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(ImportError, match=r'bfloat16 storage needs the ml_dtypes package: .*\[fp8\]"'):
        KVPool(2, head_dim=4, key_dtype="bfloat16")
    with pytest.raises(ImportError, match=r"pagedkv\[fp8\]"):
        KVCache(value_dtype="bfloat16")
    assert KVCache(key_dtype="float16", value_dtype="float16").attend([1.0], [1.0], [2.0]) == [2.0]


@pytest.mark.parametrize("name", ["int8", "float8_e4m3", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [1, 8, 96, 128])
def test_the_size_rule_matches_the_arrays_a_pool_makes(name: str, head_dim: int) -> None:
    # head_bytes sizes pools without loading a format (no ml_dtypes needed); the pool's own
    # arrays are what it must agree with: codes plus scales, per token and head.
    pool = KVPool(2, block_size=4, num_kv_heads=3, head_dim=head_dim, key_dtype=name, value_dtype=name)
    stored = sum(array.nbytes for group in pool.pages._groups() for array in group)
    assert stored == 2 * 4 * 3 * 2 * head_bytes(name, head_dim, pool.dtype)
