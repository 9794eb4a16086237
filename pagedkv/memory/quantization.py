"""Quantized pages' storage formats: keys and values in 8 or 16 bits, with their scales.

``"int8"`` (symmetric, a scale per group of ``GROUP_SIZE`` values), ``"float8_e4m3"`` (ml_dtypes'
``float8_e4m3fn``, as vLLM and FlashInfer store fp8), and ``"float16"`` / ``"bfloat16"`` (no
scales), each chosen separately for keys and values. :class:`StorageFormat` quantizes and
dequantizes, :class:`QuantizedTokens` is a window's codes and scales as read, and the size rule
(:func:`head_bytes`) sizes pools. Attention over them is :func:`pagedkv.attention.attend_chunked`.
vLLM: ``kv_cache_dtype="fp8"``; llama.cpp: ``q8_0``. Formats, measured error and the chosen
group size: docs/quantization.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ConfigError, InputTypeError

__all__ = [
    "GROUP_SIZE",
    "SCALE_FREE_DTYPES",
    "STORAGE_DTYPES",
    "QuantizedTokens",
    "StorageFormat",
    "Tokens",
    "bytes_per_token",
    "check_storage_dtype",
    "code_itemsize",
    "scratch_buffer",
    "storage_format",
]

#: The storage dtypes; ``None`` stores keys or values in the compute dtype.
STORAGE_DTYPES = ("int8", "float8_e4m3", "float16", "bfloat16")

#: Storage dtypes that are narrower floats, without scales: a value is stored
#: as the nearest float16 / bfloat16 and read back exactly.
SCALE_FREE_DTYPES = ("float16", "bfloat16")

#: Values of head_dim sharing one scale (or the largest divisor of head_dim below it).
GROUP_SIZE = 32

_MAX_CODE = {"int8": 127.0, "float8_e4m3": 448.0, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}


def check_storage_dtype(name: str, value: object) -> str | None:
    """Validate a ``key_dtype``/``value_dtype`` option: None or one of ``STORAGE_DTYPES``.

    Raises:
        InputTypeError: not a string or None.
        ConfigError: an unknown name.

    >>> check_storage_dtype("key_dtype", "int8")
    'int8'
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be None or one of {STORAGE_DTYPES}, got {value!r}")
    if value not in STORAGE_DTYPES:
        raise ConfigError(f"{name} must be None or one of {STORAGE_DTYPES}, got {value!r}")
    return value


def _ml_dtype(name: str) -> np.dtype[Any]:
    """ml_dtypes' ``float8_e4m3fn`` or ``bfloat16``, or an ImportError naming the ``fp8`` extra."""
    try:
        import ml_dtypes
    except ImportError as error:
        raise ImportError(
            f'{name} storage needs the ml_dtypes package: pip install "pagedkv[fp8]"'
        ) from error
    code_dtype: np.dtype[Any] = np.dtype(
        ml_dtypes.float8_e4m3fn if name == "float8_e4m3" else ml_dtypes.bfloat16)
    return code_dtype


def _float8_dtype() -> np.dtype[Any]:
    return _ml_dtype("float8_e4m3")


_FP8_VALUES: dict[np.dtype[Any], npt.NDArray[np.floating]] = {}


def _fp8_values(dtype: np.dtype[Any]) -> npt.NDArray[np.floating]:
    """The value of every fp8 code 0..255, in ``dtype`` (exact), built once per dtype."""
    table = _FP8_VALUES.get(dtype)
    if table is None:
        codes = np.arange(256, dtype=np.uint8).view(_float8_dtype())
        with np.errstate(invalid="ignore"):
            table = _FP8_VALUES[dtype] = codes.astype(dtype)
    return table


_SCRATCH = threading.local()


