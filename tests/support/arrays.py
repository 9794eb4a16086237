"""Hypothesis strategies for the k, v and q arrays ``write`` and ``attend`` get, good and bad."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

#: Values a good array holds (float32, well inside every bound).
GOOD = st.floats(-4.0, 4.0, width=32)


@st.composite
def token_arrays(draw: st.DrawFn, shape: tuple[int, int, int], bad_values: tuple[float, ...]) -> Any:
    """A float32 array of ``shape``, mostly good.

    Otherwise one with a value from ``bad_values``, the same numbers as a
    list, in float64 or in another shape (the last two axes swapped, or
    ``(1, 1, n)`` when they are equal), or no array at all.
    """
    kind = draw(st.sampled_from(["good", "good", "good", "bad value", "list", "dtype", "shape", "object"]))
    size = int(np.prod(shape))
    values = np.array(draw(st.lists(GOOD, min_size=size, max_size=size)), np.float32).reshape(shape)
    if kind == "bad value":
        values.flat[draw(st.integers(0, size - 1))] = draw(st.sampled_from(bad_values))
    elif kind == "list":
        return values.tolist()
    elif kind == "dtype":
        return values.astype(np.float64)
    elif kind == "shape":
        swapped = (shape[0], shape[2], shape[1])
        return values.reshape(swapped if swapped != shape else (1, 1, size))
    elif kind == "object":
        return "not an array"
    return values
