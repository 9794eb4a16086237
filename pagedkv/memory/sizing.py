"""Sizing a pool: how many blocks a batch of requests needs, and how many bytes a block takes.

:func:`blocks_needed` bounds the blocks sequences hold at once (windows and sinks included, no
sharing counted: forks and prefix hits hold fewer); :func:`bytes_per_block` is a block's bytes.
vLLM: ``kv_cache_utils`` (``get_kv_cache_config``); SGLang: ``profile_max_num_token``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy.typing as npt

from pagedkv.counts import ceil_div, check_count, check_max_size
from pagedkv.errors import InputTypeError
from pagedkv.memory.pool import KVPool

__all__ = ["blocks_needed", "bytes_per_block"]


def _span_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks ``num_tokens`` consecutive logical indices can touch (any alignment)."""
    return 0 if num_tokens <= 0 else (num_tokens + block_size - 2) // block_size + 1


def blocks_needed(
    lengths: Iterable[int],
    *,
    block_size: int,
    max_size: int | None = None,
    num_sink_tokens: int = 0,
    max_chunk: int | None = None,
) -> int:
    """Blocks that sequences of ``lengths`` tokens hold at most, all at once.

    A sequence of ``L`` tokens with no window holds ``ceil(L / block_size)``
    blocks at its end. With a window ``W`` it frees what slides out, but each
    reservation keeps the blocks its *first* new token still attends to, so one
    reservation of ``c`` tokens holds the sink blocks plus the blocks spanning at
    most ``W - 1 + c`` tokens, at any alignment::

        block_size 4, W = 5, decode (c = 1) at index 9:  window 5..9
            | 0 1 2 3 | 4 5 6 7 | 8 9 . . |   blocks 1 and 2 held (at most ceil((W - 1)/4) + 1 = 2)

    The bound counts no sharing (forks and prefix hits hold fewer) and no
    copy-on-write (one transient block per shared, partly filled last block).

    Args:
        lengths: each sequence's final length (prompt and output).
        block_size: the pool's block size.
        max_size: the manager's window (the largest layer window), or None.
        num_sink_tokens: the manager's sink tokens.
        max_chunk: the most tokens one ``reserve`` gives a sequence (the
            prefill chunk); None means a whole sequence at once.

    Returns:
        The sum over sequences of the most blocks each holds at any step.

    >>> blocks_needed([10, 3], block_size=4)
    4
    >>> blocks_needed([1000], block_size=16, max_size=64, max_chunk=1)  # a windowed decode
    5

    Raises:
        InputTypeError, ConfigError: a length or size is not an int of the right range.
    """
    block_size = check_count("block_size", block_size)
    window = check_max_size(max_size)
    num_sink_tokens = check_count("num_sink_tokens", num_sink_tokens, minimum=0)
    chunk = None if max_chunk is None else check_count("max_chunk", max_chunk)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise InputTypeError(f"lengths must be an iterable of token counts, got {type(lengths).__name__}")
    total = 0
    num_sink_blocks = ceil_div(num_sink_tokens, block_size)
    for length in lengths:
        length = check_count("length", length, minimum=0)
        whole = ceil_div(length, block_size)
        if window is None or length <= num_sink_tokens:
            total += whole
            continue
        step = length if chunk is None else min(chunk, length)
        window_part = min(window - 1 + step, length - num_sink_tokens)
        total += min(whole, num_sink_blocks + _span_blocks(window_part, block_size))
    return total


def bytes_per_block(
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: npt.DTypeLike,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
) -> int:
    """Bytes one block takes in a pool of this shape: keys and values of every layer, scales included.

    Exactly ``KVPool(..., ).bytes_per_block`` for the same arguments.

    >>> import numpy as np
    >>> bytes_per_block(block_size=16, num_layers=1, num_kv_heads=8, head_dim=128, dtype=np.float32)
    131072

    Raises:
        InputTypeError, ConfigError: as ``KVPool`` does.
    """
    probe = KVPool(
        1,
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
    )
    return probe.bytes_per_block
