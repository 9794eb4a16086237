"""The numba-compiled loops behind :mod:`pagedkv.kernels.jit` (imported only by its ``compile_kernels``).

Each token's page row is read once, in logical order: widened inside the dot products and the
weighted sum (bit tricks and F16C for the 16-bit formats; explicit ``<32 x float>`` LLVM vectors
for int8 and fp8, each group times its scale in registers, once for a kv head's query rows).
Grouped-query decode over float32 pages streams the same way. Module level so numba caches the machine code on
disk (it cannot cache closures); imports numba and llvmlite, the ``jit`` extra. Reduction
order: :data:`pagedkv.kernels.jit.REDUCTION`. Measurements: docs/quantization.md.
"""

# NOTE: numba's @intrinsic hides the typing-context argument from callers and
# numba.core.cgutils is untyped; mypy cannot see either.
# mypy: disable-error-code="call-arg, no-untyped-call"

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, import-not-found, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, import-not-found, unused-ignore]
from numba.core import cgutils  # type: ignore[import-untyped, import-not-found, unused-ignore]
from numba.extending import intrinsic  # type: ignore[import-untyped, import-not-found, unused-ignore]

__all__ = ["float_scores_into", "float_weighted_values_into", "scores_into",
           "weighted_values_into", "widen_tokens_into"]

types = numba.types

#: Values in one explicit vector: the int8 and fp8 group size (``GROUP_SIZE`` of the storage formats).
GROUP = 32


@intrinsic  # type: ignore[misc, unused-ignore]
def float32_from_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the uint32 ``bits`` (a bitcast: no memory round trip)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic  # type: ignore[misc, unused-ignore]
def float32_from_float16_bits(typingctx: Any, bits: Any) -> Any:
    """The float16 whose bits are the int16 ``bits``, widened exactly (F16C's vcvtph2ps on x86)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


def widen_group(builder: Any, fmt: int, codes: Any) -> Any:
    """A ``<32 x i8>`` of codes as exact ``<32 x float>``: int8 values, fp8 e4m3 values / 256.

    fp8 goes through float16 bits (F16C's vcvtph2ps), the exponent bias
    15 against 7 leaving a factor 2^-8 that the caller folds into the scale::

        e4m3 s eeee mmm   as int16, << 7, & 0xBF80   -> s 0eeee mmm0000000 (float16)
    """
    if fmt == 0:
        return builder.sitofp(codes, FLOATS)
    wide = builder.sext(codes, ir.VectorType(ir.IntType(16), GROUP))
    bits = builder.and_(builder.shl(wide, splat(ir.IntType(16), 7)), splat(ir.IntType(16), 0xBF80))
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), GROUP)), FLOATS)


def group_scale(builder: Any, fmt: int, scale: Any) -> Any:
    """A group's scale, times 256 for fp8 (exact: a power of two, and below the float32 limit)."""
    if fmt == 0:
        return scale
    return builder.fmul(scale, ir.Constant(ir.FloatType(), 256.0))


def dequantized(builder: Any, fmt: int, codes: Any, scale: Any) -> Any:
    """A ``<32 x i8>`` group of int8 (``fmt`` 0) or fp8 codes times its float ``scale``: the stored values.

    One rounding, no contraction (``code * scale`` as ``StorageFormat.decode``
    computes it; fp8's 2^-8 from :func:`widen_group` and the 256 of
    :func:`group_scale` cancel exactly), so every query row of the kv head
    multiplies the values the cache holds.
    """
    scales = broadcast(builder, group_scale(builder, fmt, scale))
    return builder.fmul(widen_group(builder, fmt, codes), scales)


def contracted(instruction: Any) -> Any:
    """``instruction`` allowed to fuse with its neighbour into one FMA (fixed when compiled)."""
    instruction.flags.append("contract")
    return instruction


def splat(kind: Any, value: Any) -> Any:
    """A ``<32 x kind>`` constant of ``value``."""
    return ir.Constant(ir.VectorType(kind, GROUP), [value] * GROUP)


def broadcast(builder: Any, scalar: Any) -> Any:
    """A ``<32 x float>`` of the float ``scalar``."""
    undefined = ir.Constant(FLOATS, ir.Undefined)
    first = builder.insert_element(undefined, scalar, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), GROUP), [0] * GROUP)
    return builder.shuffle_vector(first, undefined, zeros)


