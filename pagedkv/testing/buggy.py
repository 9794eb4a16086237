"""Small caches with planted bugs, shipped as fixtures: the state machine must catch each one.

Each is a one-head cache with the seed's ``attend(q, k, v)`` and ``__init__(self,
max_size=None)``, a few lines long, wrong in exactly one way real KV caches get wrong (scoring
before evicting, a window one too long, a naive softmax, a block freed early, ...), and each
passes the seed's own example (see :class:`SeedCache`). :data:`PLANTED_BUGS` names them all but
``KeepsTokensOnClass``, whose failure depends on what ran before in the same process. The
table of bugs and what the kit prints for each: docs/testing.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "PLANTED_BUGS",
    "DropsCurrentToken",
    "EvictsAfterScoring",
    "FreesBlockEarly",
    "KeepsTokensOnClass",
    "NaiveSoftmax",
    "SeedCache",
    "WindowOneTooLong",
]

Vector = Sequence[float]


def _attention(q: Vector, keys: Sequence[Vector], values: Sequence[Vector]) -> list[float]:
    """Stable softmax attention of one query over ``keys``/``values``, in plain Python."""
    scores = [sum(a * b for a, b in zip(q, key)) for key in keys]
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [sum(w * value[i] for w, value in zip(weights, values)) / total for i in range(len(q))]


class SeedCache:
    """The seed exercise, solved: append, evict the oldest past ``max_size``, then score.

    Every planted bug passes the seed's own example too, which is the point:

    >>> {cls().attend([1.0], [1.0], [42.0])[0] for cls in PLANTED_BUGS.values()}
    {42.0}
    """

    def __init__(self, max_size: int | None = None) -> None:
        self.max_size = max_size
        self.keys: list[Vector] = []
        self.values: list[Vector] = []

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Append ``k``/``v``, evict past ``max_size``, attend ``q`` over the cache."""
        self._append(k, v)
        self._evict_past(self.max_size)
        return _attention(q, self.keys, self.values)

    def _append(self, k: Vector, v: Vector) -> None:
        self.keys.append(list(k))
        self.values.append(list(v))

    def _evict_past(self, limit: int | None) -> None:
        """Drop the oldest entry once more than ``limit`` are cached (one comes in per call)."""
        if limit is not None and len(self.keys) > limit:
            del self.keys[0], self.values[0]


class EvictsAfterScoring(SeedCache):
    """Planted bug: scores while ``W + 1`` entries are cached, and evicts only afterwards.

    Its length is right after every call; only its outputs are wrong.
    """

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Append, score, then evict (the bug: eviction must come before scoring)."""
        self._append(k, v)
        out = _attention(q, self.keys, self.values)
        self._evict_past(self.max_size)
        return out


class WindowOneTooLong(SeedCache):
    """Planted bug: an off-by-one in the eviction test keeps ``W + 1`` entries."""

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Append, evict only past ``max_size + 1`` (the bug), score."""
        self._append(k, v)
        self._evict_past(None if self.max_size is None else self.max_size + 1)
        return _attention(q, self.keys, self.values)


class DropsCurrentToken(SeedCache):
    """Planted bug: scores over the earlier entries, then appends; the first token returns ``v``."""

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Score the cache as it was (the bug), then append and evict."""
        out = _attention(q, self.keys, self.values) if self.keys else list(v)
        self._append(k, v)
        self._evict_past(self.max_size)
        return out


class NaiveSoftmax(SeedCache):
    """Planted bug: the textbook softmax ``exp(s) / sum(exp(s))``, which overflows past ~709."""

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Append, evict, score without subtracting the largest score (the bug)."""
        self._append(k, v)
        self._evict_past(self.max_size)
        weights = [math.exp(sum(a * b for a, b in zip(q, key))) for key in self.keys]
        total = sum(weights)
        return [
            sum(w * val[i] for w, val in zip(weights, self.values)) / total for i in range(len(q))
        ]


