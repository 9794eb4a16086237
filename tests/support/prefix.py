"""Prefix-caching helpers: k/v of a whole prefix, block keys, a manager and a runner.

k/v of a token are a function of its whole prefix (and the layer), as in a real
model; see ``tests/test_stateful_prefix.py`` for why a (token id, position)
model would be too weak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np

from pagedkv import KVCacheManager
from pagedkv.prefix.cache import (
    ROOT_KEY,
    PrefixCache,
    block_keys,
    hash_function,
    token_bytes,
)
from pagedkv.prefix.keys import encode_extra_keys
from support.managers import make_manager

SHA256 = hash_function("sha256")


@cache
def kv_of(prefix: tuple[int, ...], layer: int, num_kv_heads: int = 1, head_dim: int = 2) -> np.ndarray:
    """``(3, num_kv_heads, head_dim)`` q, k, v of the last token of ``prefix`` in ``layer``.

    Small exact floats (multiples of 1/64 in [-2, 2]) drawn from a hash of the
    whole prefix: a stand-in for a model whose k/v depend on every earlier
    token. Cached, so the array is read-only.
    """
    size = 3 * num_kv_heads * head_dim
    digest = hashlib.blake2b(repr((prefix, layer)).encode(), digest_size=size).digest()
    values = (np.frombuffer(digest, np.uint8).astype(np.float64) - 128.0) / 64.0
    values.flags.writeable = False
    return values.reshape(3, num_kv_heads, head_dim)


def make(
    num_blocks: int = 8, block_size: int = 2, num_layers: int = 1, host: bool = False, **options: Any
) -> KVCacheManager:
    """A prefix-caching manager (``enable_prefix_caching=False`` turns it off), ``head_dim`` 2;
    ``host`` adds a host pool as large as the device pool."""
    options.setdefault("enable_prefix_caching", True)
    return make_manager(
        num_blocks,
        host_blocks=num_blocks if host else 0,
        block_size=block_size,
        head_dim=2,
        num_layers=num_layers,
        **options,
    )


class Runner:
    """Feeds sequences through a manager, k/v from ``kv_of`` their own history."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.history: dict[str, list[int]] = {}

    def add(self, seq_id: str, prompt: list[int], extra_keys: Mapping[str, Any] | None = None) -> int:
        num_hit = self.manager.add_sequence(seq_id, prompt, extra_keys=extra_keys)
        self.history[seq_id] = list(prompt[:num_hit])
        return num_hit

    def feed(self, chunks: dict[str, list[int]], layers: list[int] | None = None) -> list[np.ndarray]:
        """Reserve ``chunks`` and write (and attend) ``layers`` (default every layer)."""
        manager = self.manager
        batch = manager.reserve(chunks)
        positions = []
        for seq_id, tokens in chunks.items():
            start = len(self.history[seq_id])
            self.history[seq_id].extend(tokens)
            positions += [(seq_id, start + i) for i in range(len(tokens))]
        outs = []
        for layer in range(manager.pool.num_layers) if layers is None else layers:
            rows = np.array([kv_of(tuple(self.history[s][: p + 1]), layer) for s, p in positions])
            manager.write(layer, batch, rows[:, 1], rows[:, 2])
            outs.append(manager.attend(layer, batch, rows[:, 0]))
        manager.check_invariants()
        return outs

    def admit(self, seq_id: str, prompt: list[int], extra_keys: Mapping[str, Any] | None = None) -> int:
        num_hit = self.add(seq_id, prompt, extra_keys)
        self.feed({seq_id: prompt[num_hit:]})
        return num_hit


def prefix_of(manager: KVCacheManager) -> PrefixCache:
    """The manager's prefix cache (prefix caching must be on)."""
    prefix = manager.prefix_cache
    assert prefix is not None
    return prefix


def key_chain(tokens: list[int], block_size: int = 2, extra_keys: Any = None) -> list[bytes]:
    """The chained keys of ``tokens``' full blocks, as the manager computes them (SHA-256)."""
    return block_keys(ROOT_KEY, token_bytes(tokens), block_size, encode_extra_keys(extra_keys), SHA256)


def from_scratch(prompt: list[int], chunks: list[int], **options: Any) -> list[np.ndarray]:
    """Outputs of the last chunk of ``prompt`` fed in ``chunks`` on a manager without caching."""
    runner = Runner(make(num_blocks=16, enable_prefix_caching=False, **options))
    runner.add("s", [])
    start, outs = 0, []
    for size in chunks:
        outs = runner.feed({"s": prompt[start : start + size]})
        start += size
    return outs