def group_pointer(context: Any, builder: Any, array_type: Any, array: Any, start: Any, kind: Any) -> Any:
    """A ``<32 x kind>*`` to element ``start`` of ``array`` (C-contiguous; loads are unaligned)."""
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [start]), ir.VectorType(kind, GROUP).as_pointer())


def stored_group(context: Any, builder: Any, kind: int, group: Any, codes: tuple[Any, Any],
                 code_start: Any, scale_data: Any, scale_start: Any) -> tuple[Any, Any]:
    """Group ``group``'s offset from ``code_start`` and its ``<32 x float>`` values (:func:`dequantized`).

    ``codes`` is the codes' numba type and array value; ``kind`` 0 int8, 1 fp8.
    """
    offset = builder.mul(group, ir.Constant(group.type, GROUP))
    pointer = group_pointer(context, builder, *codes, builder.add(code_start, offset), ir.IntType(8))
    code = builder.load(pointer, align=1)
    scale = builder.load(builder.gep(scale_data, [builder.add(scale_start, group)]))
    return offset, dequantized(builder, kind, code, scale)


def each_format(builder: Any, fmt: Any, emit: Any) -> None:
    """``emit(0)`` where the runtime ``fmt`` is int8's 0, else ``emit(1)`` (fp8): both widenings in the IR."""
    with builder.if_else(builder.icmp_signed("==", fmt, ir.Constant(fmt.type, 0))) as (int8, float8):
        with int8:
            emit(0)
        with float8:
            emit(1)


def scaled_dots_intrinsic(rows: int) -> Any:
    """``rows`` query rows' dot products with one int8 or fp8 key, an intrinsic.

    Each group of the key is dequantized once (:func:`dequantized`) for all
    the rows (grouped-query heads share their kv head's key); each row's sum
    is the one-row sum, op for op.
    """

    @intrinsic  # type: ignore[misc, unused-ignore]
    def scaled_dots(typingctx: Any, fmt: Any, queries: Any, query_start: Any, out: Any, out_start: Any,
                    out_step: Any, codes: Any, code_start: Any, scales: Any, scale_start: Any,
                    num_groups: Any) -> Any:
        """``out[out_start + r * out_step] = q_r . key``, r < rows, in explicit lanes (``fmt`` 0 int8, 1 fp8).

        Query row ``r`` starts at ``query_start + r * num_groups * 32``; the
        key's values are ``code * scale_g`` (the stored values). Lane ``l``
        sums ``q[32 g + l] * key[32 g + l]`` (fused) over the groups
        in order, then the 32 lanes are added by a fixed tree of halves: the
        order is written here, not chosen by LLVM or the CPU.
        """
        # NOTE: the IR reads float32 queries and scales and 1-byte codes
        # (scores_grouped_into, compiled only for int8 and fp8 pages).
        if queries.dtype != types.float32 or scales.dtype != types.float32 or out.dtype != types.float32:
            return None  # a typing error
        intp = types.intp
        signature = types.none(intp, queries, intp, out, intp, intp, codes, intp, scales, intp, intp)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            (fmt, query_array, query_start, out_array, out_start, out_step, code_array, code_start,
             scale_array, scale_start, count) = args
            scale_data = context.make_array(sig.args[8])(context, builder, value=scale_array).data
            out_data = context.make_array(sig.args[3])(context, builder, value=out_array).data
            row_length = builder.mul(count, ir.Constant(count.type, GROUP))

            def emit(kind: int) -> None:
                zeros = ir.Constant(FLOATS, [0.0] * GROUP)
                totals = [cgutils.alloca_once_value(builder, zeros) for _ in range(rows)]
                with cgutils.for_range(builder, count) as loop:
                    codes = (sig.args[6], code_array)
                    offset, key = stored_group(context, builder, kind, loop.index, codes, code_start,
                                               scale_data, scale_start)
                    for row, total in enumerate(totals):
                        start = builder.add(builder.add(query_start, builder.mul(
                            row_length, ir.Constant(row_length.type, row))), offset)
                        query = builder.load(group_pointer(context, builder, sig.args[1], query_array, start,
                                                           ir.FloatType()), align=4)
                        product = contracted(builder.fmul(query, key))
                        builder.store(contracted(builder.fadd(builder.load(total), product)), total)
                for row, total in enumerate(totals):
                    target = builder.add(out_start, builder.mul(out_step, ir.Constant(out_step.type, row)))
                    builder.store(halves(builder, builder.load(total)), builder.gep(out_data, [target]))

            each_format(builder, fmt, emit)
            return context.get_dummy_value()

        return signature, codegen
    return scaled_dots


