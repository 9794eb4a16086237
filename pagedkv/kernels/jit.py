"""Decode attention over low-precision pages, compiled with numba: codes widened inside the token loop.

Two passes in storage order: each token's row (``num_kv_heads * head_dim`` codes, contiguous) is
read once and dotted with every query row of its kv head (scores, :func:`scores`); after the
softmax (``attention.softmax_rows``), each value row is read once and accumulated
(:func:`weighted_values`). The loops live in :mod:`pagedkv.kernels.compiled`. The reduction order
depends only on head_dim and the CPU (:data:`REDUCTION`), never on where the pages lie, so the
paged read and the dense recompute give the same bits. vLLM: ``paged_attention_v1``'s CPU kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.kernels.rows import padded_rows, row_padded

__all__ = ["FORMAT_CODES", "REDUCTION", "compile_kernels", "decode_into", "float_scores",
           "float_weighted_values", "scores", "weighted_values"]

#: The in-kernel widening of each storage format.
FORMAT_CODES = {"int8": 0, "float8_e4m3": 1, "float16": 2, "bfloat16": 3}

#: How the dot products over head_dim are summed.
#:
#: NOTE: int8 and fp8 (groups of 32): explicit ``<32 x float>`` LLVM vectors,
#: lane ``l`` summing ``q[32 g + l] * (code[32 g + l] * scale_g)`` (the stored
#: value, rounded once; fused multiply-add) over the groups in order, then a
#: fixed tree of halves; the order is in the IR, chosen by no
#: compiler pass. float16, bfloat16 and other group sizes: a plain loop over
#: head_dim compiled with ``fastmath={"reassoc", "contract"}`` (explicit lane
#: accumulators in numba code stay scalar, 0.46-0.70 ns an element against
#: 0.078), so LLVM's loop vectorizer splits the sum into lanes chosen from the
#: target and the trip count, never from alignment (it does not peel for it).
#: FMA contraction is fixed when compiled. Every call runs one compiled
#: specialization (the array types are normalized), so the paged read and the
#: recompute add the same numbers in the same order; tests/memory/test_formats_jit.py
#: pins it. Nothing else in the kernel reassociates. Grouped-query float32
#: decode (:func:`float_scores`): the reassociated loop as for float16.
REDUCTION = "explicit lanes (int8, fp8); reassoc + contract (others)"


def compile_kernels() -> Any:
    """The ``(scores_into, weighted_values_into)`` entry points to the compiled loops (numba imported here).

    Raises:
        ImportError: numba is not installed (the ``jit`` extra).
    """
    try:
        from pagedkv.kernels import compiled
    except ImportError as error:
        raise ImportError('the numba kernel needs numba: pip install "pagedkv[jit]"') from error
    return compiled.scores_into, compiled.weighted_values_into


Side = tuple[str, npt.NDArray[Any], "npt.NDArray[np.floating] | None"]


def _stored(side: Side) -> tuple[int, npt.NDArray[Any], npt.NDArray[np.float32]]:
    """A side for the kernels: format, codes ``(num_slots, H * G, gs)``, scales ``(num_scale_slots, H * G)``.

    The same array types on every call (C-contiguous and read-only, whether
    or not the pages are mapped read-only; int8 or int16 codes; float32
    scales, an empty row for a scale-free format), so the paged read and the
    recompute run one compiled specialization.
    """
    name, codes, scales = side
    num_slots = codes.shape[0]
    raw = np.ascontiguousarray(codes).view(np.int8 if codes.dtype.itemsize == 1 else np.int16)
    if scales is None:  # one group a head, no scales
        stored_scales = np.empty((num_slots, 0), np.float32)
        num_groups = codes.shape[1]
    else:
        stored_scales = np.ascontiguousarray(scales, np.float32).reshape(len(scales), -1)
        num_groups = stored_scales.shape[1]
    return FORMAT_CODES[name], _read_only(raw.reshape(num_slots, num_groups, -1)), _read_only(stored_scales)


def _read_only(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A read-only view of ``array``, so what the kernels only read has one numba type.

    A page view's mapped codes are read-only and the recompute's are not:
    each flag compiled a loop of its own (and two specializations for the
    paged read and its recompute).
    """
    view: npt.NDArray[Any] = array.view()
    view.flags.writeable = False
    return view


def scores(
    grouped: npt.NDArray[np.float32],
    keys: Side,
    slots: npt.NDArray[np.intp] | None,
    scale_slots: npt.NDArray[np.intp] | None,
) -> npt.NDArray[np.float32]:
    """``K q`` for ``grouped`` ``(num_kv_heads, rows, head_dim)``, the keys read by slot (unscaled scores).

    Args:
        grouped: each kv head's query rows, float32 (the only compute dtype compiled).
        keys: the storage format's name, the codes token-major ``(num_slots, num_kv_heads, head_dim)``
            and their scales ``(num_slots, num_kv_heads, num_groups)`` (None: scale-free).
        slots: the slot of each token's codes, in logical order; None: token ``t``'s are row ``t``.
        scale_slots: the slot of each token's scales, the same way.

    Returns:
        A new ``(num_kv_heads, rows, num_tokens)`` float32 array, each row
        contiguous, rows :func:`~pagedkv.kernels.rows.padded_rows` apart (so no two of them share
        L1 sets as the kernel writes a token's scores into every row).
    """
    scores_into, _ = compile_kernels()
    num_tokens = len(slots) if slots is not None else len(keys[1])
    out = row_padded((*grouped.shape[:2], num_tokens), np.dtype(np.float32))
    queries = np.ascontiguousarray(grouped, np.float32)  # the loops read float32: cast, never reinterpret
    scores_into(queries, *_stored(keys), *_slot_arrays(slots, scale_slots), out)
    return out