def scratch_buffer(purpose: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """This thread's reusable C-contiguous buffer for ``purpose``, reshaped to ``shape`` (grown as needed).

    Valid until the same thread asks for the same ``purpose`` and ``dtype``
    again; other threads have buffers of their own. A buffer grows by at
    least half its size, so a context growing a chunk at a time maps fresh
    pages (a page fault each) on a few calls, not on every one.
    """
    buffers: dict[tuple[str, np.dtype[Any]], npt.NDArray[Any]] | None = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    size = 1
    for length in shape:
        size *= length
    buffer = buffers.get((purpose, dtype))
    if buffer is None or buffer.size < size:
        # NOTE: zeroed, as the gather scratch (pages.Scratch): BLAS may load past a row's end.
        grown = 0 if buffer is None else buffer.size + buffer.size // 2
        buffer = buffers[(purpose, dtype)] = np.zeros(max(size, grown, 1), dtype)
    result: npt.NDArray[Any] = buffer[:size].reshape(shape)
    return result


def _group_size(head_dim: int) -> int:
    return max(size for size in range(1, min(GROUP_SIZE, head_dim) + 1) if head_dim % size == 0)


@dataclass(frozen=True)
class StorageFormat:
    """How one side (keys or values) of a pool is stored: codes plus a scale per group, or narrow floats.

    Attributes:
        name: one of ``STORAGE_DTYPES``.
        head_dim: values per head.
        group_size: values sharing one scale; divides ``head_dim`` (the whole
            head for a scale-free format).
        code_dtype: ``int8``, ml_dtypes' ``float8_e4m3fn``, ``float16`` or
            ml_dtypes' ``bfloat16``.
        max_code: the largest code magnitude (127, 448, or the largest
            finite float16 / bfloat16); a group's largest value maps onto it.
        scaled: False for float16 and bfloat16, whose codes are the values
            themselves, rounded to the nearest representable one: no scales.
    """

    name: str
    head_dim: int
    group_size: int
    code_dtype: np.dtype[Any]
    max_code: float
    scaled: bool = True

    @property
    def num_groups(self) -> int:
        """Scales per token per head (0 for a scale-free format)."""
        return self.head_dim // self.group_size if self.scaled else 0

    def bytes_per_head(self, dtype: np.dtype[Any]) -> int:
        """Bytes one token's head takes: its codes plus its scales in ``dtype`` (``head_bytes``)."""
        return head_bytes(self.name, self.head_dim, dtype)

    def quantize(
        self, x: npt.NDArray[np.floating]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.floating]]:
        """Codes and scales of ``x`` ``(..., head_dim)``, scales in ``x``'s dtype.

        One scale per group of ``group_size`` values, ``max|x| / max_code``::

            one token, one head, head_dim 128:   | g0: 32 values | g1 | g2 | g3 |
            codes  (head_dim,)      int8 or fp8, 1 byte each
            scales (head_dim / 32,) compute dtype, one per group

        >>> storage = storage_format("int8", head_dim=4)
        >>> codes, scales = storage.quantize(np.array([[1.0, -2.0, 0.5, 4.0]]))
        >>> codes.tolist(), scales.tolist()
        ([[32, -64, 16, 127]], [[0.031496062992125984]])
        >>> storage.dequantize(codes, scales, np.dtype(np.float64)).round(3).tolist()
        [[1.008, -2.016, 0.504, 4.0]]

        Returns:
            ``(codes (..., head_dim), scales (..., num_groups))``, new arrays.
            Elementwise given each group's maximum, so a token's codes never
            depend on which other tokens are quantized with it. A scale-free
            format rounds each value to the nearest code (past ``max_code``
            it is infinite, as the format has no larger value) and returns
            scales of ``num_groups == 0`` values.
        """
        if not self.scaled:
            with np.errstate(over="ignore"):
                narrow = x.astype(self.code_dtype)
            return narrow, np.empty((*x.shape[:-1], 0), x.dtype)
        groups = x.reshape(*x.shape[:-1], self.num_groups, self.group_size)
        scales = np.abs(groups).max(axis=-1) / x.dtype.type(self.max_code)  # (..., num_groups)
        divisors = np.where(scales > 0, scales, x.dtype.type(1))
        scaled = groups / divisors[..., None]
        # NOTE: clip before the cast: fp8 e4m3fn has no infinity and turns
        # anything past 464 into NaN; rounding x / scale can overshoot 448 by an ulp.
        np.clip(scaled, -self.max_code, self.max_code, out=scaled)
        if self.name == "int8":
            np.rint(scaled, out=scaled)
        codes = scaled.astype(self.code_dtype).reshape(x.shape)
        return codes, scales

    def dequantize(
        self, codes: npt.NDArray[Any], scales: npt.NDArray[np.floating] | None, dtype: np.dtype[Any]
    ) -> npt.NDArray[np.floating]:
        """``code * scale`` per value, as a new contiguous ``(..., head_dim)`` array of ``dtype``.

        A scale-free format ignores ``scales`` (None is fine): its codes are
        widened exactly (every float16 and bfloat16 is a float32).
        """
        if not self.scaled:
            widened: npt.NDArray[np.floating] = codes.astype(dtype)
            return widened
        if scales is None:
            raise ConfigError(f"{self.name} codes need their scales")
        shape = codes.shape
        groups = codes.reshape(*shape[:-1], self.num_groups, self.group_size)
        if self.name == "int8":
            # One pass: the ufunc casts the codes as it multiplies.
            out: npt.NDArray[np.floating] = np.multiply(groups, scales[..., None], dtype=dtype)
            return out.reshape(shape)
        # NOTE: ml_dtypes' own fp8 -> float cast runs through a generic loop,
        # about 6x slower; a 256-entry table of the exact values gives the
        # same numbers (each code's value is exact in float32), then one
        # rounding in the multiply, as before.
        out = np.take(_fp8_values(dtype), groups.view(np.uint8))
        out *= scales[..., None]
        return out.reshape(shape)

    def decode_into(
        self, codes: npt.NDArray[Any], scales: npt.NDArray[np.floating] | None, out: npt.NDArray[np.floating]
    ) -> None:
        """Write ``code * scale`` of ``codes`` ``(..., head_dim)`` (any strides) into ``out``, contiguous.

        Equal to :meth:`dequantize` bit for bit: :meth:`widen_into` writes each
        code's exact value, then a scaled format multiplies by its scales.

        Args:
            codes: ``(..., head_dim)`` codes as stored.
            scales: ``(..., num_groups)``, or None for a scale-free format.
            out: a C-contiguous float32 or float64 array shaped like ``codes``.

        Raises:
            ConfigError: a scaled format's codes came without their scales.
        """
        if self.scaled and scales is None:
            raise ConfigError(f"{self.name} codes need their scales")
        self.widen_into(codes, out)
        if scales is not None and self.scaled:
            groups = out.reshape(*out.shape[:-1], self.num_groups, self.group_size)
            groups *= scales[..., None]

    def widen_into(self, codes: npt.NDArray[Any], out: npt.NDArray[np.floating]) -> None:
        """Each code's exact value (its scale left out) into ``out``, C-contiguous float32 or float64.

        No step calls a float cast of ml_dtypes or numpy's float16 (both run
        generic loops; numpy's float16 cast measured 8x the shifts here): the
        codes are widened with integer shifts into ``out``'s float32 bits::

            bfloat16  s eeeeeeee mmmmmmm       as uint16, << 16     -> the float32 itself
            float16   s eeeee mmmmmmmmmm       as int16,  << 13     -> ssss eeeee mmm..  (x 2^112)
            fp8 e4m3  s eeee mmm               as int8,   << 20     -> sssss eeee mmm..  (x 2^120)
            int8      numpy's int8 -> float cast (a SIMD loop)

        (widened to 32 bits first, the signed ones sign-extended, then
        shifted as unsigned.)

        Widening a signed code copies its sign into the bits above the
        exponent, which a mask clears but for the top one; multiplying by the
        power of two rebiases the exponent exactly, subnormals included. A
        float16 infinity comes out as 2^16 and is fixed up (the only code
        that can); e4m3fn NaN codes never reach the pages (``quantize`` clips),
        nor do NaN float16 or bfloat16 codes (inputs are finite). Float64
        widens through float32, where every code is exact.

        >>> out = np.empty(3, np.float32)
        >>> storage_format("float16", head_dim=3).widen_into(np.array([1.5, -2.0, 6e-8], np.float16), out)
        >>> out.tolist()
        [1.5, -2.0, 5.960464477539063e-08]
        """
        if out.dtype == np.float32:
            self._widen_float32(codes, out)
        else:
            narrow = scratch_buffer("widen", np.dtype(np.float32), codes.shape)
            self._widen_float32(codes, narrow)
            np.copyto(out, narrow)

    def _widen_float32(self, codes: npt.NDArray[Any], out: npt.NDArray[np.float32]) -> None:
        # NOTE: a plain cast (copyto) and then a shift in place, not one shift
        # with dtype=: the ufunc would cast through a buffered loop, 30-40%
        # slower per chunk (1024 tokens, H=8, d=128: 126 against 175-204 us).
        if self.name == "int8":
            np.copyto(out, codes)
            return
        bits = out.view(np.uint32)
        if self.name == "bfloat16":
            np.copyto(bits, codes.view(np.uint16))
            np.left_shift(bits, 16, out=bits)
            return
        one_byte = self.code_dtype.itemsize == 1
        raw: npt.NDArray[np.signedinteger[Any]] = codes.view(np.int8 if one_byte else np.int16)
        infinite = not one_byte and _has_float16_infinity(raw)
        np.copyto(out.view(np.int32), raw)  # sign-extended
        np.left_shift(bits, 20 if one_byte else 13, out=bits)
        np.bitwise_and(bits, np.uint32(0x87FFFFFF if one_byte else 0x8FFFFFFF), out=bits)
        out *= np.float32(2.0**120 if one_byte else 2.0**112)
        if infinite:
            with np.errstate(over="ignore"):  # 2^16 * 2^112 overflows to the infinity it stands for
                np.multiply(out, np.float32(2.0**112), out=out, where=np.abs(out) >= 65536)

    def group_max_abs(
        self, codes: npt.NDArray[Any], scales: npt.NDArray[np.floating], dtype: np.dtype[Any]
    ) -> npt.NDArray[np.floating]:
        """``max |code * scale|`` per group ``(..., num_groups)``, without dequantizing every value.

        Equal to the maximum over each group of ``|dequantize(...)|``, bit for
        bit (rounding is monotonic). fp8 codes may come as their uint8 bytes.
        A scale-free format has one group spanning the head: ``(..., 1)``.
        """
        if not self.scaled:
            whole: npt.NDArray[np.floating] = np.abs(codes.astype(dtype)).max(axis=-1, keepdims=True)
            return whole
        groups = codes.reshape(*codes.shape[:-1], self.num_groups, self.group_size)
        if self.name == "int8":
            largest = np.maximum(groups.max(axis=-1).astype(dtype), -groups.min(axis=-1).astype(dtype))
        else:  # e4m3 magnitudes order like their 7 low bits
            magnitude = (groups.view(np.uint8) & 0x7F).max(axis=-1)
            largest = np.take(_fp8_values(dtype), magnitude)
        result: npt.NDArray[np.floating] = largest * scales
        return result