def halves(builder: Any, lanes: Any) -> Any:
    """The sum of the ``<32 x float>`` ``lanes`` by a fixed tree: lanes l and l + width / 2, width 32 to 2."""
    width = GROUP
    while width > 1:
        width //= 2
        low = builder.shuffle_vector(lanes, lanes, ir.Constant(
            ir.VectorType(ir.IntType(32), width), list(range(width))))
        high = builder.shuffle_vector(lanes, lanes, ir.Constant(
            ir.VectorType(ir.IntType(32), width), list(range(width, 2 * width))))
        lanes = builder.fadd(low, high)
    return builder.extract_element(lanes, ir.Constant(ir.IntType(32), 0))


def scaled_axpys_intrinsic(rows: int) -> Any:
    """``rows`` rows' accumulates of one int8 or fp8 value, an intrinsic.

    Each group of the value is dequantized once (:func:`dequantized`) for all
    the rows; each row's accumulate is the one-row accumulate, op for op.
    """

    @intrinsic  # type: ignore[misc, unused-ignore]
    def scaled_axpys(typingctx: Any, fmt: Any, out: Any, out_start: Any, weights: Any, weight_start: Any,
                     weight_step: Any, codes: Any, code_start: Any, scales: Any, scale_start: Any,
                     num_groups: Any) -> Any:
        """Row r < rows: ``out[out_start + r d + 32 g + l] += w_r * (code[32 g + l] * scale_g)`` (fused).

        ``w_r`` is ``weights``'s element ``weight_start + r * weight_step``; d = ``num_groups * 32``;
        ``fmt``: 0 int8, 1 fp8.
        """
        if out.dtype != types.float32 or scales.dtype != types.float32 or weights.dtype != types.float32:
            return None  # a typing error: the IR writes float32 and reads float32 weights and scales
        intp = types.intp
        signature = types.none(intp, out, intp, weights, intp, intp, codes, intp, scales, intp, intp)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            (fmt, out_array, out_start, weight_array, weight_start, weight_step, code_array, code_start,
             scale_array, scale_start, count) = args
            scale_data = context.make_array(sig.args[8])(context, builder, value=scale_array).data
            weight_data = context.make_array(sig.args[3])(context, builder, value=weight_array).data
            row_length = builder.mul(count, ir.Constant(count.type, GROUP))
            weights_of_rows = [broadcast(builder, builder.load(builder.gep(weight_data, [builder.add(
                weight_start, builder.mul(weight_step, ir.Constant(weight_step.type, row)))])))
                for row in range(rows)]

            def emit(kind: int) -> None:
                with cgutils.for_range(builder, count) as loop:
                    codes = (sig.args[6], code_array)
                    offset, value = stored_group(context, builder, kind, loop.index, codes, code_start,
                                                 scale_data, scale_start)
                    for row, weight in enumerate(weights_of_rows):
                        start = builder.add(builder.add(out_start, builder.mul(
                            row_length, ir.Constant(row_length.type, row))), offset)
                        target = group_pointer(context, builder, sig.args[1], out_array, start,
                                               ir.FloatType())
                        added = contracted(builder.fadd(builder.load(target, align=4), contracted(
                            builder.fmul(weight, value))))
                        builder.store(added, target, align=4)

            each_format(builder, fmt, emit)
            return context.get_dummy_value()

        return signature, codegen
    return scaled_axpys


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def slot_of(slots: Any, token: int) -> Any:
    """Token ``token``'s slot: ``slots[token]``, or ``token`` itself where ``slots`` is empty (in order)."""
    if slots.shape[0] == 0:
        return token
    return slots[token]


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def token_rows(slots: Any, scale_slots: Any, token: int) -> Any:
    """Token ``token``'s code row and scale row.

    NOTE: no software prefetch. Rows read in order (a page view) stream on the
    hardware prefetcher, and prefetching each row 8 tokens ahead cost them
    10-15% (8k-16k int8 and fp8 decode: 2.15 -> 1.95 ms and 4.0 -> 3.4 ms);
    rows gathered by slot gained 0-6% from it (docs/quantization.md).
    """
    return slot_of(slots, token), slot_of(scale_slots, token)


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def head_starts(slot: int, scale_slot: int, head: int, num_kv_heads: int, num_groups: int) -> Any:
    """Where kv head ``head``'s codes start (an element of the flat codes), and its scales."""
    return (slot * num_kv_heads + head) * num_groups * GROUP, (scale_slot * num_kv_heads + head) * num_groups


