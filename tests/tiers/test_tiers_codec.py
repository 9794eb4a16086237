"""A block as bytes and back, its store key, and the checks that refuse any value but the one asked for."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv.errors import ConfigError, InputTypeError, PagedKVError
from pagedkv.memory.pool import KVPool
from pagedkv.tiers.codec import (
    HEADER_SIZE,
    BlockLayout,
    RefusedValueError,
    decode_block,
    encode_block,
    load_block,
    read_block,
    store_key,
)

LAYOUT = BlockLayout("model-a", 4, 2, 8, 3, "float32", None, None, 0, 64)
PAYLOAD = bytes(range(64))
OTHER_MODEL = dataclasses.replace(LAYOUT, model_id="model-b")


def test_two_models_or_layouts_never_share_a_store_key() -> None:
    keys = {store_key(LAYOUT, b"k")}
    for change in ({"model_id": "model-b"}, {"block_size": 8}, {"num_kv_heads": 1}, {"head_dim": 4},
                   {"num_layers": 2}, {"dtype": "float64"}, {"key_dtype": "int8"}, {"group": 1}):
        keys.add(store_key(dataclasses.replace(LAYOUT, **change), b"k"))
    assert len(keys) == 9
    assert store_key(LAYOUT, b"k") != store_key(LAYOUT, b"j")  # the chained prefix key is in it too


def test_a_value_round_trips_and_its_payload_is_exact() -> None:
    value = encode_block(LAYOUT, b"key", PAYLOAD)
    assert bytes(decode_block(LAYOUT, b"key", value)) == PAYLOAD
    assert len(value) == HEADER_SIZE + 3 + 16 + 64


@pytest.mark.parametrize(
    ("hostile", "fragment"),
    [
        (lambda v: v[:10], "shorter than"),
        (lambda v: v[:-1], "half-written"),
        (lambda v: v + b"x", "half-written"),
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
        (lambda v: b"XXXX" + v[4:], "format"),
        (lambda v: encode_block(OTHER_MODEL, b"key", PAYLOAD), "another layout"),
        (lambda v: encode_block(LAYOUT, b"other", PAYLOAD), "prefix key"),
    ],
    ids=["short", "truncated", "long", "flipped-bit", "magic", "other-layout", "other-prefix"],
)
def test_hostile_values_are_refused_with_a_reason(hostile, fragment) -> None:  # type: ignore[no-untyped-def]
    value = hostile(encode_block(LAYOUT, b"key", PAYLOAD))
    with pytest.raises(RefusedValueError, match=fragment) as caught:
        decode_block(LAYOUT, b"key", value)
    assert isinstance(caught.value, PagedKVError) and isinstance(caught.value, ValueError)


def test_encoding_a_payload_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="63 bytes, expected 64"):
        encode_block(LAYOUT, b"k", PAYLOAD[:-1])


def test_a_layout_refuses_an_empty_model_id_and_bad_sizes() -> None:
    with pytest.raises(InputTypeError, match="model_id"):
        BlockLayout("", 4, 2, 8, 3, "float32", None, None, 0, 64)
    with pytest.raises(ConfigError, match="block_size"):
        BlockLayout("m", 0, 2, 8, 3, "float32", None, None, 0, 64)


@pytest.mark.parametrize("storage", [None, "int8", "float16"])
def test_a_block_read_whole_loads_back_bit_identical_in_another_block(storage: str | None) -> None:
    pool = KVPool(4, block_size=4, num_kv_heads=2, head_dim=8, num_layers=3, dtype=np.float32,
                  key_dtype=storage, value_dtype=storage)
    rng = np.random.default_rng(0)
    for layer in range(3):
        pool.write(layer, np.arange(4, 8), rng.standard_normal((4, 2, 8)), rng.standard_normal((4, 2, 8)))
    payload = read_block(pool, 1)
    layout = BlockLayout.of_pool(pool, "m")
    assert payload.nbytes == layout.block_nbytes
    load_block(pool, 3, bytes(payload))
    assert read_block(pool, 3).tobytes() == payload.tobytes()
    for layer in range(3):
        assert np.array_equal(pool.key_pages(layer)[3], pool.key_pages(layer)[1])
        assert np.array_equal(pool.value_pages(layer)[3], pool.value_pages(layer)[1])
        if storage == "int8":
            assert np.array_equal(pool.key_scales(layer)[:, 3], pool.key_scales(layer)[:, 1])


def test_loading_a_payload_of_the_wrong_size_changes_nothing() -> None:
    pool = KVPool(2, block_size=2, head_dim=2, dtype=np.float32)
    before = read_block(pool, 1).copy()
    with pytest.raises(ConfigError, match="expected 32"):
        load_block(pool, 1, b"\x01" * 15)
    assert np.array_equal(read_block(pool, 1), before)