def _has_float16_infinity(raw: npt.NDArray[np.signedinteger[Any]]) -> bool:
    """Whether any float16 code (as int16) is an infinity: all five exponent bits set.

    NOTE: on the 2-byte codes, before widening: 71 us a 1024-token chunk
    against 102 for the widened floats' max and min.
    """
    exponents = scratch_buffer("exponents", np.dtype(np.int16), raw.shape)
    np.bitwise_and(raw, np.int16(0x7C00), out=exponents)
    return bool(exponents.size) and int(exponents.max()) == 0x7C00


def storage_format(name: str, head_dim: int) -> StorageFormat:
    """The :class:`StorageFormat` called ``name`` for heads of ``head_dim`` values.

    Raises:
        ConfigError, InputTypeError: an unknown name.
        ImportError: ``"float8_e4m3"`` or ``"bfloat16"`` without ml_dtypes (the ``fp8`` extra).

    >>> storage_format("float16", head_dim=4).num_groups
    0
    """
    name = check_storage_dtype("storage dtype", name) or ""
    if not name:
        raise ConfigError(f"storage dtype must be one of {STORAGE_DTYPES}")
    if name in SCALE_FREE_DTYPES:
        code_dtype = np.dtype(np.float16) if name == "float16" else _ml_dtype(name)
        return StorageFormat(name, head_dim, head_dim, code_dtype, _MAX_CODE[name], scaled=False)
    code_dtype = np.dtype(np.int8) if name == "int8" else _float8_dtype()
    return StorageFormat(name, head_dim, _group_size(head_dim), code_dtype, _MAX_CODE[name])


