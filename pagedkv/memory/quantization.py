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


@dataclass(frozen=True)
class QuantizedTokens:
    """Quantized keys or values of ``num_tokens`` tokens, head-major, in logical order.

    Attributes:
        codes: ``(num_kv_heads, num_tokens, head_dim)`` (often a transposed
            view of token-major pages; any strides).
        scales: ``(num_kv_heads, num_tokens, num_groups)``, the same; None
            for a scale-free format (float16, bfloat16).
        storage: how to turn them back into floats.
    """

    codes: npt.NDArray[Any]
    scales: npt.NDArray[np.floating] | None
    storage: StorageFormat

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, num_tokens, head_dim)``."""
        heads, tokens, dims = self.codes.shape
        return heads, tokens, dims

    def dequantize(self, start: int, end: int, dtype: np.dtype[Any]) -> npt.NDArray[np.floating]:
        """Tokens ``start .. end - 1`` as a new ``(num_kv_heads, end - start, head_dim)`` array."""
        scales = None if self.scales is None else self.scales[:, start:end]
        return self.storage.dequantize(self.codes[:, start:end], scales, dtype)


#: Keys or values as attention reads them: floats, or codes and scales.
Tokens = npt.NDArray[np.floating] | QuantizedTokens