def weighted_values(
    weights: npt.NDArray[np.float32], values: Side, slots: npt.NDArray[np.intp] | None,
    scale_slots: npt.NDArray[np.intp] | None, head_dim: int,
) -> npt.NDArray[np.float32]:
    """``weights . V`` for ``weights`` ``(num_kv_heads, rows, num_tokens)``, the values read by slot.

    ``weights`` as :func:`scores` returns them (float32, each row
    contiguous); ``slots`` and ``scale_slots`` as in :func:`scores`.

    Returns:
        A new ``(num_kv_heads, rows, head_dim)`` float32 array.
    """
    _, weighted_values_into = compile_kernels()
    out = np.empty((*weights.shape[:2], head_dim), np.float32)
    weighted_values_into(_rows(weights), *_stored(values), *_slot_arrays(slots, scale_slots), out)
    return out


def _rows(weights: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``weights`` with rows ``padded_rows`` apart, as :func:`scores` lays them (one compiled type)."""
    if weights.dtype == np.float32 and weights.strides[2] == 4 and weights.strides[1] == padded_rows(
            weights.shape[2]) * 4 and weights.strides[0] == weights.shape[1] * weights.strides[1]:
        return weights
    padded = row_padded(weights.shape, np.dtype(np.float32))
    padded[...] = weights
    return padded


def float_scores(grouped: npt.NDArray[np.float32], keys: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``K q`` for ``grouped`` ``(num_kv_heads, rows, head_dim)`` over float32 keys ``(num_tokens, H, d)``.

    The keys stream token by token, each row (every head) read once, in
    order: numpy's matmuls walk each head's plane separately, rows 4 KiB
    apart at H=8, d=128, at a third of the read bandwidth with several query
    rows a head (benchmarks/bench_formats.py ``--group``).

    Returns:
        A new ``(num_kv_heads, rows, num_tokens)`` float32 array laid out as :func:`scores` lays it.
    """
    compile_kernels()  # the jit extra's ImportError, said plainly
    from pagedkv.kernels import compiled

    stored = _read_only(np.ascontiguousarray(keys, np.float32))
    out = row_padded((*grouped.shape[:2], len(stored)), np.dtype(np.float32))
    compiled.float_scores_into(np.ascontiguousarray(grouped, np.float32), stored, out)
    return out


def float_weighted_values(
    weights: npt.NDArray[np.float32], values: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """``weights . V``: weights ``(num_kv_heads, rows, num_tokens)``, values ``(num_tokens, H, d)`` float32.

    Returns:
        A new ``(num_kv_heads, rows, head_dim)`` float32 array.
    """
    compile_kernels()
    from pagedkv.kernels import compiled

    out = np.empty((*weights.shape[:2], values.shape[2]), np.float32)
    stored = _read_only(np.ascontiguousarray(values, np.float32))
    compiled.float_weighted_values_into(_rows(weights), stored, out)
    return out


def decode_into(
    side: Side, slots: npt.NDArray[np.intp] | None, scale_slots: npt.NDArray[np.intp] | None,
    out: npt.NDArray[np.float32], num_tokens: int, strides: tuple[int, int],
) -> None:
    """The tokens at ``slots`` as floats into ``out``: token t, head h at ``t * strides[0] + h * strides[1]``.

    ``slots`` and ``scale_slots`` as in :func:`scores` (None: the side's
    first ``num_tokens`` rows); ``out`` C-contiguous float32, each head's
    ``head_dim`` values contiguous.

    The same values as ``StorageFormat.decode_into`` (each ``code * scale``,
    exact code, one rounding), widened by the compiled loop straight from the
    stored rows: no copy of the codes by slot, no second pass for the scales.
    """
    from pagedkv.kernels import compiled

    fmt, codes, scales = _stored(side)
    groups_per_head = codes.shape[1] // side[1].shape[1]  # (num_slots, H, d) as passed
    compiled.widen_tokens_into(fmt, codes, scales, *_slot_arrays(slots, scale_slots), out, num_tokens,
                               strides[0], strides[1], groups_per_head)


#: The slots of tokens read in order (row ``t`` is token ``t``): the kernels' empty slot array.
IN_ORDER = np.empty(0, np.intp)


def _slot_arrays(
    slots: npt.NDArray[np.intp] | None, scale_slots: npt.NDArray[np.intp] | None
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Both slot arrays as the kernels take them: C-contiguous intp, empty for in order (one type)."""
    return _slot_array(slots), _slot_array(scale_slots)


def _slot_array(slots: npt.NDArray[np.intp] | None) -> npt.NDArray[np.intp]:
    """``slots`` as the kernels take them (``IN_ORDER`` for None)."""
    return IN_ORDER if slots is None else np.ascontiguousarray(slots, np.intp)
