"""Extra keys: whole-sequence kinds in every block, multimodal items only where their placeholders are."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.prefix import Runner, key_chain, make

from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.prefix.keys import block_tails, decode_extra_keys, encode_extra_keys

scalar = st.one_of(st.text(max_size=4), st.binary(max_size=4), st.integers(-5, 10**20))
items = st.lists(st.tuples(scalar, st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=3)


@given(salt=st.none() | scalar, adapter=st.none() | scalar, multimodal=st.none() | scalar | items)
def test_encoding_round_trips(salt: Any, adapter: Any, multimodal: Any) -> None:
    pairs = (("salt", salt), ("adapter", adapter), ("multimodal", multimodal))
    given_keys = {kind: value for kind, value in pairs if value is not None}
    decoded = decode_extra_keys(encode_extra_keys(given_keys))
    if isinstance(multimodal, list):  # items come back in offset order
        given_keys["multimodal"] = sorted(multimodal, key=repr)
        decoded["multimodal"] = sorted(decoded["multimodal"], key=repr)  # type: ignore[call-overload]
    assert decoded == given_keys


def test_an_item_reaches_only_the_blocks_its_placeholders_overlap() -> None:
    encoded = encode_extra_keys({"salt": "t", "multimodal": [("img", 6, 4)]})
    whole = encode_extra_keys({"salt": "t"})
    tails = block_tails(encoded, 0, 4, 4)  # blocks 0..3 hold tokens 0..15; the image is 6..9
    assert isinstance(tails, list)
    assert [tail == whole for tail in tails] == [True, False, False, True]
    assert block_tails(encoded, 2, 2, 4) == tails[2:]
    assert block_tails(whole, 0, 4, 4) == whole  # no items: one tail for all, as always


def test_same_text_before_different_images_shares_the_blocks_before_them() -> None:
    # vLLM's multimodal rule, replayed: 48 text tokens, then a 16-token image placeholder.
    runner = Runner(make(num_blocks=40, block_size=16))
    prompt = list(range(100, 148)) + [7] * 16 + [1, 2, 3]
    runner.add("a", prompt, extra_keys={"multimodal": [("image-a", 48, 16)]})
    runner.feed({"a": prompt})
    num_hit = runner.add("b", prompt, extra_keys={"multimodal": [("image-b", 48, 16)]})
    assert num_hit == 48  # the three text blocks; the image's block differs
    keys_a = key_chain(prompt, 16, {"multimodal": [("image-a", 48, 16)]})
    keys_b = key_chain(prompt, 16, {"multimodal": [("image-b", 48, 16)]})
    assert keys_a[:3] == keys_b[:3] and keys_a[3] != keys_b[3]
    # A whole-sequence multimodal key still keeps the two apart everywhere.
    first_a = key_chain(prompt, 16, {"multimodal": "image-a"})[0]
    assert first_a != key_chain(prompt, 16, {"multimodal": "image-b"})[0]


@pytest.mark.parametrize("value, error, match", [
    ([("img", -1, 2)], ConfigError, "offset must be >= 0"),
    ([("img", 0, 0)], ConfigError, "length must be >= 1"),
    ([("img", 0)], InputTypeError, "must be \\(identifier, offset, length\\)"),
    ([("img", 1.5, 2)], InputTypeError, "offset must be an int"),
    ([(None, 0, 2)], InputTypeError, "must be str, bytes or int"),
])
def test_bad_items_are_refused(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        encode_extra_keys({"multimodal": value})