FLOATS = ir.VectorType(ir.FloatType(), GROUP)
dots4, dots2, dots1 = (scaled_dots_intrinsic(rows) for rows in (4, 2, 1))
axpys4, axpys2, axpys1 = (scaled_axpys_intrinsic(rows) for rows in (4, 2, 1))


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def row_block(remaining: int) -> int:
    """How many of a kv head's ``remaining`` query rows share one dequantization: 4, 2 or 1."""
    if remaining >= 4:
        return 4
    return 2 if remaining >= 2 else 1


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def head_dots(fmt: int, num_rows: int, queries: Any, query_start: int, out: Any, out_start: int,
              out_step: int, codes: Any, code_start: int, scales: Any, scale_start: int,
              num_groups: int) -> None:
    """A kv head's ``num_rows`` query rows dotted with its int8 (``fmt`` 0) or fp8 key.

    Row ``r``'s query starts at ``query_start + r * num_groups * 32``, its
    score goes to ``out_start + r * out_step``; blocks of 4, 2 or 1 rows each
    dequantize the key once. One row skips the block loop (measured 9% slower
    at 16k tokens).
    """
    if num_rows == 1:
        dots1(fmt, queries, query_start, out, out_start, out_step, codes, code_start, scales, scale_start,
              num_groups)
        return
    row = 0
    while row < num_rows:
        block = row_block(num_rows - row)
        rows = (query_start + row * num_groups * GROUP, out, out_start + row * out_step, out_step)
        if block == 4:
            dots4(fmt, queries, *rows, codes, code_start, scales, scale_start, num_groups)
        elif block == 2:
            dots2(fmt, queries, *rows, codes, code_start, scales, scale_start, num_groups)
        else:
            dots1(fmt, queries, *rows, codes, code_start, scales, scale_start, num_groups)
        row += block


@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def head_axpys(fmt: int, num_rows: int, out: Any, out_start: int, weights: Any, weight_start: int,
               weight_step: int, codes: Any, code_start: int, scales: Any, scale_start: int,
               num_groups: int) -> None:
    """A kv head's int8 (``fmt`` 0) or fp8 value accumulated into its ``num_rows`` output rows.

    Row ``r``'s output starts at ``out_start + r * num_groups * 32``, its
    weight is ``weights``'s element ``weight_start + r * weight_step``; blocks
    and the one-row case as in :func:`head_dots`.
    """
    if num_rows == 1:
        axpys1(fmt, out, out_start, weights, weight_start, weight_step, codes, code_start, scales,
               scale_start, num_groups)
        return
    row = 0
    while row < num_rows:
        block = row_block(num_rows - row)
        rows = (out_start + row * num_groups * GROUP, weights, weight_start + row * weight_step, weight_step)
        if block == 4:
            axpys4(fmt, out, *rows, codes, code_start, scales, scale_start, num_groups)
        elif block == 2:
            axpys2(fmt, out, *rows, codes, code_start, scales, scale_start, num_groups)
        else:
            axpys1(fmt, out, *rows, codes, code_start, scales, scale_start, num_groups)
        row += block


# NOTE: no fastmath: it would let LLVM reorder the sums; error_model="numpy"
# drops the division-by-zero checks from the loops.
jit = numba.njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
reassociating = numba.njit(cache=True, nogil=True, error_model="numpy", boundscheck=False,
                           fastmath={"reassoc", "contract"})


