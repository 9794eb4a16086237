"""Bad input to ``KVCache``: every error has its type, its builtin, a message naming
the value, and leaves the cache and the pool exactly as they were.

"Exactly as they were" is checked three ways: the observable state (length,
block ids, the pool's free queue, the cached keys and values) is unchanged;
the pool's invariants hold; and the later outputs equal, bit for bit, those
of an untouched twin cache fed the same tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import pagedkv.errors
from pagedkv import KVCache, KVPool
from pagedkv.errors import (
    ClosedCacheError,
    ConfigError,
    InputTypeError,
    NonFiniteError,
    PagedKVError,
    PoolExhaustedError,
    ShapeError,
)

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Setup:
    """A cache shape: one head ``(d,)``, or ``(num_q_heads, d)`` over ``(num_kv_heads, d)``."""

    name: str
    num_q_heads: int | None
    num_kv_heads: int
    head_dim: int
    dtype: Any = np.float64

    def pool(self, num_blocks: int = 8) -> KVPool:
        return KVPool(
            num_blocks, block_size=2, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype,
        )

    def token(self, index: int) -> Arrays:
        rng = np.random.default_rng(index)
        if self.num_q_heads is None:
            q_shape: tuple[int, ...] = (self.head_dim,)
            kv_shape: tuple[int, ...] = (self.head_dim,)
        else:
            q_shape = (self.num_q_heads, self.head_dim)
            kv_shape = (self.num_kv_heads, self.head_dim)
        return (
            rng.uniform(-2, 2, q_shape).astype(self.dtype),
            rng.uniform(-2, 2, kv_shape).astype(self.dtype),
            rng.uniform(-2, 2, kv_shape).astype(self.dtype),
        )


ONE_HEAD = Setup("one head", None, 1, 3)
MANY_HEADS = Setup("many heads", 2, 2, 3)
GQA = Setup("gqa", 4, 2, 3)
FLOAT32 = Setup("float32 gqa", 2, 1, 2, np.float32)
SETUPS = [ONE_HEAD, MANY_HEADS, GQA, FLOAT32]


def snapshot(cache: KVCache, pool: KVPool) -> tuple[Any, ...]:
    """Everything a caller can observe of a cache and its pool."""
    return (
        len(cache), cache.num_tokens, cache.block_ids, cache.closed,
        pool.num_free_blocks, pool.allocator.free_block_ids(),
        cache.keys().tolist(), cache.values().tolist(),
    )


def prefilled(setup: Setup, pool: KVPool, max_size: int = 3) -> KVCache:
    # block_size 2, four tokens; max_size 3:  b0 |- 1| b1 |2 3|   (index 0 evicted)
    #                            max_size 4:  b0 |0 1| b1 |2 3|
    cache = KVCache(max_size=max_size, pool=pool)
    num_tokens = 4
    for index in range(num_tokens):
        cache.attend(*setup.token(index))
    return cache


def assert_same_future(
    cache: KVCache, twin: KVCache, setup: Setup, start: int, *, same_block_ids: bool = True
) -> None:
    """Feed both caches the same tokens: every output (and block table) agrees."""
    for index in range(start, start + 5):
        out = cache.attend(*setup.token(index))
        expected = twin.attend(*setup.token(index))
        assert out.dtype == expected.dtype
        assert np.array_equal(out, expected)
        assert len(cache) == len(twin)
        if same_block_ids:
            assert cache.block_ids == twin.block_ids
        cache.check_invariants()


def raises_and_changes_nothing(
    cache: KVCache, pool: KVPool, call: Callable[[], Any], error: type, builtin: type,
    fragment: str,
) -> PagedKVError:
    before = snapshot(cache, pool)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        call()
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, PagedKVError)
    assert snapshot(cache, pool) == before
    cache.check_invariants()
    pool.check_invariants()
    return info.value


# ------------------------------------------------------------ the error table

BIG = float(np.sqrt(np.finfo(np.float32).max))  # finite in float32; BIG * BIG is not


def pad(x: np.ndarray) -> np.ndarray:
    """``x`` with one more value on its last axis (another head_dim)."""
    return np.concatenate([x, x[..., :1]], axis=-1)


def put(x: np.ndarray, value: float) -> np.ndarray:
    y = x.astype(np.float64)
    y.flat[-1] = value
    return y


# (id, applies to, make bad (q, k, v) from good ones, error, builtin, fragment(bad q, k, v))
Row = tuple[
    str, Callable[[Setup], bool], Callable[[Arrays], tuple[Any, Any, Any]],
    type[PagedKVError], type, Callable[[Any, Any, Any], str],
]
ANY: Callable[[Setup], bool] = lambda s: True  # noqa: E731
HEADS: Callable[[Setup], bool] = lambda s: s.num_q_heads is not None  # noqa: E731

BAD_INPUTS: list[Row] = [
    # q is checked against k before k against the cache: the error names both head_dims.
    ("k and v with another head_dim", ANY, lambda t: (t[0], pad(t[1]), pad(t[2])),
     ShapeError, ValueError, lambda q, k, v: f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}"),
    ("q, k, v with another head_dim", ANY, lambda t: (pad(t[0]), pad(t[1]), pad(t[2])),
     ShapeError, ValueError, lambda q, k, v: f"holds k/v of shape {v[..., :-1].shape}, got {k.shape}"),
    ("q with another head_dim", ANY, lambda t: (pad(t[0]), t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}"),
    ("k and v of different shapes", ANY, lambda t: (t[0], t[1], pad(t[2])),
     ShapeError, ValueError, lambda q, k, v: f"got {k.shape} and {v.shape}"),
    ("q with three dimensions", ANY, lambda t: (t[0][None, None], t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: f"got shape {q.shape}"),
    ("k and v with three dimensions", ANY, lambda t: (t[0], t[1][None, None], t[2][None, None]),
     ShapeError, ValueError, lambda q, k, v: f"got shape {k.shape}"),
    ("q a 0-d array", ANY, lambda t: (np.array(1.0), t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: "got shape ()"),
    ("q and k with different numbers of dimensions", ANY,
     lambda t: (t[0].reshape(1, -1)[:, : t[1].shape[-1]], t[1].reshape(-1), t[2].reshape(-1)),
     ShapeError, ValueError, lambda q, k, v: "q and k must both be"),
    ("Hq not a multiple of Hkv", lambda s: s.num_kv_heads > 1,
     lambda t: (np.concatenate([t[0], t[0][:1]]), t[1], t[2]),
     ShapeError, ValueError,
     lambda q, k, v: f"num_q_heads={q.shape[0]} is not a multiple of num_kv_heads={k.shape[0]}"),
    ("fewer q heads than kv heads", lambda s: s.num_kv_heads > 1,
     lambda t: (t[0][:1], t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: "num_q_heads=1 is not a multiple"),
    ("empty q", ANY, lambda t: (np.empty(0), t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: "q is empty (shape (0,))"),
    ("empty lists", ANY, lambda t: ([], [], []),
     ShapeError, ValueError, lambda q, k, v: "q is empty"),
    ("empty heads", HEADS, lambda t: (t[0][:, :0], t[1][:, :0], t[2][:, :0]),
     ShapeError, ValueError, lambda q, k, v: f"q is empty (shape {q.shape})"),
    ("NaN in q", ANY, lambda t: (put(t[0], np.nan), t[1], t[2]),
     NonFiniteError, ValueError, lambda q, k, v: "q holds nan"),
    ("inf in k", ANY, lambda t: (t[0], put(t[1], np.inf), t[2]),
     NonFiniteError, ValueError, lambda q, k, v: "k holds inf"),
    ("-inf in v", ANY, lambda t: (t[0], t[1], put(t[2], -np.inf)),
     NonFiniteError, ValueError, lambda q, k, v: "v holds -inf"),
    ("NaN in a list", ANY, lambda t: (t[0].tolist(), t[1].tolist(), put(t[2], np.nan).tolist()),
     NonFiniteError, ValueError, lambda q, k, v: "v holds nan"),
    ("a value overflowing float32", lambda s: s.dtype == np.float32,
     lambda t: (t[0], put(t[1], 1e39), t[2]),
     NonFiniteError, ValueError, lambda q, k, v: "overflows float32"),
    ("scores that would overflow", ANY,
     lambda t: (np.full_like(t[0], BIG if t[0].dtype == np.float32 else 1e160),
                np.full_like(t[1], BIG if t[0].dtype == np.float32 else 1e160), t[2]),
     NonFiniteError, ValueError, lambda q, k, v: "attention scores could reach"),
    ("q a string", ANY, lambda t: ("0.5", t[1], t[2]),
     InputTypeError, TypeError, lambda q, k, v: "q must be a list or numpy array of real numbers, got str"),
    ("k None", ANY, lambda t: (t[0], None, t[2]),
     InputTypeError, TypeError, lambda q, k, v: "got NoneType"),
    ("v a float", ANY, lambda t: (t[0], t[1], 1.0),
     InputTypeError, TypeError, lambda q, k, v: "got float"),
    ("complex v", ANY, lambda t: (t[0], t[1], t[2] + 1j),
     InputTypeError, TypeError, lambda q, k, v: f"got complex numbers (dtype {v.dtype})"),
    ("complex in a list", ANY, lambda t: ([complex(x) for x in t[0].ravel()], t[1], t[2]),
     InputTypeError, TypeError, lambda q, k, v: "q must hold real numbers, got complex"),
    ("bools", ANY, lambda t: (t[0] > 0, t[1], t[2]),
     InputTypeError, TypeError, lambda q, k, v: "got bools (dtype bool)"),
    ("strings in a list", ANY, lambda t: (t[0], ["a"] * t[1].size, t[2]),
     InputTypeError, TypeError, lambda q, k, v: "k must hold real numbers, got strings"),
    ("None in a list", ANY, lambda t: (t[0], t[1], [None] * t[2].size),
     InputTypeError, TypeError, lambda q, k, v: "v must hold real numbers, got objects"),
    ("ragged list", HEADS, lambda t: ([row[:1] for row in t[0].tolist()[:1]] + t[0].tolist()[1:],
                                      t[1], t[2]),
     ShapeError, ValueError, lambda q, k, v: "q must be a rectangular list of numbers"),
]


def _params() -> list[Any]:
    params = []
    for setup in SETUPS:
        for name, applies, *rest in BAD_INPUTS:
            if applies(setup):
                params.append(pytest.param(setup, *rest, id=f"{setup.name}: {name}"))
    return params


@pytest.mark.parametrize(("setup", "make_bad", "error", "builtin", "fragment"), _params())
def test_bad_input_raises_and_changes_nothing(
    setup: Setup, make_bad: Callable[[Arrays], tuple[Any, Any, Any]], error: type,
    builtin: type, fragment: Callable[[Any, Any, Any], str],
) -> None:
    pool = setup.pool()
    cache = prefilled(setup, pool)
    twin = prefilled(setup, setup.pool())
    q, k, v = make_bad(setup.token(99))
    raises_and_changes_nothing(
        cache, pool, lambda: cache.attend(q, k, v), error, builtin, fragment(q, k, v)
    )
    assert_same_future(cache, twin, setup, start=4)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_bad_first_input_on_a_shared_pool_fixes_no_shape(setup: Setup) -> None:
    pool = setup.pool()
    cache = KVCache(max_size=3, pool=pool)
    _, k, _ = setup.token(0)
    # k shaped for one more kv head than the pool stores: refused before anything is kept
    wide = np.concatenate([k.reshape(-1, setup.head_dim)] * 2)
    error = raises_and_changes_nothing(
        cache, pool, lambda: cache.attend(wide, wide, wide), ShapeError, ValueError,
        f"the pool stores (num_kv_heads, head_dim)=({setup.num_kv_heads}, {setup.head_dim})",
    )
    assert str(wide.shape) in str(error)
    assert_same_future(cache, KVCache(max_size=3, pool=setup.pool()), setup, start=0)


def test_bad_first_input_on_a_private_cache_creates_no_pool() -> None:
    cache = KVCache(max_size=3, block_size=2)
    with pytest.raises(NonFiniteError):
        cache.attend([1.0, np.nan], [1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ShapeError):
        cache.attend([1.0, 2.0], [1.0, 2.0], [1.0])
    assert cache.pool is None
    assert (len(cache), cache.block_ids) == (0, [])
    # The refused shapes fixed nothing: another head_dim is accepted now.
    assert cache.attend([1.0], [1.0], [42.0]) == [42.0]


def test_a_refused_key_does_not_count_towards_the_overflow_bound() -> None:
    cache, twin = KVCache(), KVCache()
    huge = 1e160
    with pytest.raises(NonFiniteError, match="attention scores could reach"):
        cache.attend([huge], [huge], [1.0])
    # Only the refused key made q = 1e160 dangerous; it was never stored.
    assert cache.attend([huge], [1.0], [3.0]) == twin.attend([huge], [1.0], [3.0]) == [3.0]


def test_exhausted_pool_raises_and_changes_nothing() -> None:
    setup = GQA
    pool = setup.pool(num_blocks=3)
    cache = prefilled(setup, pool, max_size=4)  # b0 |0 1| b1 |2 3|
    filler = KVCache(pool=pool)
    filler.attend(*setup.token(50))  # takes b2: free []
    twin = prefilled(setup, setup.pool(), max_size=4)
    # Token 4's window is 1..4: b0 still holds index 1, so eviction releases
    # nothing, and index 4 needs a new block: b0 |- 1| b1 |2 3| b? |4 .|
    error = raises_and_changes_nothing(
        cache, pool, lambda: cache.attend(*setup.token(4)), PoolExhaustedError, MemoryError,
        "need 1 block, 0 free of 3",
    )
    assert (error.num_needed, error.num_free, error.num_total) == (1, 0, 3)
    assert "close a sequence" in str(error)
    filler.close()
    # The pools' histories differ now (the filler used b2), so only the outputs must agree.
    assert_same_future(cache, twin, setup, start=4, same_block_ids=False)


def test_closed_cache_raises_and_changes_nothing() -> None:
    setup = MANY_HEADS
    pool = setup.pool()
    cache = prefilled(setup, pool)
    cache.close()
    assert pool.num_free_blocks == 8
    raises_and_changes_nothing(
        cache, pool, lambda: cache.attend(*setup.token(4)), ClosedCacheError, RuntimeError,
        "this KVCache is closed",
    )
    # A closed cache refuses even input that is bad in other ways: closed is checked first.
    with pytest.raises(ClosedCacheError):
        cache.attend(None, None, None)


# ------------------------------------------------------ construction errors

BAD_CONFIGS: list[tuple[str, dict[str, Any], type[PagedKVError], type, str]] = [
    ("max_size 0", {"max_size": 0}, ConfigError, ValueError,
     "max_size must be None or a positive int, got 0"),
    ("max_size negative", {"max_size": -2}, ConfigError, ValueError, "got -2"),
    ("max_size numpy 0", {"max_size": np.int64(0)}, ConfigError, ValueError, "got 0"),
    ("max_size bool", {"max_size": True}, InputTypeError, TypeError, "got True (bool)"),
    ("max_size numpy bool", {"max_size": np.bool_(True)}, InputTypeError, TypeError, "(bool)"),
    ("max_size float", {"max_size": 2.0}, InputTypeError, TypeError, "got 2.0 (float)"),
    ("max_size numpy float", {"max_size": np.float64(3.0)}, InputTypeError, TypeError, "(float64)"),
    ("max_size string", {"max_size": "3"}, InputTypeError, TypeError, "got '3' (str)"),
    ("block_size 0", {"block_size": 0}, ConfigError, ValueError, "block_size must be an int >= 1, got 0"),
    ("block_size negative", {"block_size": -4}, ConfigError, ValueError, "got -4"),
    ("block_size float", {"block_size": 4.0}, InputTypeError, TypeError, "got 4.0"),
    ("block_size string", {"block_size": "4"}, InputTypeError, TypeError, "got '4'"),
    ("block_size bool", {"block_size": True}, InputTypeError, TypeError, "got True"),
    ("dtype float16", {"dtype": np.float16}, ConfigError, ValueError, "float32 or float64, got float16"),
    ("dtype int", {"dtype": np.int32}, ConfigError, ValueError, "got int32"),
    ("dtype nonsense", {"dtype": "nonsense"}, InputTypeError, TypeError, "got 'nonsense'"),
    ("scale NaN", {"scale": float("nan")}, NonFiniteError, ValueError, "scale must be finite, got nan"),
    ("scale inf", {"scale": float("inf")}, NonFiniteError, ValueError, "got inf"),
    ("scale string", {"scale": "1"}, InputTypeError, TypeError, "scale must be a real number, got '1'"),
    ("scale bool", {"scale": True}, InputTypeError, TypeError, "got True"),
    ("scale complex", {"scale": 1j}, InputTypeError, TypeError, "got 1j"),
    ("pool not a pool", {"pool": "pool"}, InputTypeError, TypeError,
     "pool must be a KVPool or None, got str"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "builtin", "fragment"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_CONFIGS],
)
def test_bad_config_raises(kwargs: dict[str, Any], error: type, builtin: type, fragment: str) -> None:
    with pytest.raises(error, match=re.escape(fragment)) as info:
        KVCache(**kwargs)
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, PagedKVError)


POOL_MISMATCHES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("block_size", {}, {"block_size": 2}, "block_size=2 but the pool's block_size is 4"),
    ("dtype", {}, {"dtype": np.float32}, "dtype=float32 but the pool stores float64"),
    ("layers", {"num_layers": 2}, {}, "num_layers=2"),
    ("bad max_size with a pool", {}, {"max_size": 0}, "got 0"),
]


@pytest.mark.parametrize(
    ("pool_kwargs", "cache_kwargs", "fragment"),
    [pytest.param(*row[1:], id=row[0]) for row in POOL_MISMATCHES],
)
def test_config_disagreeing_with_the_pool_raises_and_leaves_the_pool_alone(
    pool_kwargs: dict[str, Any], cache_kwargs: dict[str, Any], fragment: str
) -> None:
    pool = KVPool(3, block_size=4, head_dim=1, **pool_kwargs)
    user = KVCache(pool=pool) if pool.num_layers == 1 else None
    if user is not None:
        user.attend([1.0], [1.0], [1.0])
    before = (pool.num_free_blocks, pool.allocator.free_block_ids())
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        KVCache(pool=pool, **cache_kwargs)
    assert isinstance(info.value, ValueError)
    assert (pool.num_free_blocks, pool.allocator.free_block_ids()) == before
    pool.check_invariants()


# --------------------------------------------------------- the error classes

BUILTINS = {
    "PagedKVError": Exception,
    "ConfigError": ValueError,
    "InputTypeError": TypeError,
    "ShapeError": ValueError,
    "NonFiniteError": ValueError,
    "PoolExhaustedError": MemoryError,
    "PoolTooLargeError": MemoryError,
    "BlockStateError": RuntimeError,
    "BlockTableError": ValueError,
    "DoubleFreeError": RuntimeError,
    "UnknownBlockError": LookupError,
    "ClosedCacheError": RuntimeError,
    "UnknownSequenceError": LookupError,
    "DuplicateSequenceError": ValueError,
    "SequenceStateError": RuntimeError,
    "LayerIndexError": IndexError,
}
_BUILTIN_BASES = (ValueError, TypeError, MemoryError, LookupError, RuntimeError)


@pytest.mark.parametrize("name", sorted(pagedkv.errors.__all__))
def test_every_error_is_a_pagedkv_error_and_a_builtin(name: str) -> None:
    cls = getattr(pagedkv.errors, name)
    assert issubclass(cls, PagedKVError)
    # An error added later (and not yet in the table) must still fit a builtin.
    assert issubclass(cls, BUILTINS.get(name, _BUILTIN_BASES)) or cls is PagedKVError
    assert getattr(pagedkv, name) is cls


@pytest.mark.parametrize("field", ["q", "k", "v"])
def test_values_too_large_for_any_sum_are_refused_and_nothing_changes(field: str) -> None:
    # Every input must stay below finfo.max / 16 so no softmax-weighted sum (nor a
    # partial sum inside a matmul) can overflow; a Python int past float range too.
    for huge in (1e308, 10**400):
        cache = KVCache(max_size=2, block_size=2)
        cache.attend([1.0], [1.0], [1.0])
        args = {"q": [1.0], "k": [1.0], "v": [1.0]}
        args[field] = [huge]
        with pytest.raises(NonFiniteError, match=field):
            cache.attend(args["q"], args["k"], args["v"])
        assert len(cache) == 1 and cache.num_tokens == 1
        assert cache.attend([1.0], [1.0], [3.0]) == [2.0]
