"""Keys or values quantized as a pool stores them, for the kernels' recompute tests."""

from __future__ import annotations

import numpy as np

from pagedkv.memory.quantization import QuantizedTokens, storage_format


def stored(name: str, dense: np.ndarray) -> QuantizedTokens:
    """``dense`` ``(n, H, d)`` quantized token by token, as a pool stores it, head-major."""
    storage = storage_format(name, dense.shape[-1])
    codes, scales = storage.quantize(dense)
    return QuantizedTokens(codes.transpose(1, 0, 2), scales.transpose(1, 0, 2) if storage.scaled else None,
                           storage)