class FreesBlockEarly:
    """Planted bug: a paged cache that gives its oldest block back one token too early.

    Tokens live in blocks of ``block_size`` slots taken from a free stack (the
    block freed last is taken first, as in a LIFO pool). A block may go back
    only once *every* token in it is evicted; this one goes back as soon as its
    *first* token is, so the next block taken is the same block, and writing
    new tokens into it overwrites a token that is still cached.

    Invariants:
        * no block is both free and in the block table (this is what breaks);
        * ``len(self) == num_tokens - first``.
    """

    def __init__(self, max_size: int | None = None, *, block_size: int = 2, num_blocks: int = 128):
        self.max_size = max_size
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ...
        self.table: list[int] = []  # held block ids, oldest first
        self.first_block = 0  # logical block index of table[0]
        self.first = 0  # logical index of the oldest cached token
        self.num_tokens = 0  # tokens appended
        self.num_blocks = num_blocks
        self.keys: npt.NDArray[np.float64] | None = None  # (num_blocks, block_size, head_dim)
        self.values: npt.NDArray[np.float64] | None = None

    def __len__(self) -> int:
        return self.num_tokens - self.first

    def attend(self, q: Any, k: Any, v: Any) -> list[float]:
        """Append ``k``/``v`` to the last block, evict past ``max_size``, attend over the blocks."""
        query, key, value = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        if self.keys is None or self.values is None:
            self.keys = np.zeros((self.num_blocks, self.block_size, key.shape[-1]))
            self.values = np.zeros_like(self.keys)
        offset = self.num_tokens % self.block_size
        if offset == 0:
            self.table.append(self.free.pop())
        self.keys[self.table[-1], offset] = key
        self.values[self.table[-1], offset] = value
        self.num_tokens += 1
        if self.max_size is not None and len(self) > self.max_size:
            self.first += 1
            if self.first % self.block_size == 1 % self.block_size:
                # BUG: the oldest block's *first* token was just evicted, but the
                # rest of it is still cached; it must go back only when all are.
                self.free.append(self.table[0])
            if self.first // self.block_size > self.first_block:
                del self.table[0]
                self.first_block += 1
        start = self.first - self.first_block * self.block_size
        keys = self.keys[self.table].reshape(-1, key.shape[-1])[start : start + len(self)]
        values = self.values[self.table].reshape(-1, key.shape[-1])[start : start + len(self)]
        scores = keys @ query  # (len,)
        weights = np.exp(scores - scores.max())
        out: list[float] = (weights @ values / weights.sum()).tolist()
        return out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a block is both free and held, or the length is off."""
        both = set(self.free) & set(self.table)
        if both:
            raise AssertionError(f"blocks {sorted(both)} are both free and in the block table")
        if len(self) != self.num_tokens - self.first or len(self) < 0:
            raise AssertionError(f"len {len(self)} disagrees with the counters")


class KeepsTokensOnClass:
    """Planted bug: its keys and values are lists in the class body, so every instance shares them.

    Python's classic slip: ``keys = []`` at class level is one list for the
    class, not one per instance. The first cache built in a process is right;
    every later one starts with the tokens of all before it.
    """

    # BUG: class attributes, one list for every instance; __init__ must make its own.
    keys: ClassVar[list[Vector]] = []
    values: ClassVar[list[Vector]] = []

    def __init__(self, max_size: int | None = None) -> None:
        self.max_size = max_size

    def __len__(self) -> int:
        return len(self.keys)

    def attend(self, q: Vector, k: Vector, v: Vector) -> list[float]:
        """Append ``k``/``v`` (to the shared lists), evict past ``max_size``, attend."""
        self.keys.append(list(k))
        self.values.append(list(v))
        if self.max_size is not None and len(self.keys) > self.max_size:
            del self.keys[0], self.values[0]
        return _attention(q, self.keys, self.values)


#: The planted bugs, each with what the machine's diagnosis should say about it.
PLANTED_BUGS: dict[str, type[Any]] = {
    "evicts after scoring": EvictsAfterScoring,
    "window one token too long": WindowOneTooLong,
    "drops the current token": DropsCurrentToken,
    "naive softmax overflows": NaiveSoftmax,
    "frees a block early": FreesBlockEarly,
}
