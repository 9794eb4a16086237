"""``as_bounded_vectors``' fast path for an array of exactly the dtype, against its general path.

The fast path (two scans, no temporaries) must return what the general path
returns and refuse what it refuses, with the same error: an ndarray subclass
never takes the fast path, so it shows what the general path does with the
same numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.errors import PagedKVError
from pagedkv.inputs import as_bounded_vectors, as_vectors, value_limit


class _Plain(np.ndarray):
    """An ndarray subclass with nothing added: it takes as_vectors' general path."""


def _outcome(value: Any, dtype: np.dtype[Any], ndims: tuple[int, ...]) -> tuple[Any, ...]:
    try:
        array, as_list, largest = as_bounded_vectors("k", value, dtype, ndims=ndims)
    except PagedKVError as error:
        return ("error", type(error), str(error))
    assert largest == float(np.abs(array).max())
    return ("ok", array.tobytes(), array.dtype, array.shape, as_list, largest)


def _special(dtype: np.dtype[Any]) -> st.SearchStrategy[float]:
    limit = value_limit(dtype)
    return st.sampled_from([np.nan, np.inf, -np.inf, limit, -limit, limit * 1.5, -limit * 1.5, 0.0, -0.0])


@given(
    dtype=st.sampled_from([np.dtype(np.float32), np.dtype(np.float64)]),
    shape=st.sampled_from([(3,), (2, 4), (1, 1, 2), (0,), (2, 0)]),
    ndims=st.sampled_from([(1, 2), (1,), (3,)]),
    data=st.data(),
)
def test_the_fast_path_returns_and_refuses_what_the_general_path_does(
    dtype: np.dtype[Any], shape: tuple[int, ...], ndims: tuple[int, ...], data: st.DataObject
) -> None:
    size = int(np.prod(shape))
    numbers = data.draw(st.lists(st.floats(-4, 4), min_size=size, max_size=size))
    values = np.array(numbers, dtype).reshape(shape)
    if size and data.draw(st.booleans()):
        values.flat[data.draw(st.integers(0, size - 1))] = data.draw(_special(dtype))
    fast = _outcome(values, dtype, ndims)
    general = _outcome(values.view(_Plain), dtype, ndims)
    assert fast == general
    if fast[0] == "ok":
        assert as_vectors("k", values, dtype, ndims=ndims)[0] is values  # no copy


def test_an_array_of_another_dtype_is_converted_as_before() -> None:
    values = np.array([1.0, 2.0], np.float64)
    converted, _ = as_vectors("k", values, np.dtype(np.float32))
    assert converted.dtype == np.float32 and converted is not values
    with pytest.raises(PagedKVError, match="overflows float32"):
        as_vectors("k", np.array([1e39]), np.dtype(np.float32))
