"""``pagedkv.memory.sizing``: the block bound is never exceeded by a real manager, and is reached."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.managers import make_manager, settle

from pagedkv import KVPool
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.memory.sizing import blocks_needed, bytes_per_block


@settings(max_examples=80, deadline=None)
@given(
    length=st.integers(1, 60),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    max_size=st.sampled_from([None, 1, 3, 5, 8]),
    sinks=st.sampled_from([0, 1, 3]),
    max_chunk=st.sampled_from([None, 1, 2, 5]),
    data=st.data(),
)
def test_a_manager_never_holds_more_than_the_bound(
    length: int, block_size: int, max_size: int | None, sinks: int, max_chunk: int | None, data: st.DataObject
) -> None:
    manager = make_manager(128, block_size=block_size, max_size=max_size, num_sink_tokens=sinks)
    manager.add_sequence("a")
    bound = blocks_needed(
        [length], block_size=block_size, max_size=max_size, num_sink_tokens=sinks, max_chunk=max_chunk
    )
    peak = done = 0
    while done < length:
        most = length - done if max_chunk is None else min(max_chunk, length - done)
        n = data.draw(st.integers(1, most))
        settle(manager, {"a": n})
        peak = max(peak, manager.pool.num_used_blocks)
        done += n
    assert peak <= bound


def test_the_bound_is_reached_by_a_long_windowed_decode() -> None:
    manager = make_manager(64, block_size=4, max_size=6)
    manager.add_sequence("a")
    peak = 0
    for _ in range(40):
        batch = manager.reserve({"a": 1})
        manager.write(0, batch, np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))
        peak = max(peak, manager.pool.num_used_blocks)
    assert peak == blocks_needed([40], block_size=4, max_size=6, max_chunk=1) == 3


def test_several_sequences_add_up() -> None:
    assert blocks_needed([10, 3, 0], block_size=4) == 3 + 1 + 0
    assert blocks_needed([], block_size=4) == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"lengths": 5}, InputTypeError, "lengths must be an iterable"),
    ({"lengths": "ab"}, InputTypeError, "lengths must be an iterable"),
    ({"lengths": [3, -1]}, ConfigError, "length"),
    ({"lengths": [3, 2.5]}, InputTypeError, "length"),
    ({"lengths": [3], "block_size": 0}, ConfigError, "block_size"),
    ({"lengths": [3], "max_chunk": 0}, ConfigError, "max_chunk"),
])
def test_bad_arguments_are_refused(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    kwargs.setdefault("block_size", 4)
    with pytest.raises(error, match=match):
        blocks_needed(**kwargs)  # type: ignore[arg-type]


def test_bytes_per_block_is_the_pool_s() -> None:
    shape = {"block_size": 8, "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": np.float32,
             "key_dtype": "int8", "value_dtype": None}
    assert bytes_per_block(**shape) == KVPool(4, **shape).bytes_per_block  # type: ignore[arg-type]
    assert bytes_per_block(block_size=16, num_layers=1, num_kv_heads=8, head_dim=128, dtype=np.float32) == (
        2 * 16 * 8 * 128 * 4
    )
