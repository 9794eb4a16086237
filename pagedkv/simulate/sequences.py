"""The simulator's side of every sequence it put into the manager: owner, tokens, writes.

Owns :class:`SequenceBook`: per sequence id its owning request, its token ids (prefix
caching only) and its decode entry, and the zero k/v writes a reservation asks for.
Counterpart: the request-to-sequence bookkeeping of vLLM's ``SequenceGroup`` (v0).
What it keeps and an example: docs/simulate.md, "The sequence book".
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv import Batch, KVCacheManager
from pagedkv.simulate.result import PolicyResult

__all__ = ["SequenceBook"]


class SequenceBook:
    """Sequence ids, their owners and tokens, and the writes into one manager.

    Args:
        manager: the manager whose sequences these are.
        result: where the prefill counts go.
        with_tokens: keep every sequence's token ids (prefix caching needs them).

    Invariants:
        * ``seq_owner`` and (with tokens) ``history`` hold exactly the
          sequences the manager knows;
        * ``decode`` holds exactly the running sequences (checked by the
          engine's ``check_consistency``).
    """

    def __init__(self, manager: KVCacheManager, result: PolicyResult, *, with_tokens: bool = False) -> None:
        self.manager = manager
        self.result = result
        self.with_tokens = with_tokens
        #: ``seq_id -> request_id`` of every known sequence.
        self.seq_owner: dict[Hashable, int] = {}
        #: Token ids per sequence (prompt and output), kept only ``with_tokens``.
        self.history: dict[Hashable, list[int]] = {}
        #: The persistent decode request ``{seq_id: 1}`` of every running sequence (without tokens).
        self.decode: dict[Hashable, Any] = {}
        #: This step's work for the cost model, reset by :meth:`begin_step`:
        #: prefill tokens fed, their context read, their (query, key) pairs,
        #: and blocks copied to or from the host.
        self.num_step_prefill_tokens = 0
        self.num_step_prefill_context = 0
        self.num_step_prefill_pairs = 0
        self.num_step_swapped_blocks = 0
        self._next_seq_id = 0
        self._kv: npt.NDArray[np.float32] = np.zeros((1024, 1, 1), np.float32)  # (num_tokens, 1 head, 1)

    def new_seq_id(self, request_id: int) -> int:
        """A fresh sequence id, owned by ``request_id`` (the manager does not know it yet)."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.seq_owner[seq_id] = request_id
        return seq_id

    def forget(self, seq_id: int, successor: int | None = None) -> None:
        """Drop a sequence id's bookkeeping (its history passes to ``successor``)."""
        self.seq_owner.pop(seq_id, None)
        self.decode.pop(seq_id, None)
        history = self.history.pop(seq_id, None)
        if successor is not None and history is not None:
            self.history[successor] = history

    def fork(self, parent: int, request_id: int) -> int:
        """Fork ``parent`` into a new sequence of ``request_id`` with a copy of its tokens; return its id."""
        child = self.new_seq_id(request_id)
        self.manager.fork(parent, child)
        if self.with_tokens:
            self.history[child] = list(self.history[parent])
        return child

    def refork(self, old: int, parent: int, request_id: int, *, keep_history: bool) -> int:
        """Free ``old`` and fork ``parent`` into its place; return the new sequence's id.

        Args:
            old: the sequence to replace.
            parent: the sequence to fork.
            request_id: the owner of both.
            keep_history: the new sequence takes ``old``'s tokens (it will
                re-feed them) instead of a copy of ``parent``'s.
        """
        self.manager.free(old)
        child = self.new_seq_id(request_id)
        self.manager.fork(parent, child)
        if keep_history:
            self.forget(old, child)
        else:
            self.forget(old)
            if self.with_tokens:
                self.history[child] = list(self.history[parent])
        return child

    def tokens(self, seq_id: int, start: int, end: int) -> Any:
        """What to reserve for tokens ``start:end`` of a sequence: their ids, or a count."""
        if self.with_tokens:
            return self.history[seq_id][start:end]
        return end - start

    def begin_step(self) -> None:
        """Zero this step's work counters."""
        self.num_step_prefill_tokens = self.num_step_prefill_context = 0
        self.num_step_prefill_pairs = self.num_step_swapped_blocks = 0

    def feed(self, parts: dict[Hashable, Any], *, recomputed: bool = False) -> int:
        """Reserve and write ``parts`` as a prefill, counted in the result and this step's work.

        Returns:
            The tokens fed.

        Raises:
            PoolExhaustedError: the pool cannot hold them (nothing changed).
        """
        manager = self.manager
        starts = [(manager.num_tokens(seq_id), part if isinstance(part, int) else len(part))
                  for seq_id, part in parts.items()]
        batch = manager.reserve(parts)
        self.write(batch)
        num_tokens = batch.num_tokens
        self.result.num_prefill_tokens += num_tokens
        if recomputed:
            self.result.num_recomputed_tokens += num_tokens
        self.num_step_prefill_tokens += num_tokens
        for start, count in starts:
            # A chunk of ``count`` tokens after ``start`` reads all its context
            # and computes about count x (start + count / 2) attention pairs.
            self.num_step_prefill_context += start + count
            self.num_step_prefill_pairs += count * start + count * (count + 1) // 2
        return num_tokens

    def write(self, batch: Batch) -> None:
        """Write zeros for every token of a reservation (the manager requires the write)."""
        num_tokens = batch.num_tokens
        if len(self._kv) < num_tokens:
            self._kv = np.zeros((max(num_tokens, 2 * len(self._kv)), 1, 1), np.float32)
        kv = self._kv[:num_tokens]  # (num_tokens, 1, 1), a view
        self.manager.write(0, batch, kv, kv)
