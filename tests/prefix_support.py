"""Helpers shared by the prefix-caching tests: a manager, k/v of a whole prefix, a runner.

k/v of a token are a function of its whole prefix (and the layer), as in a real
model; see ``tests/test_stateful_prefix.py`` for why a (token id, position)
model would be too weak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv import KVCacheManager, KVPool
from pagedkv.prefix_cache import (
    ROOT_KEY,
    PrefixCache,
    block_keys,
    encode_extra_keys,
    hash_function,
    token_bytes,
)

SHA256 = hash_function("sha256")


def kv_of(prefix: tuple[int, ...], layer: int, num_kv_heads: int = 1, head_dim: int = 2) -> np.ndarray:
    """``(3, num_kv_heads, head_dim)`` q, k, v of the last token of ``prefix``: a function of
    the whole prefix, as in a real model (see ``tests/test_stateful_prefix.py``)."""
    size = 3 * num_kv_heads * head_dim
    digest = hashlib.blake2b(repr((prefix, layer)).encode(), digest_size=size).digest()
    return ((np.frombuffer(digest, np.uint8).astype(np.float64) - 128.0) / 64.0).reshape(
        3, num_kv_heads, head_dim
    )


def make(
    num_blocks: int = 8, block_size: int = 2, num_layers: int = 1, host: bool = False, **kwargs: Any
) -> KVCacheManager:
    shape = {"block_size": block_size, "head_dim": 2, "num_layers": num_layers}
    return KVCacheManager(
        KVPool(num_blocks, **shape),
        host_pool=KVPool(num_blocks, **shape) if host else None,
        enable_prefix_caching=kwargs.pop("enable_prefix_caching", True),
        **kwargs,
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
    prefix = manager._prefix
    assert prefix is not None
    return prefix


def key_chain(tokens: list[int], block_size: int = 2, extra_keys: Any = None) -> list[bytes]:
    return block_keys(ROOT_KEY, token_bytes(tokens), block_size, encode_extra_keys(extra_keys), SHA256)


def from_scratch(prompt: list[int], chunks: list[int], **kwargs: Any) -> list[np.ndarray]:
    """Outputs of the last chunk of ``prompt`` fed in ``chunks`` on a manager without caching."""
    runner = Runner(make(num_blocks=16, enable_prefix_caching=False, **kwargs))
    runner.add("s", [])
    start, outs = 0, []
    for size in chunks:
        outs = runner.feed({"s": prompt[start : start + size]})
        start += size
    return outs
