"""``attend``'s one-sequence fast path (issue 14): the same checks, errors and outputs as the general path.

Every test drives two managers with the same calls: on ``fast`` ``attend``
runs as shipped, on ``general`` the fast path is switched off (it always
declines), so ``KVCacheManager._attend_layer`` decides. Outcomes (errors and
their messages, output bytes) and everything observable must agree. The
score bound's shortcut is compared with the exact rule, and the kernel's
keys-first scoring with a float64 oracle that shares no code with it.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.arrays import token_arrays
from support.managers import make_manager, manager_state, settle

from pagedkv import KVCacheManager, attention
from pagedkv.errors import NonFiniteError, PagedKVError
from pagedkv.inputs import check_score_bound, check_score_bound_from_max
from pagedkv.manager.reserve import Batch
from pagedkv.reference import attend_window

F32 = np.dtype(np.float32)


def _outcome(call: Any, *args: Any, **kwargs: Any) -> Any:
    """What a call did: the output's bytes, or the error's type and message."""
    try:
        out = call(*args, **kwargs)
    except PagedKVError as error:
        return type(error), str(error)
    return None if out is None else (out.dtype, out.shape, out.tobytes())


def _general_attend(manager: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
    """``manager.attend`` with the fast path declining, so the general path decides."""
    saved = KVCacheManager._attend_one_sequence
    KVCacheManager._attend_one_sequence = lambda *_: None  # type: ignore[method-assign,assignment]
    try:
        return manager.attend(*args, **kwargs)
    finally:
        KVCacheManager._attend_one_sequence = saved  # type: ignore[method-assign]


# Queries an attend may get: good ones, bad values, and bad types, dtypes and shapes.
BAD_QUERY_VALUES = (np.nan, np.inf, -np.inf, 3e38, -3e38, 1e30)

QUERIES = token_arrays((1, 4, 2), BAD_QUERY_VALUES)


def _apply(manager: KVCacheManager, seen: list[Batch], op: str, layer: int, big_key: bool) -> None:
    pool = manager.pool
    value = 1e19 if big_key else 0.5  # a large key makes the score bound bite
    kv = np.full((1, pool.num_kv_heads, pool.head_dim), value, np.float32)
    if op in ("reserve", "step"):
        seen.append(manager.reserve({"a": 1}))
        for written in range(pool.num_layers if op == "step" else 0):
            manager.write(written, seen[-1], kv, kv)
    elif op == "write" and seen:
        manager.write(layer, seen[-1], kv, kv)
    elif op == "cancel":
        manager.cancel_reservation("a")
    elif op == "fork":
        manager.fork("a", "b") if "b" not in manager else manager.free("b")


CALLS = st.lists(
    st.tuples(
        st.sampled_from(
            ["step", "step", "reserve", "write", "attend", "attend", "attend", "attend_old", "cancel", "fork"]
        ),
        st.sampled_from([0, 1, 0, 1, 2]),  # layer (2 is out of range)
        QUERIES,
        st.sampled_from(["loop", "loop", "loop", "padded", "nope"]),
        st.sampled_from([None, 0.5, 1e20]),  # the per-call scale
        st.booleans(),
    ),
    max_size=30,
)


def _compare(options: dict[str, Any], calls: list[Any]) -> None:
    """Make ``calls`` on a fast and a general manager; fail at the first difference."""
    shape: dict[str, Any] = dict(
        block_size=2, num_layers=2, num_kv_heads=2, head_dim=2, dtype=np.float32, num_q_heads=4
    )
    managers = [make_manager(12, **shape, **options) for _ in range(2)]
    batches: list[list[Batch]] = [[], []]
    for manager in managers:
        manager.add_sequence("a")
    for op, layer, queries, method, scale, big_key in calls:
        if op in ("attend", "attend_old"):
            if not batches[0]:
                continue
            index = -1 if op == "attend" else 0
            fast = _outcome(managers[0].attend, layer, batches[0][index], queries, method=method, scale=scale)
            general = _outcome(
                _general_attend, managers[1], layer, batches[1][index], queries, method=method, scale=scale
            )
            assert fast == general
        else:
            outcomes = [
                _outcome(_apply, manager, seen, op, layer, big_key)
                for manager, seen in zip(managers, batches)
            ]
            assert outcomes[0] == outcomes[1]
        assert manager_state(managers[0]) == manager_state(managers[1])
        managers[0].check_invariants()


@pytest.mark.parametrize(
    "options",
    [{}, {"trusted_inputs": True}, {"num_sink_tokens": 1, "max_size": 3}, {"layer_max_sizes": [2, None]}],
)
@given(calls=CALLS)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_attend_of_one_sequence_does_what_the_general_path_does(
    options: dict[str, Any], calls: list[Any]
) -> None:
    # A trusted manager bounds no scores: huge keys and scales overflow as
    # numpy overflows (a warning, NaN outputs), on both paths alike.
    if options.get("trusted_inputs"):
        with np.errstate(all="ignore"):
            _compare(options, calls)
    else:
        _compare(options, calls)


def test_the_comparison_catches_a_fast_path_without_the_score_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    good = np.ones((1, 4, 2), np.float32)
    calls = [
        ("reserve", 0, good, "loop", None, False),
        ("write", 0, good, "loop", None, True),  # keys of 1e19
        ("write", 1, good, "loop", None, True),
        ("attend", 0, good, "loop", 1e20, False),  # scores could reach 1e20 * 2 * 1e19: refused
    ]
    _compare({}, calls)  # as shipped: both refuse
    fast_path = KVCacheManager._attend_one_sequence

    def without_the_bound(manager: KVCacheManager, *args: Any) -> Any:  # planted: no bound (nor scan)
        return fast_path(manager, *args[:-1], False)

    monkeypatch.setattr(KVCacheManager, "_attend_one_sequence", without_the_bound)
    with pytest.raises(AssertionError), np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planted fast path overflows: an output of NaN, no error
        _compare({}, calls)


def test_a_decode_takes_the_fast_path_and_matches_the_reference() -> None:
    manager = make_manager(8, block_size=4, num_kv_heads=2, head_dim=3, num_q_heads=4, dtype=np.float32)
    manager.add_sequence("a")
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((6, 2, 3)).astype(np.float32)
    values = rng.standard_normal((6, 2, 3)).astype(np.float32)
    batch = manager.reserve({"a": 5})
    manager.write(0, batch, keys[:5], values[:5])
    batch = manager.reserve({"a": 1})
    manager.write(0, batch, keys[5:], values[5:])
    query = rng.standard_normal((1, 4, 3)).astype(np.float32)
    direct = manager._attend_one_sequence(0, batch, query, "loop", 0.5, True)
    assert direct is not None  # the fast path took it
    expected = attend_window(query[0], list(keys), list(values), scale=0.5, dtype=np.float32)
    through_manager = manager.attend(0, batch, query, scale=0.5)
    assert direct.tobytes() == through_manager.tobytes() == expected[None].tobytes()


@pytest.mark.parametrize(
    ("queries", "fragment"),
    [
        (np.full((1, 1, 1), np.nan, np.float64), "queries holds nan"),
        (np.full((1, 1, 1), 1e308), "queries holds a value of magnitude 1e\\+308"),
        (np.ones((2, 1, 1)), r"queries must have shape .* \(1, 1, 1\)"),
        (np.full((1, 1, 1), 1e208), "attention scores could reach 1e\\+308"),
    ],
)
def test_a_refused_decode_attend_changes_nothing(queries: Any, fragment: str) -> None:
    manager = make_manager(8, block_size=4)
    manager.add_sequence("a")
    settle(manager, {"a": 3}, value=1e100)
    batch = manager.reserve({"a": 1})
    kv = np.full((1, 1, 1), 1e100)
    manager.write(0, batch, kv, kv)
    before = manager_state(manager)
    with pytest.raises(PagedKVError, match=fragment):
        manager.attend(0, batch, queries)
    assert manager_state(manager) == before
    assert manager.attend(0, batch, np.ones((1, 1, 1))).tolist() == [[[1e100]]]  # the batch is still good


MAGNITUDES = st.sampled_from([0.0, 1e-30, 1.0, 3.0, 1e10, 1e17, 1e18, 3e18, 1e19, 1e30])


@given(
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=6, max_size=6),
    MAGNITUDES,
    MAGNITUDES,
    st.sampled_from([0.125, 1.0, -2.0, 1e-20]),
)
def test_the_bound_shortcut_refuses_exactly_what_the_rule_refuses(
    unit: list[float], query_scale: float, max_abs_key: float, scale: float
) -> None:
    queries = (np.array(unit, np.float32) * np.float32(min(query_scale, 1e30))).reshape(1, 2, 3)
    largest = float(np.abs(queries).max())

    def rule() -> Any:
        check_score_bound(scale, queries, max_abs_key, F32)

    def shortcut() -> Any:
        check_score_bound_from_max(scale, queries, largest, max_abs_key, F32)

    assert _outcome(shortcut) == _outcome(rule)


def test_the_shortcut_defers_to_the_rule_when_its_bound_is_too_loose() -> None:
    # head_dim 4, one large entry: the cheap bound is 4 * 1e18 * 1e19 = 4e37 > 2.1e37 (float32 max / 16),
    # the exact one 1e18 * 1e19 = 1e37: accepted.
    queries = np.array([[1e18, 0.0, 0.0, 0.0]], np.float32)
    check_score_bound_from_max(1.0, queries, 1e18, 1e19, F32)
    with pytest.raises(NonFiniteError, match="could reach"):
        check_score_bound_from_max(1.0, queries * 3, 3e18, 1e19, F32)


def _oracle(query: Any, keys: Any, values: Any, scale: float) -> Any:
    """Grouped-query attention in float64 by loops over heads: no pagedkv code."""
    num_q_heads, num_kv_heads = query.shape[0], keys.shape[1]
    out = np.empty(query.shape)
    for head in range(num_q_heads):
        kv_head = head // (num_q_heads // num_kv_heads)
        k = keys[:, kv_head].astype(np.float64)
        scores = k @ query[head].astype(np.float64) * scale
        weights = np.exp(scores - scores.max())
        out[head] = weights @ values[:, kv_head].astype(np.float64) / weights.sum()
    return out


@pytest.mark.parametrize("num_tokens", [
    attention.KEYS_FIRST_MIN_TOKENS - 1, attention.KEYS_FIRST_MIN_TOKENS,
    attention.GROUPED_CHUNK_MIN_TOKENS - 1, attention.GROUPED_CHUNK_MIN_TOKENS,
])
def test_grouped_queries_score_keys_first_from_the_threshold_and_in_chunks_from_the_next(
    num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(num_tokens)
    keys = rng.standard_normal((num_tokens, 2, 8)).astype(np.float32)  # (num_tokens, num_kv_heads, head_dim)
    values = rng.standard_normal((num_tokens, 2, 8)).astype(np.float32)
    query = rng.standard_normal((4, 8)).astype(np.float32)
    first_operands: list[tuple[int, ...]] = []
    real = np.matmul

    def spy(*args: Any, **kwargs: Any) -> Any:
        first_operands.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "matmul", spy)
    out = attention.attend_dense(query, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), 0.3)
    if num_tokens >= attention.GROUPED_CHUNK_MIN_TOKENS:  # keys first, chunk by chunk
        score_chunk, value_chunk = attention.GROUPED_CHUNK_TOKENS
        expected = [(2, min(score_chunk, num_tokens - at), 8) for at in range(0, num_tokens, score_chunk)]
        expected += [(2, 2, min(value_chunk, num_tokens - at)) for at in range(0, num_tokens, value_chunk)]
    else:  # one matmul each, keys first from KEYS_FIRST_MIN_TOKENS
        keys_first = num_tokens >= attention.KEYS_FIRST_MIN_TOKENS
        expected = [(2, num_tokens, 8) if keys_first else (2, 2, 8), (2, 2, num_tokens)]
    assert first_operands == expected
    np.testing.assert_allclose(out, _oracle(query, keys, values, 0.3), rtol=1e-4, atol=1e-5)


def _chunked_decodes_match_the_oracle() -> bool:
    """Long grouped decodes at every chunk edge (``GROUPED_CHUNK_TOKENS``), each near the float64 oracle."""
    score_chunk, value_chunk = attention.GROUPED_CHUNK_TOKENS
    first = attention.GROUPED_CHUNK_MIN_TOKENS
    edges = (first, first + score_chunk, first + value_chunk + score_chunk)
    lengths = sorted({n + d for n in edges for d in (-1, 0, 1)})
    for num_tokens in lengths:
        rng = np.random.default_rng(num_tokens)
        keys = rng.standard_normal((num_tokens, 2, 8)).astype(np.float32)
        values = rng.standard_normal((num_tokens, 2, 8)).astype(np.float32)
        query = rng.standard_normal((6, 8)).astype(np.float32)  # group 3
        out = attention.attend_dense(query, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), 0.3)
        if not np.allclose(out, _oracle(query, keys, values, 0.3), rtol=1e-4, atol=1e-5):
            return False
    return True


def test_a_long_grouped_decode_is_right_at_every_chunk_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _chunked_decodes_match_the_oracle()
    # Planted: the value chunks after the first are never added. The same check must fail.
    real = attention._attend_keys_first

    def first_value_chunk_only(grouped: Any, keys: Any, values: Any, scale: float) -> Any:
        dropped = values.copy()
        dropped[:, attention.GROUPED_CHUNK_TOKENS[1] :] = 0.0
        return real(grouped, keys, dropped, scale)

    monkeypatch.setattr(attention, "_attend_keys_first", first_value_chunk_only)
    assert not _chunked_decodes_match_the_oracle()


def test_a_long_grouped_decode_keeps_the_promoted_dtype() -> None:
    # float32 queries over float64 keys: the chunks' scores are float64, as one matmul's would be.
    num_tokens = attention.GROUPED_CHUNK_MIN_TOKENS + 5
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((2, num_tokens, 8))
    values = rng.standard_normal((2, num_tokens, 8))
    query = rng.standard_normal((6, 8)).astype(np.float32)
    out = attention.attend_dense(query, keys, values, 0.3)
    assert out.dtype == np.float64
    assert out.tobytes() == attention.attend_dense(query.astype(np.float64), keys, values, 0.3).tobytes()


@pytest.mark.parametrize("num_tokens", [
    attention.KEYS_FIRST_MIN_TOKENS + 40,  # the keys-first scoring
    attention.GROUPED_CHUNK_MIN_TOKENS + 300,  # chunk by chunk
])
def test_a_long_grouped_decode_equals_the_reference_bit_for_bit(num_tokens: int) -> None:
    manager = make_manager(-(-num_tokens // 16), block_size=16, num_kv_heads=2, head_dim=4, num_q_heads=6,
                           dtype=np.float32)
    manager.add_sequence("a")
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((num_tokens, 2, 4)).astype(np.float32)
    values = rng.standard_normal((num_tokens, 2, 4)).astype(np.float32)
    batch = manager.reserve({"a": num_tokens - 1})
    manager.write(0, batch, keys[:-1], values[:-1])
    batch = manager.reserve({"a": 1})
    manager.write(0, batch, keys[-1:], values[-1:])
    query = rng.standard_normal((1, 6, 4)).astype(np.float32)
    out = manager.attend(0, batch, query, scale=0.7)
    expected = attend_window(query[0], list(keys), list(values), scale=0.7, dtype=np.float32)
    assert out[0].tobytes() == expected.tobytes()
    np.testing.assert_allclose(out[0], _oracle(query[0], keys, values, 0.7), rtol=1e-4, atol=1e-5)


def test_an_unscanned_query_skips_its_values_but_not_its_shape() -> None:
    manager = make_manager(8, block_size=4)
    manager.add_sequence("a")
    batch = settle(manager, {"a": 2}, value=1e200)
    def attend_one_sequence(queries: Any, method: str, scan: bool = True) -> Any:
        return manager._attend_one_sequence(0, batch, queries, method, 1.0, scan)

    huge = np.full((2, 1, 1), 1e200)  # scores could reach 1e400: refused when scanned
    with pytest.raises(NonFiniteError, match="could reach"):
        attend_one_sequence(huge, "loop")
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine vouched: its overflow is its own
        assert attend_one_sequence(huge, "loop", False) is not None
    with pytest.raises(PagedKVError, match="queries must have shape"):
        attend_one_sequence(np.ones((1, 1, 1)), "loop", False)