# NOTE: every inner index below is a range() variable from 0: numba then
# drops its negative-index wraparound, which otherwise turns each
# contiguous load into a gather (measured: 5 ms against 1 ms per 8k keys).
# widen_row is inlined by numba (no call, no reference counts per row).
@numba.njit(inline="always", nogil=True, error_model="numpy", boundscheck=False)  # type: ignore[misc, unused-ignore]
def widen_row(fmt: int, codes: Any, scales: Any, slot: int, scale_slot: int, out: Any, start: int,
              head_stride: int, groups_per_head: int) -> None:
    """Slot ``slot``'s codes as ``code * scale`` (exact, one rounding), head h at ``start + h * head_stride``.

    The scales are ``scale_slot``'s (``slot`` itself unless the codes are a
    mapped copy); ``out`` is flat, each head's ``head_dim`` values contiguous.

    ``codes`` is ``(num_slots, H * G, group_size)`` and ``scales``
    ``(num_slots, H * G)`` (G = 1 and no scales for a scale-free format).
    Each format's inner loop runs over contiguous codes with nothing else
    in it, so LLVM vectorizes it; the bit tricks are ``StorageFormat.widen_into``'s.
    """
    num_groups, group_size = codes.shape[1], codes.shape[2]
    for group in range(num_groups):
        first = start + (group // groups_per_head) * head_stride + (group % groups_per_head) * group_size
        target = out[first : first + group_size]  # indexed from 0 (see the NOTE above)
        if fmt == 3:  # bfloat16: the top half of a float32
            for j in range(group_size):
                code = np.uint32(np.uint16(codes[slot, group, j]))
                target[j] = float32_from_bits(code << np.uint32(16))
        elif fmt == 2:  # float16: the hardware conversion (exact)
            for j in range(group_size):
                target[j] = float32_from_float16_bits(codes[slot, group, j])
        elif fmt == 0:  # int8: the cast is exact; times the group's scale
            group_scale = scales[scale_slot, group]
            for j in range(group_size):
                target[j] = np.float32(codes[slot, group, j]) * group_scale
        else:  # fp8 e4m3: sign-extended, << 20, sign and exponent masked, rebiased by 2^120
            group_scale = scales[scale_slot, group]
            for j in range(group_size):
                bits = np.uint32((np.int32(codes[slot, group, j]) << 20) & 0x87FFFFFF)
                target[j] = (float32_from_bits(bits) * np.float32(2.0**120)) * group_scale


@reassociating  # type: ignore[misc, unused-ignore]
def dot(queries: Any, head: int, row: int, widened: Any) -> Any:
    """``queries[head, row] . widened[head]``, vectorized: see ``REDUCTION``."""
    total = np.float32(0.0)
    for j in range(queries.shape[2]):
        total += queries[head, row, j] * widened[head, j]
    return total


@reassociating  # type: ignore[misc, unused-ignore]
def dot_bfloat16(queries: Any, head: int, row: int, codes: Any, slot: int) -> Any:
    """``queries[head, row] . key``, the bfloat16 codes widened in the loop (no buffer)."""
    total = np.float32(0.0)
    for j in range(queries.shape[2]):
        code = np.uint32(np.uint16(codes[slot, head, j]))
        total += queries[head, row, j] * float32_from_bits(code << np.uint32(16))
    return total


@reassociating  # type: ignore[misc, unused-ignore]
def dot_float16(queries: Any, head: int, row: int, codes: Any, slot: int) -> Any:
    """``queries[head, row] . key``, the float16 codes widened in the loop (no buffer)."""
    total = np.float32(0.0)
    for j in range(queries.shape[2]):
        total += queries[head, row, j] * float32_from_float16_bits(codes[slot, head, j])
    return total


def loop_for(fmt: int, codes: Any, loops: tuple[Any, Any, Any]) -> Any:
    """Which of ``(16-bit, groups of 32, widened)`` loops reads ``fmt``'s codes ``(num_slots, H * G, gs)``.

    Each loop is a function of its own, compiled only for the codes it reads
    (in one function every branch was compiled for both code widths).
    """
    if fmt == 2 or fmt == 3:  # float16, bfloat16
        return loops[0]
    return loops[1] if codes.shape[2] == GROUP else loops[2]


def scores_into(
    queries: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """``out[h, r, t] = queries[h, r] . key(t, h)``, one token row at a time, in logical order.

    ``slots`` (``scale_slots``) empty: token ``t``'s codes (scales) are row ``t``.
    float16 and bfloat16 codes are widened inside the dot product; int8 and
    fp8 ones in groups of 32 by :func:`scaled_dots_intrinsic` (numba's own
    32-long loops do not fill LLVM's vector loop: measured 1.8x slower);
    other group sizes through a 4 KiB buffer (``widen_row``) and :func:`dot`.
    NOTE: ``out``'s head rows must not lie a multiple of 4 KiB apart (each
    token's stores would share one L1 set): :func:`pagedkv.kernels.jit.scores` pads them.
    """
    loop = loop_for(fmt, codes, (scores_16bit_into, scores_grouped_into, scores_widened_into))
    loop(queries, fmt, codes, scales, slots, scale_slots, out)


@jit  # type: ignore[misc, unused-ignore]
def scores_16bit_into(
    queries: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`scores_into` over bfloat16 (``fmt`` 3) or float16 (2) codes ``(num_slots, H, d)``."""
    num_kv_heads, num_rows, _ = queries.shape
    for token in range(out.shape[2]):
        slot = slot_of(slots, token)
        for head in range(num_kv_heads):
            for row in range(num_rows):
                if fmt == 3:
                    out[head, row, token] = dot_bfloat16(queries, head, row, codes, slot)
                else:
                    out[head, row, token] = dot_float16(queries, head, row, codes, slot)


@jit  # type: ignore[misc, unused-ignore]
def scores_grouped_into(
    queries: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`scores_into` over int8 (``fmt`` 0) or fp8 (1) codes in groups of 32: explicit vector lanes."""
    num_kv_heads, num_rows, head_dim = queries.shape
    num_tokens, num_groups = out.shape[2], scales.shape[1] // num_kv_heads
    out_head, out_row = out.strides[0] // 4, out.strides[1] // 4
    for token in range(num_tokens):
        slot, scale_slot = token_rows(slots, scale_slots, token)
        for head in range(num_kv_heads):
            code_start, scale_start = head_starts(slot, scale_slot, head, num_kv_heads, num_groups)
            head_dots(fmt, num_rows, queries, head * num_rows * head_dim, out, head * out_head + token,
                      out_row, codes, code_start, scales, scale_start, num_groups)


@jit  # type: ignore[misc, unused-ignore]
def scores_widened_into(
    queries: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`scores_into` over int8 or fp8 codes in groups of another size: widened into a buffer first."""
    num_kv_heads, num_rows, head_dim = queries.shape
    num_groups = scales.shape[1] // num_kv_heads
    buffer = np.empty(num_kv_heads * head_dim, np.float32)  # 4 KiB at H=8, d=128
    widened = buffer.reshape(num_kv_heads, head_dim)
    for token in range(out.shape[2]):
        widen_row(fmt, codes, scales, slot_of(slots, token), slot_of(scale_slots, token), buffer, 0, head_dim,
                  num_groups)
        for head in range(num_kv_heads):
            for row in range(num_rows):
                out[head, row, token] = dot(queries, head, row, widened)


def weighted_values_into(
    weights: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """``out[h, r] = sum_t weights[h, r, t] * value(t, h)``, one token row at a time, in logical order.

    ``slots`` and ``scale_slots`` as in :func:`scores_into`; one loop per layout the same way.
    """
    loop = loop_for(fmt, codes, (values_16bit_into, values_grouped_into, values_widened_into))
    loop(weights, fmt, codes, scales, slots, scale_slots, out)


@jit  # type: ignore[misc, unused-ignore]
def values_16bit_into(
    weights: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`weighted_values_into` over bfloat16 (``fmt`` 3) or float16 (2) codes: widened in the loop."""
    num_kv_heads, num_rows, head_dim = out.shape
    out[:] = 0.0
    for token in range(weights.shape[2]):
        slot = slot_of(slots, token)
        for head in range(num_kv_heads):
            for row in range(num_rows):
                weight = weights[head, row, token]
                if fmt == 3:
                    for j in range(head_dim):
                        out[head, row, j] += weight * float32_from_bits(
                            np.uint32(np.uint16(codes[slot, head, j])) << np.uint32(16))
                else:
                    for j in range(head_dim):
                        out[head, row, j] += weight * float32_from_float16_bits(codes[slot, head, j])


@jit  # type: ignore[misc, unused-ignore]
def values_grouped_into(
    weights: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`weighted_values_into` over int8 (``fmt`` 0) or fp8 (1) codes in groups of 32."""
    num_kv_heads, num_rows, head_dim = out.shape
    num_tokens, num_groups = weights.shape[2], scales.shape[1] // num_kv_heads
    out[:] = 0.0
    weight_head, weight_row = weights.strides[0] // 4, weights.strides[1] // 4
    for token in range(num_tokens):
        slot, scale_slot = token_rows(slots, scale_slots, token)
        for head in range(num_kv_heads):
            code_start, scale_start = head_starts(slot, scale_slot, head, num_kv_heads, num_groups)
            head_axpys(fmt, num_rows, out, head * num_rows * head_dim, weights, head * weight_head + token,
                       weight_row, codes, code_start, scales, scale_start, num_groups)


@jit  # type: ignore[misc, unused-ignore]
def values_widened_into(
    weights: Any, fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any
) -> None:
    """:func:`weighted_values_into` over int8 or fp8 codes in groups of another size: via a buffer."""
    num_kv_heads, num_rows, head_dim = out.shape
    num_groups = scales.shape[1] // num_kv_heads
    out[:] = 0.0
    buffer = np.empty(num_kv_heads * head_dim, np.float32)
    widened = buffer.reshape(num_kv_heads, head_dim)
    for token in range(weights.shape[2]):
        widen_row(fmt, codes, scales, slot_of(slots, token), slot_of(scale_slots, token), buffer, 0, head_dim,
                  num_groups)
        for head in range(num_kv_heads):
            for row in range(num_rows):
                weight = weights[head, row, token]
                for j in range(head_dim):
                    out[head, row, j] += weight * widened[head, j]


@reassociating  # type: ignore[misc, unused-ignore]
def dot_float32(queries: Any, head: int, row: int, keys: Any, token: int) -> Any:
    """``queries[head, row] . keys[token, head]``, vectorized: see ``REDUCTION``."""
    total = np.float32(0.0)
    for j in range(queries.shape[2]):
        total += queries[head, row, j] * keys[token, head, j]
    return total


@jit  # type: ignore[misc, unused-ignore]
def float_scores_into(queries: Any, keys: Any, out: Any) -> None:
    """``out[h, r, t] = queries[h, r] . keys[t, h]`` over float32 keys ``(num_tokens, H, d)``, token by token.

    Grouped-query decode over float32 pages: each token's row (all heads) is
    read once, in order, and each kv head's key serves its query rows from L1.
    """
    num_kv_heads, num_rows, _ = queries.shape
    for token in range(keys.shape[0]):
        for head in range(num_kv_heads):
            for row in range(num_rows):
                out[head, row, token] = dot_float32(queries, head, row, keys, token)


@jit  # type: ignore[misc, unused-ignore]
def float_weighted_values_into(weights: Any, values: Any, out: Any) -> None:
    """``out[h, r] = sum_t weights[h, r, t] * values[t, h]`` over float32 values ``(num_tokens, H, d)``."""
    num_kv_heads, num_rows, head_dim = out.shape
    out[:] = 0.0
    for token in range(values.shape[0]):
        for head in range(num_kv_heads):
            for row in range(num_rows):
                weight = weights[head, row, token]
                for j in range(head_dim):
                    out[head, row, j] += weight * values[token, head, j]


@jit  # type: ignore[misc, unused-ignore]
def widen_tokens_into(fmt: int, codes: Any, scales: Any, slots: Any, scale_slots: Any, out: Any,
                      num_tokens: int, token_stride: int, head_stride: int, groups_per_head: int) -> None:
    """Token ``t``'s ``code * scale`` into flat ``out``, head ``h`` at ``t * token_stride + h * head_stride``.

    ``slots`` and ``scale_slots`` as in :func:`scores_into`. A prefill
    chunk's keys or values widened from the stored bytes, token by token in
    one pass (``widen_row``: each value exact, times its scale in one
    rounding, as ``StorageFormat.decode_into``), for BLAS to multiply.
    """
    for token in range(num_tokens):
        slot, scale_slot = token_rows(slots, scale_slots, token)
        widen_row(fmt, codes, scales, slot, scale_slot, out, token * token_stride, head_stride,
                  groups_per_head)
