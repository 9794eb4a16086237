"""Checking and converting what callers pass in: vectors and scales (counts: :mod:`pagedkv.counts`).

Everything here only reads its arguments; callers validate every input before
they change any state, which is how a failed call leaves nothing half-done.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ConfigError, InputTypeError, NonFiniteError, ShapeError

__all__ = [
    "FLOAT_DTYPES",
    "as_bounded_vectors",
    "as_tokens",
    "as_vectors",
    "check_dtype",
    "check_scale",
    "check_score_bound",
    "check_score_bound_from_max",
    "check_token_pair",
    "check_tokens",
    "check_vector_shapes",
    "is_torch_tensor",
    "largest_magnitude",
    "like_input",
    "torch_array",
    "value_limit",
]

#: The float dtypes pools store and compute in (quantized storage is a separate option).
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# A margin below the dtype's maximum: a softmax-weighted sum of values (and
# a partial sum inside a matmul) must not overflow even after rounding.
_LIMITS = {dtype: float(np.finfo(dtype).max) / 16 for dtype in FLOAT_DTYPES}
# NOTE: a decode write finds float32's limit by dtype identity (numpy's builtin
# dtypes are singletons): the dict lookup hashes the dtype on every call.
_FLOAT32 = FLOAT_DTYPES[0]
_FLOAT32_LIMIT = _LIMITS[_FLOAT32]


def value_limit(dtype: np.dtype[Any]) -> float:
    """The largest magnitude a stored value may have: ``finfo(dtype).max / 16``.

    >>> value_limit(np.dtype(np.float32)) == float(np.finfo(np.float32).max) / 16
    True
    """
    limit = _LIMITS.get(dtype)
    return float(np.finfo(dtype).max) / 16 if limit is None else limit


def largest_magnitude(value: npt.NDArray[Any], dtype: np.dtype[Any]) -> float | None:
    """``max |value|`` when every value is finite and within ``value_limit(dtype)``, else None.

    NOTE: the largest and smallest values (``argmax`` + ``argmin`` + two
    ``item`` calls) check every value at once: a NaN is reported as both, so
    it fails the limit. No temporary, no ufunc reduction set-up: cheaper than
    ``np.abs(value).max()`` for one token's k/v and no dearer for a prefill
    (benchmarks/bench_requests.py).

    >>> largest_magnitude(np.array([1.0, -3.0]), np.dtype(np.float64))
    3.0
    >>> largest_magnitude(np.array([1.0, np.nan]), np.dtype(np.float64)) is None
    True
    """
    flat = value.ravel()  # (size,): argmax over no axis would ravel it once per call
    high = flat.item(flat.argmax())
    low = flat.item(flat.argmin())
    limit = _LIMITS.get(dtype) or value_limit(dtype)
    if high <= limit and -low <= limit:  # False for a NaN
        return float(high if high >= -low else -low)
    return None


def as_vectors(
    name: str, value: Any, dtype: np.dtype[Any], *, ndims: tuple[int, ...] = (1, 2)
) -> tuple[npt.NDArray[Any], bool]:
    """Convert ``value`` (a list or an array of real numbers) to an array of ``dtype``.

    :func:`as_bounded_vectors` without the magnitude; the same arguments and errors.

    >>> as_vectors("q", [1, 2.5], np.dtype(np.float64))
    (array([1. , 2.5]), True)
    """
    array, came_as_list, _ = as_bounded_vectors(name, value, dtype, ndims=ndims)
    return array, came_as_list


def as_bounded_vectors(
    name: str, value: Any, dtype: np.dtype[Any], *, ndims: tuple[int, ...] = (1, 2)
) -> tuple[npt.NDArray[Any], bool, float]:
    """Convert ``value`` (a list or an array of real numbers) to an array of ``dtype``; its largest magnitude.

    Args:
        name: the argument's name, quoted in error messages.
        value: a (nested) list or tuple of real numbers, a numpy array, or
            a CPU torch tensor (read in place; bfloat16 is widened to float32).
        dtype: the float dtype to convert to.
        ndims: the numbers of dimensions allowed.

    Returns:
        ``(array, came_as_list, max |array|)``; the array is a new or existing array of ``dtype``.

    Raises:
        InputTypeError: strings, ``None``, bools, complex numbers or other objects.
        ShapeError: ragged lists, a disallowed number of dimensions, or no values.
        NonFiniteError: NaN or infinity, including values that overflow ``dtype``.

    >>> as_bounded_vectors("k", [1, -2.5], np.dtype(np.float64))
    (array([ 1. , -2.5]), True, 2.5)
    """
    if value.__class__ is np.ndarray and value.dtype is dtype and value.ndim in ndims and value.size:
        # The common case, an array of exactly the dtype, checked by its
        # extremes; anything else, or any failure, takes the general path
        # below, whose errors it shares.
        largest = largest_magnitude(value, dtype)
        if largest is not None:
            return value, False, largest
    came_as_list = isinstance(value, (list, tuple))
    if isinstance(value, np.ma.MaskedArray):
        # NOTE: a mask hides entries from every check below (NaN included),
        # and storing the data would store what the mask hid.
        raise InputTypeError(
            f"{name} is a masked array; its mask would be lost in the cache: pass plain values "
            f"(np.ma.filled({name}, fill_value) or {name}.data)"
        )
    if isinstance(value, np.ndarray):
        array = value if type(value) is np.ndarray else np.asarray(value)
    elif is_torch_tensor(value):
        array = torch_array(name, value)
    elif came_as_list:
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as error:
            raise ShapeError(f"{name} must be a rectangular list of numbers: {error}") from error
    else:
        raise InputTypeError(
            f"{name} must be a list or numpy array of real numbers, got {type(value).__name__}"
        )
    kind = array.dtype.kind
    if kind == "O" and all(isinstance(x, int) and not isinstance(x, bool) for x in array.flat):
        raise NonFiniteError(f"{name} holds an int too large for any float dtype; every value must be finite")
    if kind not in "fiu":
        what = {"b": "bools", "c": "complex numbers", "U": "strings", "S": "bytes", "O": "objects"}
        raise InputTypeError(
            f"{name} must hold real numbers, got {what.get(kind, str(array.dtype))} "
            f"(dtype {array.dtype})"
        )
    if array.ndim not in ndims:
        allowed = " or ".join(str(n) for n in ndims)
        raise ShapeError(f"{name} must have {allowed} dimensions, got shape {array.shape}")
    if array.size == 0:
        raise ShapeError(f"{name} is empty (shape {array.shape}); each head needs head_dim >= 1 values")
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(dtype, copy=False)
    if not np.isfinite(converted).all():
        bad = converted[~np.isfinite(converted)].flat[0]
        raise NonFiniteError(
            f"{name} holds {bad} in {dtype}; every value must be finite"
            + ("" if not np.isfinite(array).all() else f" (it overflows {dtype})")
        )
    limit = value_limit(dtype)
    largest = float(np.abs(converted).max())
    if largest > limit:
        raise NonFiniteError(
            f"{name} holds a value of magnitude {largest:.3g}, above {limit:.3g} "
            f"(the {dtype} maximum / 16) that keeps every sum finite; scale it down"
        )
    return converted, came_as_list, largest


def is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (False whenever torch was never imported: no import here)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def torch_array(name: str, tensor: Any) -> npt.NDArray[Any]:
    """A CPU torch tensor's numpy array: the same memory (no copy), except bfloat16, copied to float32.

    numpy has no bfloat16, so such a tensor is widened (exactly: every
    bfloat16 is a float32). The caller checks values and shape as for any array.

    Raises:
        InputTypeError: the tensor is not on the CPU, or is complex.
    """
    if tensor.device.type != "cpu":
        raise InputTypeError(
            f"{name} is a torch tensor on {tensor.device}; pagedkv computes on the CPU: pass {name}.cpu()"
        )
    if tensor.is_complex():
        raise InputTypeError(f"{name} must hold real numbers, got a complex tensor ({tensor.dtype})")
    plain = tensor.detach().resolve_conj().resolve_neg()
    if str(plain.dtype) == "torch.bfloat16":
        plain = plain.float()
    array: npt.NDArray[Any] = plain.numpy()
    return array


def like_input(given: object, result: npt.NDArray[Any]) -> Any:
    """``result`` as a torch tensor (sharing its memory) when ``given`` was one, else as it is."""
    if not is_torch_tensor(given):
        return result
    return sys.modules["torch"].from_numpy(result)


def as_tokens(
    name: str, value: Any, dtype: np.dtype[Any], expected: tuple[int, int, int]
) -> npt.NDArray[Any]:
    """``as_vectors`` for a batch of tokens, of exactly ``expected = (num_tokens, num_heads, head_dim)``.

    Raises:
        InputTypeError, NonFiniteError: as ``as_vectors``.
        ShapeError: any other shape.
    """
    return _bounded_tokens(name, value, dtype, expected)[0]


def _bounded_tokens(
    name: str, value: Any, dtype: np.dtype[Any], expected: tuple[int, int, int]
) -> tuple[npt.NDArray[Any], float]:
    array, _, largest = as_bounded_vectors(name, value, dtype, ndims=(3,))
    if array.shape != expected:
        raise ShapeError(
            f"{name} must have shape (num_tokens, num_heads, head_dim) = {expected}, got {array.shape}"
        )
    return array, largest


def check_tokens(
    name: str, value: Any, dtype: np.dtype[Any], expected: tuple[int, int, int], scan: bool = True
) -> tuple[npt.NDArray[Any], float]:
    """:func:`as_tokens`, and the largest magnitude in the result.

    The fast path takes what an engine passes, a plain array of exactly
    ``dtype`` and ``expected``, checked by its extremes
    (:func:`largest_magnitude`, which also gives the magnitude). Anything
    else, or any failure, takes :func:`as_tokens`' checks, whose errors it shares.

    Args:
        name, value, dtype, expected: as :func:`as_tokens`.
        scan: False skips the scan on the fast path (the caller vouches for
            the values; see ``KVCacheManager(trusted_inputs=True)``); the
            magnitude is then reported as 0.0. Type, dtype and shape are
            checked either way.

    Raises:
        InputTypeError, NonFiniteError, ShapeError: as :func:`as_tokens`.

    >>> check_tokens("k", np.array([[[1.0, -3.0]]]), np.dtype(np.float64), (1, 1, 2))[1]
    3.0
    """
    if value.__class__ is not np.ndarray and is_torch_tensor(value):
        value = torch_array(name, value)  # the same memory: the fast path below applies
    if value.__class__ is np.ndarray and value.dtype is dtype and value.shape == expected:
        if not scan:
            return value, 0.0
        largest = largest_magnitude(value, dtype)
        if largest is not None:
            return value, largest
    return _bounded_tokens(name, value, dtype, expected)


def check_token_pair(
    keys: Any,
    values: Any,
    dtype: np.dtype[Any],
    expected: tuple[int, int, int],
    scan: bool = True,
    index: npt.NDArray[np.intp] | None = None,
    flat: bool = False,
) -> tuple[npt.NDArray[Any], npt.NDArray[Any], float]:
    """:func:`check_tokens` of a write's ``keys`` and ``values`` in one call: both arrays, and max |key|.

    The same checks and errors as two :func:`check_tokens` calls (keys
    first), with the fast path's tests made once for the pair: an engine's
    decode ``write`` makes this call every layer of every step.

    Args:
        keys, values: what ``write`` was given.
        dtype, expected: as :func:`as_tokens`.
        scan: False skips scanning both on the fast path (as
            ``check_tokens(..., scan=False)``, the largest |key| then
            reported as 0.0); type, dtype and shape are checked either way.
        index: a 0-d ``intp`` array the fast path's ``argmax``/``argmin``
            write into instead of allocating each result (``KVCacheManager``
            passes its own, used only under the pool's lock: another thread
            writing it between an ``argmax`` and its ``item`` would point the
            check at the wrong value). None: a fresh one.
        flat: return both arrays raveled, ``(prod(expected),)`` in C order
            (views where the inputs are contiguous: the ones the scan read),
            as ``PageStore.write_token`` takes one token.

    Raises:
        InputTypeError, NonFiniteError, ShapeError: as :func:`as_tokens`.

    >>> ones, zeros = np.ones((1, 1, 2)), np.zeros((1, 1, 2))
    >>> check_token_pair(ones, zeros, np.dtype(np.float64), (1, 1, 2))[2]
    1.0
    """
    if (
        keys.__class__ is np.ndarray
        and values.__class__ is np.ndarray
        and keys.dtype is dtype
        and values.dtype is dtype
        and keys.shape == expected
        and values.shape == expected
    ):
        if not scan:
            return (keys.ravel(), values.ravel(), 0.0) if flat else (keys, values, 0.0)
        # NOTE: largest_magnitude's rule, inlined (a call of it per side costs
        # more than its lines). Each side is raveled once: ``argmax`` over no
        # axis ravels its array itself, a new array object every call (a copy
        # of a strided one). With ``out=index`` no result array is allocated.
        if index is None:
            index = np.empty((), np.intp)
        limit = _FLOAT32_LIMIT if dtype is _FLOAT32 else value_limit(dtype)
        flat_keys = keys.ravel()  # (num_tokens * num_kv_heads * head_dim,)
        high = flat_keys.item(flat_keys.argmax(None, index))
        low = flat_keys.item(flat_keys.argmin(None, index))
        if high <= limit and -low <= limit:  # False for a NaN
            flat_values = values.ravel()
            value_high = flat_values.item(flat_values.argmax(None, index))
            value_low = flat_values.item(flat_values.argmin(None, index))
            if value_high <= limit and -value_low <= limit:
                largest = high if high >= -low else -low
                return (flat_keys, flat_values, largest) if flat else (keys, values, largest)
    key_array, largest = check_tokens("keys", keys, dtype, expected, scan)
    value_array, _ = check_tokens("values", values, dtype, expected, scan)
    if flat:
        return key_array.ravel(), value_array.ravel(), largest
    return key_array, value_array, largest


def check_dtype(dtype: object) -> np.dtype[np.floating]:
    """Validate a float dtype (float32 or float64, by any name numpy knows) and return it.

    Raises:
        InputTypeError: not something numpy reads as a dtype.
        ConfigError: another dtype.
    """
    try:
        resolved = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as error:
        raise InputTypeError(f"dtype must be float32 or float64, got {dtype!r}") from error
    if resolved not in FLOAT_DTYPES:
        raise ConfigError(f"dtype must be float32 or float64, got {resolved}")
    return resolved  # type: ignore[no-any-return]


def check_scale(scale: object) -> float:
    """Validate a softmax scale: a finite real number.

    Raises:
        InputTypeError: not a real number (bools included).
        NonFiniteError: NaN or infinity.
    """
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise InputTypeError(f"scale must be a real number, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise NonFiniteError(f"scale must be finite, got {scale}")
    return float(scale)


def check_score_bound(
    scale: float, queries: npt.NDArray[Any], max_abs_key: float, dtype: np.dtype[Any]
) -> None:
    """Refuse queries whose attention scores could overflow ``dtype``.

    ``|scale * q.k| <= |scale| * sum|q| * max|k|``; the bound must stay far
    below the dtype's maximum (a sixteenth of it) so no score, and no partial
    sum of one, can overflow. The one rule for every attention entry point.

    Args:
        scale: the softmax scale.
        queries: ``(..., head_dim)``; each row is bounded on its own.
        max_abs_key: the largest |key| the keys attended over can hold.
        dtype: the compute dtype.

    Raises:
        NonFiniteError: some score could exceed ``finfo(dtype).max / 16``.

    >>> check_score_bound(1.0, np.array([1e154]), 1e154, np.dtype(np.float64))
    Traceback (most recent call last):
    ...
    pagedkv.errors.NonFiniteError: attention scores could reach 1e+308, beyond what float64 holds ...
    """
    bound = abs(scale) * float(np.abs(queries).sum(axis=-1).max()) * max_abs_key
    limit = value_limit(dtype)
    if bound > limit:
        raise NonFiniteError(
            f"attention scores could reach {bound:.3g}, beyond what {dtype} holds "
            f"safely ({limit:.3g}); scale q or k down"
        )


# NOTE: the exact rule sums |q| over head_dim in floating point, which can
# round above head_dim * max|q| by a few ulps per term; the cheap bound is
# inflated by this factor so it stays above the exact one for any head_dim
# up to about 10^5 in float32.
_ROUNDING_MARGIN = 1.0 + 2.0**-6


def check_score_bound_from_max(
    scale: float,
    queries: npt.NDArray[Any],
    largest_query: float,
    max_abs_key: float,
    dtype: np.dtype[Any],
) -> None:
    """:func:`check_score_bound`, accepting at once when ``max|q|`` already bounds it.

    ``sum |q_i| <= head_dim * max|q|`` for every row, so when
    ``|scale| * head_dim * max|q| * max|k|`` stays within the limit the exact
    rule would accept too, and it is skipped; otherwise the exact rule runs
    and decides. The same queries are refused as by the exact rule alone,
    with its error.

    Args:
        scale: the softmax scale.
        queries: ``(..., head_dim)``, every value finite (already checked).
        largest_query: ``max |queries|`` (what :func:`check_tokens` returns).
        max_abs_key: the largest |key| the keys attended over can hold.
        dtype: the compute dtype.

    Raises:
        NonFiniteError: as :func:`check_score_bound`.

    >>> f64 = np.dtype(np.float64)
    >>> check_score_bound_from_max(1.0, np.array([[1.0, -2.0]]), 2.0, 3.0, f64)  # 2 * 2 * 3: far within
    >>> check_score_bound_from_max(1.0, np.array([[1e150, 0.0]]), 1e150, 1e157, f64)  # 2e307, exact: 1e307
    >>> check_score_bound_from_max(1.0, np.array([[1e154, -2e154]]), 2e154, 1e153, f64)
    Traceback (most recent call last):
    ...
    pagedkv.errors.NonFiniteError: attention scores could reach 3e+307, beyond what float64 holds ...
    """
    cheap = abs(scale) * queries.shape[-1] * largest_query * max_abs_key * _ROUNDING_MARGIN
    if not cheap <= value_limit(dtype):  # also True for an overflow to inf
        check_score_bound(scale, queries, max_abs_key, dtype)


def check_vector_shapes(
    query: npt.NDArray[Any],
    key: npt.NDArray[Any],
    value: npt.NDArray[Any],
    kv_shape: tuple[int, ...] | None,
    pool_shape: tuple[int, int] | None,
) -> None:
    """The shapes ``KVCache.attend`` accepts: q, k, v of one token, agreeing with the cache and its pool.

    Args:
        query, key, value: ``(head_dim,)`` each, or ``(num_q_heads, head_dim)``
            and ``(num_kv_heads, head_dim)``.
        kv_shape: the k/v shape the cache holds already, or None.
        pool_shape: the pool's ``(num_kv_heads, head_dim)``, or None (no pool yet).

    Raises:
        ShapeError: any disagreement, named with both shapes.
    """
    if key.shape != value.shape:
        raise ShapeError(f"k and v must have the same shape, got {key.shape} and {value.shape}")
    if query.ndim != key.ndim:
        raise ShapeError(
            f"q and k must both be (head_dim,) or both (num_heads, head_dim), "
            f"got q {query.shape} and k {key.shape}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ShapeError(f"q has head_dim {query.shape[-1]} but k has {key.shape[-1]}")
    if query.ndim == 2 and query.shape[0] % key.shape[0]:
        raise ShapeError(f"num_q_heads={query.shape[0]} is not a multiple of num_kv_heads={key.shape[0]}")
    if kv_shape is not None and key.shape != kv_shape:
        raise ShapeError(f"this cache holds k/v of shape {kv_shape}, got {key.shape}")
    if kv_shape is None and pool_shape is not None:
        got = key.shape if key.ndim == 2 else (1, key.shape[0])
        if got != pool_shape:
            raise ShapeError(
                f"the pool stores (num_kv_heads, head_dim)={pool_shape}, got k of shape {key.shape}"
            )
