"""A state machine drives several ``KVCache`` objects on one small shared pool.

The real caches and a deliberately dumb model run in lockstep. The model of a
cache is its ``OracleCache`` (the window's entries as Python lists) plus its
token count; from that alone it predicts everything the pool must show:

* a cache holds the distinct logical blocks of its window,
  ``(n - 1) // block_size - window_start // block_size + 1`` of them;
* the pool's free count is ``num_blocks`` minus the sum over open caches;
* an attend must raise ``PoolExhaustedError`` exactly when the blocks the cache
  would hold afterwards, plus every other cache's, exceed ``num_blocks``.

Sizes are drawn once and tiny (1–8 blocks of 1–4 slots), so the pool runs out
in almost every example. At the end, planted bugs prove the machine catches
real defects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv import KVCache, KVPool, reference
from pagedkv.blocks.table import BlockTable
from pagedkv.errors import (
    ClosedCacheError,
    InputTypeError,
    NonFiniteError,
    PagedKVError,
    PoolExhaustedError,
    ShapeError,
)
from pagedkv.testing import oracle

MAX_OPEN_CACHES = 4
MAX_CACHES = 8


@dataclass(frozen=True)
class Config:
    """Sizes drawn once per run."""

    num_blocks: int
    block_size: int
    head_dim: int
    num_kv_heads: int
    num_q_heads: int | None  # None: one head, vectors of shape (head_dim,)
    dtype: Any
    scale: float

    @property
    def q_shape(self) -> tuple[int, ...]:
        if self.num_q_heads is None:
            return (self.head_dim,)
        return (self.num_q_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        if self.num_q_heads is None:
            return (self.head_dim,)
        return (self.num_kv_heads, self.head_dim)

    @property
    def eps(self) -> float:
        return oracle.FLOAT32_EPS if self.dtype == np.float32 else oracle.FLOAT64_EPS


@st.composite
def configs(draw: st.DrawFn) -> Config:
    head_dim = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["one head", "many heads", "gqa"]))
    if layout == "one head":
        num_kv_heads, num_q_heads = 1, None
    elif layout == "many heads":
        num_kv_heads = draw(st.integers(1, 3))
        num_q_heads = num_kv_heads
    else:
        num_kv_heads = draw(st.integers(1, 2))
        num_q_heads = num_kv_heads * draw(st.integers(2, 3))
    return Config(
        num_blocks=draw(st.integers(1, 8)),
        block_size=draw(st.integers(1, 4)),
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_q_heads,
        dtype=draw(st.sampled_from([np.float64, np.float64, np.float64, np.float32])),
        scale=draw(st.sampled_from([1.0, 1.0 / math.sqrt(head_dim), 0.5])),
    )


#: Small windows are the interesting ones: they slide within a few steps.
max_sizes = st.one_of(st.none(), st.integers(1, 4), st.integers(1, 12))

# Exactly representable in float32: the oracle and the cache see the same numbers.
elements = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.0]), st.floats(-6, 6, width=32))


@dataclass
class CacheModel:
    """What one cache must look like: its window, token count and state."""

    max_size: int | None
    block_size: int
    oracle: oracle.OracleCache
    num_tokens: int = 0
    closed: bool = False

    def window_start(self, num_tokens: int) -> int:
        return 0 if self.max_size is None else max(0, num_tokens - self.max_size)

    def num_blocks_held(self, num_tokens: int | None = None) -> int:
        """The distinct logical blocks of the window after ``num_tokens`` tokens."""
        n = self.num_tokens if num_tokens is None else num_tokens
        if self.closed or n == 0:
            return 0
        return (n - 1) // self.block_size - self.window_start(n) // self.block_size + 1

    def reset(self) -> None:
        self.num_tokens = 0
        self.oracle = oracle.OracleCache(self.max_size, scale=self.oracle.scale)


@dataclass
class Handle:
    """A cache in the bundle, with its model."""

    number: int
    cache: KVCache
    model: CacheModel = field(repr=False)

    def __repr__(self) -> str:
        return f"cache{self.number}(max_size={self.model.max_size})"


def default_cache(max_size: int | None, pool: KVPool, scale: float) -> KVCache:
    return KVCache(max_size, pool=pool, scale=scale)


def pad(x: np.ndarray) -> np.ndarray:
    """``x`` with one more value on its last axis: another head_dim."""
    return np.concatenate([x, x[..., :1]], axis=-1)


BAD_KINDS = [
    "other head_dim", "q other head_dim", "k v shapes differ", "three dims", "hq not multiple",
    "empty", "nan", "inf", "-inf", "string", "none", "complex", "bools", "overflow",
]


class CacheMachine(RuleBasedStateMachine):
    """Several caches on one fixed pool, checked against the model after every step."""

    #: Builds each cache; planted-bug tests override it.
    cache_factory: Callable[[int | None, KVPool, float], KVCache] = staticmethod(default_cache)
    #: Raises the drawn pool size to at least this; planted-bug tests use it.
    min_num_blocks = 1

    caches = Bundle("caches")  # open caches
    closed_caches = Bundle("closed_caches")

    def __init__(self) -> None:
        super().__init__()
        self.config: Config | None = None
        self.pool: KVPool | None = None
        self.handles: list[Handle] = []

    # ------------------------------------------------------------ helpers

    def draw_token(self, data: Any) -> tuple[list[Any], list[Any], list[Any]]:
        assert self.config is not None

        def nested(shape: tuple[int, ...]) -> list[Any]:
            flat = data.draw(
                st.lists(elements, min_size=math.prod(shape), max_size=math.prod(shape))
            )
            return np.array(flat).reshape(shape).tolist()  # type: ignore[no-any-return]

        config = self.config
        return nested(config.q_shape), nested(config.kv_shape), nested(config.kv_shape)

    def snapshot(self, handle: Handle) -> tuple[Any, ...]:
        assert self.pool is not None
        return (
            len(handle.cache), handle.cache.num_tokens, handle.cache.block_ids,
            self.pool.num_free_blocks, self.pool.allocator.free_block_ids(),
        )

    def others_held(self, handle: Handle) -> int:
        return sum(h.model.num_blocks_held() for h in self.handles if h is not handle)

    def must_exhaust(self, handle: Handle) -> bool:
        """Whether the next attend on ``handle`` finds no block, by the model alone."""
        assert self.config is not None
        model = handle.model
        if model.num_tokens % self.config.block_size:
            return False  # the newest block has a free slot: no block needed
        after = model.num_blocks_held(model.num_tokens + 1)
        return self.others_held(handle) + after > self.config.num_blocks

    def checked_attend(self, handle: Handle, token: tuple[Any, Any, Any], as_array: bool) -> None:
        """One attend on an open cache, compared with the model in every way."""
        assert self.config is not None and self.pool is not None
        config, model, cache = self.config, handle.model, handle.cache
        q, k, v = token
        inputs = tuple(np.array(x, config.dtype) for x in token) if as_array else token
        if self.must_exhaust(handle):
            before = self.snapshot(handle)
            note(f"{handle}: pool exhausted at {model.num_tokens} tokens")
            event("attend refused: pool exhausted")
            with pytest.raises(PoolExhaustedError, match=f"0 free of {config.num_blocks}"):
                cache.attend(*inputs)
            assert self.snapshot(handle) == before
            return
        out = cache.attend(*inputs)
        model.num_tokens += 1
        if model.max_size is not None and model.num_tokens > model.max_size:
            event("attend evicted an entry")
        expected = model.oracle.attend(q, k, v)
        window_keys, window_values = model.oracle.keys, model.oracle.values
        exact = reference.attend_window(
            q, window_keys, window_values, scale=config.scale, dtype=config.dtype
        )
        if as_array:
            assert isinstance(out, np.ndarray)
            assert out.dtype == np.dtype(config.dtype)
            assert out.shape == config.q_shape
            assert np.array_equal(out, exact), f"{out} != recompute {exact}"
            got = out.tolist()
        else:
            assert isinstance(out, list)
            assert out == exact.tolist(), f"{out} != recompute {exact.tolist()}"
            got = out
        assert oracle.within_tolerance(got, expected, model.oracle.last_max_abs_score, config.eps), (
            f"{got} vs oracle {expected}"
        )

    # -------------------------------------------------------------- rules

    @initialize(target=caches, config=configs(), max_size=max_sizes)
    def create_pool(self, config: Config, max_size: int | None) -> Handle:
        config = replace(config, num_blocks=max(config.num_blocks, self.min_num_blocks))
        note(f"{config}")
        self.config = config
        self.pool = KVPool(
            config.num_blocks, block_size=config.block_size,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=config.dtype,
        )
        return self.create_cache(max_size)

    @precondition(
        lambda self: len(self.handles) < MAX_CACHES
        and sum(not h.model.closed for h in self.handles) < MAX_OPEN_CACHES
    )
    @rule(target=caches, max_size=max_sizes)
    def create_cache(self, max_size: int | None) -> Handle:
        assert self.config is not None and self.pool is not None
        cache = type(self).cache_factory(max_size, self.pool, self.config.scale)
        model = CacheModel(
            max_size, self.config.block_size, oracle.OracleCache(max_size, self.config.scale)
        )
        handle = Handle(len(self.handles), cache, model)
        self.handles.append(handle)
        note(f"created {handle}")
        return handle

    @rule(handle=caches, as_array=st.booleans(), data=st.data())
    def attend(self, handle: Handle, as_array: bool, data: Any) -> None:
        token = self.draw_token(data)
        note(f"{handle}.attend(q={token[0]}, k={token[1]}, v={token[2]})")
        self.checked_attend(handle, token, as_array)

    @rule(handle=caches, num_tokens=st.integers(2, 8), data=st.data())
    def stream(self, handle: Handle, num_tokens: int, data: Any) -> None:
        """Several attends in a row, so windows slide past whole blocks."""
        for _ in range(num_tokens):
            token = self.draw_token(data)
            note(f"{handle}.attend(q={token[0]}, k={token[1]}, v={token[2]})")
            self.checked_attend(handle, token, as_array=True)

    @rule(handle=caches, data=st.data())
    def exhaust_pool(self, handle: Handle, data: Any) -> None:
        """Attend one token over and over until the model says no block is left."""
        assert self.config is not None
        token = self.draw_token(data)
        limit = self.config.num_blocks * self.config.block_size + 1
        for _ in range(limit):
            exhausted = self.must_exhaust(handle)
            self.checked_attend(handle, token, as_array=False)
            if exhausted:
                note(f"{handle}: exhausted the pool")
                return
        # A windowed cache alone may never run out; that is right, not a failure.
        note(f"{handle}: {limit} attends and the pool never ran out")
        assert handle.model.max_size is not None

    # Keeping one cache open keeps most rules enabled (an empty bundle disables
    # them all, and Hypothesis gives up on the example).
    @precondition(lambda self: sum(not h.model.closed for h in self.handles) >= 2)
    @rule(target=closed_caches, handle=consumes(caches))
    def close(self, handle: Handle) -> Handle:
        assert self.pool is not None
        freed = handle.model.num_blocks_held()
        before = self.pool.num_free_blocks
        handle.cache.close()
        handle.model.closed = True
        handle.model.reset()
        note(f"closed {handle}, freeing {freed} blocks")
        assert self.pool.num_free_blocks == before + freed
        assert handle.cache.closed
        return handle

    @rule(handle=closed_caches, data=st.data())
    def use_closed_cache(self, handle: Handle, data: Any) -> None:
        """A closed cache refuses to attend, and closing it again does nothing."""
        before = self.snapshot(handle)
        with pytest.raises(ClosedCacheError, match="closed"):
            handle.cache.attend(*self.draw_token(data))
        handle.cache.close()
        assert self.snapshot(handle) == before
        event("closed cache refused")

    @rule(handle=caches)
    def clear(self, handle: Handle) -> None:
        handle.cache.clear()
        handle.model.reset()
        note(f"cleared {handle}")
        assert (len(handle.cache), handle.cache.block_ids) == (0, [])

    @rule(handle=caches, kind=st.sampled_from(BAD_KINDS), data=st.data())
    def feed_bad_input(self, handle: Handle, kind: str, data: Any) -> None:
        assert self.config is not None
        config = self.config
        q, k, v = (np.array(x, np.float64) for x in self.draw_token(data))
        if kind == "hq not multiple" and (config.num_q_heads is None or config.num_kv_heads == 1):
            kind = "three dims"  # every Hq is a multiple of Hkv = 1
        big = math.sqrt(float(np.finfo(config.dtype).max))
        bad: tuple[Any, Any, Any]
        error: type[PagedKVError]
        if kind == "other head_dim":
            bad, error = (pad(q), pad(k), pad(v)), ShapeError
        elif kind == "q other head_dim":
            bad, error = (pad(q), k, v), ShapeError
        elif kind == "k v shapes differ":
            bad, error = (q, k, pad(v)), ShapeError
        elif kind == "three dims":
            bad, error = (q[None, None], k[None, None], v[None, None]), ShapeError
        elif kind == "hq not multiple":
            bad, error = (q[:1], k, v), ShapeError
        elif kind == "empty":
            bad, error = ([], [], []), ShapeError
        elif kind in ("nan", "inf", "-inf"):
            value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind]
            position = data.draw(st.integers(0, 2), label="which of q, k, v")
            arrays = [q.copy(), k.copy(), v.copy()]
            arrays[position].flat[0] = value
            bad, error = (arrays[0], arrays[1], arrays[2]), NonFiniteError
        elif kind == "string":
            bad, error = ("q", k, v), InputTypeError
        elif kind == "none":
            bad, error = (q, None, v), InputTypeError
        elif kind == "complex":
            bad, error = (q, k, v + 1j), InputTypeError
        elif kind == "bools":
            bad, error = (q > 0, k, v), InputTypeError
        else:  # overflow: finite values whose scores would not be
            bad, error = (np.full_like(q, big), np.full_like(k, big), v), NonFiniteError
        before = self.snapshot(handle)
        note(f"{handle}: bad input ({kind}) -> {error.__name__}")
        event(f"bad input -> {error.__name__}")
        with pytest.raises(error):
            handle.cache.attend(*bad)
        assert self.snapshot(handle) == before

    # ---------------------------------------------------------- invariants

    @invariant()
    def pool_matches_model(self) -> None:
        if self.pool is None or self.config is None:
            return
        pool, num_blocks = self.pool, self.config.num_blocks
        held_ids: list[int] = []
        for handle in self.handles:
            cache, model = handle.cache, handle.model
            cache.check_invariants()
            assert len(cache) == len(model.oracle), f"{handle}: len {len(cache)}"
            assert cache.num_blocks == model.num_blocks_held(), (
                f"{handle}: {cache.num_blocks} blocks held, model says {model.num_blocks_held()}"
            )
            assert cache.closed == model.closed
            held_ids += cache.block_ids
        pool.check_invariants()
        predicted_free = num_blocks - sum(h.model.num_blocks_held() for h in self.handles)
        assert pool.num_free_blocks == predicted_free, (
            f"{pool.num_free_blocks} blocks free, model says {predicted_free}"
        )
        # Without the pool's own checker: every block held by one table or free, once.
        assert sorted(held_ids + pool.allocator.free_block_ids()) == list(range(num_blocks))


# Examples and steps come from the loaded profile (tests/conftest.py).
TestCacheMachine = CacheMachine.TestCase


# ================================================================ planted bugs


class EvictsAfterScoring(KVCache):
    """Planted bug: scores the oldest entry too, then evicts it (W + 1 entries attended)."""

    def attend(self, q: Any, k: Any, v: Any) -> Any:
        max_size = self._max_size
        if max_size is None:
            return super().attend(q, k, v)
        self._max_size = max_size + 1
        try:
            out = super().attend(q, k, v)
        finally:
            self._max_size = max_size
        released = self.block_table.evict_to(self.num_tokens - max_size)
        if released:
            assert self.pool is not None
            self.pool.allocator.free(released)
        return out


class ForgetsOneReleasedBlock(BlockTable):
    """Planted bug: when the window slides past a block, its ref count is never dropped."""

    def evict_to(self, window_start: int) -> list[int]:
        return super().evict_to(window_start)[1:]


class LeaksNewestBlockOnClear(BlockTable):
    """Planted bug: ``clear`` forgets to give back the newest block."""

    def clear(self) -> list[int]:
        return super().clear()[1:]


def evicts_after_scoring(max_size: int | None, pool: KVPool, scale: float) -> KVCache:
    return EvictsAfterScoring(max_size, pool=pool, scale=scale)


def with_table(table_class: type[BlockTable]) -> Callable[[int | None, KVPool, float], KVCache]:
    def factory(max_size: int | None, pool: KVPool, scale: float) -> KVCache:
        cache = KVCache(max_size, pool=pool, scale=scale)
        cache._table = table_class(cache.block_size)  # fresh and empty: safe to swap
        return cache

    return factory


PLANTED = {
    "evicts after scoring": evicts_after_scoring,
    "missed ref-count decrement on eviction": with_table(ForgetsOneReleasedBlock),
    "missed ref-count decrement on clear/close": with_table(LeaksNewestBlockOnClear),
}


def hunt_settings() -> settings:
    return settings(
        max_examples=300,
        stateful_step_count=30,
        deadline=None,
        database=None,
        derandomize=True,  # the same hunt every run: the test cannot flake
        report_multiple_bugs=False,
        # NOTE: no shrink phase. A hunt proves only that the machine fails; each bug
        # fails within its first 60 examples (under 0.1 s), and shrinking took 95%
        # of the hunts' time (7.5 s of 7.8) for a report pytest.raises throws away.
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_machine_catches_a_planted_bug(bug: str) -> None:
    class PlantedMachine(CacheMachine):
        cache_factory = staticmethod(PLANTED[bug])

    # On a tiny pool the bugs surface as an unexpected PoolExhaustedError (the
    # extra or leaked block is missing) or as a failed invariant.
    with pytest.raises((AssertionError, PagedKVError)):
        run_state_machine_as_test(PlantedMachine, settings=hunt_settings())


#: The largest window a roomy cache draws (small windows slide, and show the bug, within a few steps).
ROOMY_MAX_SIZE = 4


class RoomyMachine(CacheMachine):
    """Windowed caches only, on a pool that can never run out, so only the outputs can tell.

    A cache with window ``W`` holds at most ``W`` blocks, and ``W + 2`` while the
    planted bug keeps one entry too many; with every open cache at the largest
    window the pool still has room, so an attend is never refused and the bug
    cannot surface as a ``PoolExhaustedError`` before it surfaces in an output
    (with an 8-block pool, 1 hunt in 20 with other seeds found the exhaustion
    first).
    """

    cache_factory = staticmethod(evicts_after_scoring)
    min_num_blocks = MAX_OPEN_CACHES * (ROOMY_MAX_SIZE + 2)

    @initialize(target=CacheMachine.caches, config=configs(), max_size=st.integers(1, ROOMY_MAX_SIZE))
    def create_pool(self, config: Config, max_size: int | None) -> Handle:
        return super().create_pool(config, max_size)

    @precondition(
        lambda self: len(self.handles) < MAX_CACHES
        and sum(not h.model.closed for h in self.handles) < MAX_OPEN_CACHES
    )
    @rule(target=CacheMachine.caches, max_size=st.integers(1, ROOMY_MAX_SIZE))
    def create_cache(self, max_size: int | None) -> Handle:
        return super().create_cache(max_size)

    def exhaust_pool(self, handle: Handle, data: Any) -> None:
        """Not a rule here: the pool never runs out."""


def test_the_machine_catches_evicting_after_scoring_by_its_outputs() -> None:
    with pytest.raises(AssertionError, match=r"recompute|oracle"):
        run_state_machine_as_test(RoomyMachine, settings=hunt_settings())


def test_the_planted_bugs_are_bugs() -> None:
    """Each planted cache really differs from KVCache on a tiny hand-built stream."""
    pool = KVPool(4, block_size=1, head_dim=1)
    honest = KVCache(1, pool=KVPool(4, block_size=1, head_dim=1))
    wrong = evicts_after_scoring(1, pool, 1.0)
    honest.attend([0.0], [0.0], [1.0])
    wrong.attend([0.0], [0.0], [1.0])
    assert honest.attend([0.0], [0.0], [3.0]) == [3.0]
    assert wrong.attend([0.0], [0.0], [3.0]) == [2.0]  # the evicted 1.0 was still scored
    leaky = with_table(ForgetsOneReleasedBlock)(1, pool, 1.0)
    leaky.attend([0.0], [0.0], [1.0])
    leaky.attend([0.0], [0.0], [1.0])
    with pytest.raises(AssertionError, match="ref count 1 but 0 block tables"):
        pool.check_invariants()
