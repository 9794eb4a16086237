"""transformers' tensor layout to pagedkv's and back, once per call.

transformers passes ``(batch, heads, seq, head_dim)``; the manager takes the
batch's new tokens flattened in batch order, ``(tokens, heads, head_dim)``::

    batch 2, seq 3, row 1 left-padded by 2 (x = pad, never stored)
    (batch, seq)   a0 a1 a2 | x x b0
    tokens         a0 a1 a2 b0          select = [0, 1, 2, 5]

Everything here is CPU only: ``Tensor.numpy()`` shares memory with the tensor.
Tensors are ``Any`` to mypy (see :mod:`pagedkv.integrations.hf.extra`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ShapeError
from pagedkv.integrations.hf.extra import require

__all__ = [
    "Tensor",
    "check_states",
    "from_tokens",
    "padding_layout",
    "raw_array",
    "states_array",
    "to_tokens",
    "tokens_of",
    "torch_dtype",
]

#: A ``torch.Tensor`` (torch is loaded only when used).
Tensor = Any


def check_states(name: str, states: Tensor, num_heads: int, head_dim: int, dtype: str) -> None:
    """Refuse anything but a CPU tensor ``(batch, num_heads, seq, head_dim)`` of ``dtype`` (torch's name).

    Raises:
        ShapeError: a wrong shape, dtype or device.
    """
    # NOTE: ``is_cpu`` rather than ``device.type``: no device object is built
    # on the common path (three of these checks a decode layer in attention mode).
    shape: Any = getattr(states, "shape", ())
    if len(shape) != 4 or not hasattr(states, "is_cpu"):
        raise ShapeError(
            f"{name} must be a tensor (batch, heads, seq, head_dim), got {tuple(shape) or type(states)}"
        )
    if shape[1] != num_heads or shape[3] != head_dim:
        raise ShapeError(
            f"{name} has {shape[1]} heads of {shape[3]} values; "
            f"the pool holds {num_heads} heads of {head_dim}"
        )
    if states.dtype is not torch_dtype(dtype) or not states.is_cpu:
        raise ShapeError(
            f"{name} is {states.dtype} on {states.device}; the model computes in {dtype} on the CPU "
            "(pagedkv runs on the CPU only)"
        )


@functools.cache
def torch_dtype(dtype: np.dtype[Any] | str) -> Any:
    """The torch dtype of numpy ``dtype`` or of a name (float32 -> ``torch.float32``); looked up once."""
    return getattr(require("torch"), str(dtype), None)


def raw_array(tensor: Tensor) -> npt.NDArray[Any]:
    """The numpy array of a CPU tensor's memory; a bfloat16 tensor's as its ``int16`` bits.

    NOTE: numpy has no bfloat16 of its own, so ``Tensor.numpy`` refuses one;
    copying bits is all the read cache does with them, and the bits are exact.
    """
    if tensor.dtype is torch_dtype("bfloat16"):
        tensor = tensor.view(torch_dtype("int16"))
    return states_array(tensor)


def states_array(states: Tensor) -> npt.NDArray[Any]:
    """The numpy array of a CPU tensor ``(batch, heads, seq, head_dim)``: the same memory and strides.

    NOTE: one torch call (``Tensor.numpy``); everything after it is numpy,
    whose calls cost a fraction of torch's dispatch, and a decode makes a
    few of them per layer (benchmarks/bench_transformers.py).
    """
    if states.requires_grad:
        states = states.detach()
    array: npt.NDArray[Any] = states.numpy()
    return array


def tokens_of(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``(batch, heads, seq, head_dim)`` as C-contiguous ``(batch * seq, heads, head_dim)``, row by row.

    Returns:
        A view of ``array`` when its layout allows (one position per row), else a copy.

    >>> tokens_of(np.arange(4.0).reshape(1, 2, 2, 1))[:, :, 0].tolist()  # heads 0, 1 at positions 0, 1
    [[0.0, 2.0], [1.0, 3.0]]
    """
    batch, heads, seq, head_dim = array.shape
    tokens: npt.NDArray[Any] = np.ascontiguousarray(array.transpose(0, 2, 1, 3)).reshape(
        batch * seq, heads, head_dim
    )
    return tokens


def to_tokens(
    states: Tensor, select: Tensor | None = None, dtype: np.dtype[Any] | None = None
) -> npt.NDArray[Any]:
    """``(batch, heads, seq, head_dim)`` as ``(tokens, heads, head_dim)``, only the positions in ``select``.

    Args:
        states: a CPU tensor.
        select: flat ``(row, position)`` indices to keep; None: all.
        dtype: widen to this compute dtype first (a 16-bit model's states to
            float32: exact); None: as they are.

    Returns:
        A C-contiguous array; it may share memory with ``states`` (one position
        per row reshapes without a copy), so read it, do not keep it.
    """
    if dtype is not None and states.dtype is not torch_dtype(dtype):
        states = states.to(torch_dtype(dtype))
    if select is None:
        return tokens_of(states_array(states))
    batch, heads, seq, head_dim = states.shape
    flat = states.detach().transpose(1, 2).reshape(batch * seq, heads, head_dim)  # (tokens, heads, head_dim)
    flat = flat.index_select(0, select)
    array: npt.NDArray[Any] = flat.contiguous().numpy()
    return array


def from_tokens(
    outputs: npt.NDArray[Any], batch: int, seq: int, select: Tensor | None = None, dtype: str | None = None
) -> Tensor:
    """The manager's ``(tokens, heads, head_dim)`` as ``(batch, seq, heads, head_dim)``; pads get zeros.

    Args:
        outputs: the manager's attention outputs, a new array.
        batch, seq: the step's rows and columns.
        select: the flat ``(row, position)`` index of each output; None: every position, in order.
        dtype: round to the model's dtype (torch's name: a 16-bit model); None: as computed.

    Returns:
        A tensor sharing memory with ``outputs`` when nothing is padded and
        nothing rounded, else a new one.
    """
    torch = require("torch")
    tensor = torch.from_numpy(outputs)
    if dtype is not None:
        tensor = tensor.to(torch_dtype(dtype))
    heads, head_dim = outputs.shape[1:]
    if select is None:
        return tensor.view(batch, seq, heads, head_dim)
    full = tensor.new_zeros((batch * seq, heads, head_dim))
    full.index_copy_(0, select, tensor)
    return full.view(batch, seq, heads, head_dim)


def padding_layout(
    padding: Tensor | None, num_new: int, num_held: list[int], num_pads: list[int]
) -> tuple[list[int], Tensor | None, list[int]]:
    """Which new positions of each row are real, for a step of ``num_new`` columns.

    Args:
        padding: ``(rows, num_new)`` booleans (False: padding), or None.
        num_new: new columns per row.
        num_held: tokens each row holds already (read only when ``padding`` is given).
        num_pads: each row's padding columns so far.

    Returns:
        ``(counts, select, pads)``: real tokens per row, the flat ``(row, position)``
        indices to store (None: all), and each row's padding columns after the step.

    Raises:
        ShapeError: a wrong mask shape, or padding after a real token (only left padding is served).
    """
    num_rows = len(num_pads)
    if padding is None or bool(padding.all()):
        return [num_new] * num_rows, None, list(num_pads)
    torch = require("torch")
    real = padding.detach().to(device="cpu", dtype=torch.bool)
    if tuple(real.shape) != (num_rows, num_new):
        raise ShapeError(
            f"the padding mask is {tuple(real.shape)}; expected (rows, seq) = {(num_rows, num_new)}"
        )
    counts = real.sum(dim=1).tolist()
    for row, count in enumerate(counts):
        left_padded = bool(real[row, num_new - count :].all())
        if not left_padded or (count < num_new and num_held[row] > 0):
            raise ShapeError(
                f"row {row} has padding after a real token (mask {real[row].int().tolist()}); "
                "pagedkv attention serves left padding only"
            )
    select = torch.nonzero(real.reshape(-1)).squeeze(1)
    return counts, select, [pads + num_new - count for pads, count in zip(num_pads, counts)]