def bytes_per_token(
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: npt.DTypeLike = np.float32,
    key_dtype: str | None = None,
    value_dtype: str | None = None,
    num_layers: int = 1,
) -> int:
    """Bytes one token's keys and values take across ``num_layers`` layers, scales included.

    >>> bytes_per_token(num_kv_heads=8, head_dim=128)
    8192
    >>> bytes_per_token(num_kv_heads=8, head_dim=128, key_dtype="int8", value_dtype="int8")
    2304
    """
    compute = np.dtype(dtype)
    total = sum(head_bytes(name, head_dim, compute) for name in (key_dtype, value_dtype))
    return num_layers * num_kv_heads * total


def head_bytes(name: str | None, head_dim: int, dtype: np.dtype[Any]) -> int:
    """Bytes one token's head takes stored as ``name`` (None: in ``dtype``), scales in ``dtype`` included.

    The one rule of storage sizes; it needs no ml_dtypes, so pools and
    snapshots can be sized before any format is loaded.

    >>> head_bytes(None, 128, np.dtype(np.float32)), head_bytes("int8", 128, np.dtype(np.float32))
    (512, 144)
    """
    if name is None:
        return head_dim * dtype.itemsize
    if name in SCALE_FREE_DTYPES:
        return head_dim * 2  # float16 and bfloat16: two bytes a value, no scales
    return head_dim + (head_dim // _group_size(head_dim)) * dtype.itemsize  # int8 and fp8: a byte a value


def code_itemsize(name: str | None, dtype: np.dtype[Any]) -> int:
    """Bytes one stored value takes as ``name`` (None: in ``dtype``), scales left out.

    >>> code_itemsize("int8", np.dtype(np.float32)), code_itemsize(None, np.dtype(np.float32))
    (1, 4)
    """
    if name is None:
        return dtype.itemsize
    return 2 if name in SCALE_FREE_DTYPES else 1


@dataclass(frozen=True)
class QuantizedTokens:
    """Quantized keys or values of ``num_tokens`` tokens, head-major, in logical order.

    Either the tokens themselves, or (``slots`` given) a whole side of a
    pool and the slots to read, so that a fragmented table is read chunk by
    chunk straight from its pages, never gathered whole::

        slots None:   codes (H, num_tokens, d)   token i = codes[:, i]
        slots given:  codes (H, num_slots, d)    token i = codes[:, slots[i]]
        scale_slots:  scales (H, num_slots, G)   token i's = scales[:, scale_slots[i]]
                      (codes mapped in order, scales read from the pool by slot: a page view)

    Attributes:
        codes: ``(num_kv_heads, num_tokens or num_slots, head_dim)`` (often a
            transposed view of token-major pages; any strides).
        scales: ``(num_kv_heads, ..., num_groups)``, the same; None for a
            scale-free format (float16, bfloat16).
        storage: how to turn them back into floats.
        slots: the slot of each token, in order, or None.
        scale_slots: the slot of each token's scales where ``scales`` is a
            whole side's and ``codes`` are the tokens themselves, or None
            (the scales are indexed as the codes are).
    """

    codes: npt.NDArray[Any]
    scales: npt.NDArray[np.floating] | None
    storage: StorageFormat
    slots: npt.NDArray[np.intp] | None = None
    scale_slots: npt.NDArray[np.intp] | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, num_tokens, head_dim)``."""
        heads, tokens, dims = self.codes.shape
        return heads, tokens if self.slots is None else len(self.slots), dims

    def dequantize(self, start: int, end: int, dtype: np.dtype[Any]) -> npt.NDArray[np.floating]:
        """Tokens ``start .. end - 1`` as a new ``(num_kv_heads, end - start, head_dim)`` array."""
        codes, scales = self._stored(start, end)
        return self.storage.dequantize(codes.transpose(1, 0, 2), _heads_first(scales), dtype)

    def decode_into(self, start: int, end: int, out: npt.NDArray[np.floating]) -> None:
        """Tokens ``start .. end - 1`` into ``out``, token-major ``(end - start, H, d)`` and contiguous.

        Reads only those tokens' codes and scales (``StorageFormat.decode_into``):
        a fragmented table's are first copied, as stored, into this thread's
        scratch (``np.take`` by slot), never the whole table.
        """
        codes, scales = self._stored(start, end)
        self.storage.decode_into(codes, scales, out)

    def widen_into(
        self, start: int, end: int, out: npt.NDArray[np.floating]
    ) -> npt.NDArray[np.floating] | None:
        """Tokens ``start .. end - 1``'s exact code values into ``out`` ``(end - start, H, d)``; their scales.

        As :meth:`decode_into` without the multiply by the scales, which are
        returned, token-major ``(end - start, H, num_groups)`` (None for a
        scale-free format), for a kernel to fold into scores and weights.
        """
        codes, scales = self._stored(start, end)
        self.storage.widen_into(codes, out)
        return scales

    def _stored(
        self, start: int, end: int
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.floating] | None]:
        """Tokens ``start .. end - 1``'s codes ``(n, H, d)`` and scales ``(n, H, G)`` (or None), as stored."""
        if self.slots is None:
            codes = self.codes[:, start:end].transpose(1, 0, 2)
            if self.scales is None:
                return codes, None
            if self.scale_slots is None:
                return codes, self.scales[:, start:end].transpose(1, 0, 2)
            return codes, self._taken_scales(self.scale_slots[start:end])
        slots = self.slots[start:end]
        flat = self.codes.transpose(1, 0, 2)  # (num_slots, H, d), token-major as stored
        taken = scratch_buffer("codes", flat.dtype, (len(slots), *flat.shape[1:]))
        # NOTE: mode="clip" skips the bounds check that buffers the whole
        # result; the pool checked the plan, so every slot is in range.
        np.take(flat, slots, axis=0, out=taken, mode="clip")
        if self.scales is None:
            return taken, None
        return taken, self._taken_scales(slots)

    def _taken_scales(self, slots: npt.NDArray[np.intp]) -> npt.NDArray[np.floating]:
        """The scales at ``slots`` ``(n, H, G)``, copied into this thread's scratch."""
        assert self.scales is not None  # a scaled side (the callers checked)
        flat_scales = self.scales.transpose(1, 0, 2)
        taken_scales = scratch_buffer("scales", flat_scales.dtype, (len(slots), *flat_scales.shape[1:]))
        np.take(flat_scales, slots, axis=0, out=taken_scales, mode="clip")
        return taken_scales


def _heads_first(scales: npt.NDArray[np.floating] | None) -> npt.NDArray[np.floating] | None:
    return None if scales is None else scales.transpose(1, 0, 2)


#: Keys or values as attention reads them: floats, or codes and scales.
Tokens = npt.NDArray[np.floating] | QuantizedTokens
