"""Checking the ints callers pass (counts, sizes, windows) and the block arithmetic of a window.

numpy-free on purpose: the allocator validates its arguments here too, and it
never imports numpy (numpy's integer types still pass, through
``numbers.Integral``). Each check only reads its argument.

>>> check_count("num_blocks", 4)
4
>>> window_blocks(max_size=5, block_size=4)
3
"""

from __future__ import annotations

from numbers import Integral
from typing import cast

from pagedkv.errors import ConfigError, InputTypeError, LayerIndexError

__all__ = ["ChunkedWindow", "ceil_div", "check_count", "check_layer", "check_max_size", "window_blocks"]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, exactly (no float rounding).

    >>> ceil_div(9, 4), ceil_div(8, 4), ceil_div(0, 4)
    (3, 2, 0)
    """
    return -(-a // b)


def window_blocks(max_size: int, block_size: int) -> int:
    """At most how many blocks a window of ``max_size`` tokens holds: ``ceil(max_size / block_size) + 1``.

    The window may start anywhere inside a block, so it can touch one block
    more than ``ceil(max_size / block_size)``; the bound is reached whenever
    ``max_size % block_size != 1``::

        block_size 4, max_size 6:   . . . x | x x x x | x . . .   3 blocks
    """
    return ceil_div(max_size, block_size) + 1


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_count(name: str, value: object, *, minimum: int = 1) -> int:
    """Validate an int count that must be at least ``minimum``; return it as a plain int.

    Raises:
        InputTypeError: not an int (bools, floats and strings included).
        ConfigError: below ``minimum``.

    >>> check_count("block_size", "3")
    Traceback (most recent call last):
    ...
    pagedkv.errors.InputTypeError: block_size must be an int >= 1, got '3'
    """
    if not _is_int(value):
        raise InputTypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    count = int(cast(Integral, value))
    if count < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {count}")
    return count


class ChunkedWindow(int):
    """Chunked local attention of ``C`` tokens (Llama 4): the token at ``p`` sees ``p // C * C .. p``.

    As an int it is the sliding window ``C``, which holds every token a chunk
    can see: blocks are freed, prefix hits accepted and truncations checked by
    that window (at most one chunk more than a chunk needs); attention masks by
    the chunk::

        C = 4:  token 9 sees 8 9 (its chunk 8..11), where a window of 4 sees 6 7 8 9

    >>> ChunkedWindow(4), int(ChunkedWindow(4)) == 4
    (ChunkedWindow(4), True)
    """

    __slots__ = ()

    def __new__(cls, size: object) -> ChunkedWindow:
        checked = check_max_size(size, "attention_chunk_size")
        if checked is None:
            raise ConfigError("attention_chunk_size must be a positive int, got None")
        return super().__new__(cls, checked)

    def __repr__(self) -> str:
        return f"ChunkedWindow({int(self)})"

    def chunk_start(self, position: int) -> int:
        """The first index the token at ``position`` sees."""
        return position - position % self


def check_max_size(max_size: object, name: str = "max_size") -> int | None:
    """Validate a window size: ``None`` (unbounded) or a positive int.

    Raises:
        InputTypeError: a bool, float, string or other non-int.
        ConfigError: zero or negative.
    """
    if max_size is None:
        return None
    if max_size.__class__ is ChunkedWindow:
        return max_size  # validated when made
    if not _is_int(max_size):
        raise InputTypeError(
            f"{name} must be None or a positive int, got {max_size!r} ({type(max_size).__name__})"
        )
    size = int(cast(Integral, max_size))
    if size < 1:
        raise ConfigError(f"{name} must be None or a positive int, got {size}")
    return size


def check_layer(layer: object, num_layers: int) -> int:
    """Validate a layer index in ``0 .. num_layers - 1``; return it.

    Raises:
        InputTypeError: not an int.
        LayerIndexError: out of range.
    """
    if not _is_int(layer):
        raise InputTypeError(f"layer must be an int, got {layer!r}")
    index = int(cast(Integral, layer))
    if not 0 <= index < num_layers:
        raise LayerIndexError(f"layer {index} is out of range 0..{num_layers - 1}")
    return index
