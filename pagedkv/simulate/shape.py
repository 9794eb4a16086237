"""The modeled model's KV geometry: how many bytes one token's keys and values take.

    bytes per token = num_layers x num_kv_heads x head_dim x 2 (K and V) x dtype_bytes

>>> ModelShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2).bytes_per_token
32
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError

__all__ = ["ModelShape"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The modeled model's KV geometry (not the tiny pool the simulator really uses).

    Attributes:
        num_layers: transformer layers.
        num_kv_heads: key/value heads per layer.
        head_dim: values per head.
        dtype_bytes: bytes per stored value (2 for fp16/bf16, 1 for fp8).
    """

    num_layers: int = 40
    num_kv_heads: int = 40
    head_dim: int = 128
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes across every layer."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes
