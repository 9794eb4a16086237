"""Batch rows of a transformers cache, each one sequence of a :class:`~pagedkv.KVCacheManager`.

transformers addresses a cache by batch row, the manager by ``seq_id``: beam search's
row renumbering is ``fork`` and ``free`` here, so beams share their parent's blocks
(vLLM: beam search's forked sequences). A row's pads are its left-padding columns.
docs/integrations.md ("Rows, beams and crop") draws an example.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

from pagedkv.errors import ConfigError, SequenceStateError
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.manager.manager import KVCacheManager

__all__ = ["RowSequences"]

_CACHE_TAGS = itertools.count()


class RowSequences:
    """The sequences behind a batch's rows, with each row's left-padding count.

    Invariants:
        * every row's ``seq_id`` is a distinct running sequence of ``manager``;
        * ``num_pads`` has one entry per row, each ``>= 0``.

    >>> from pagedkv import KVPool, KVCacheManager
    >>> rows = RowSequences(KVCacheManager(KVPool(8, block_size=2, head_dim=1)))
    >>> rows.start(2)
    >>> rows.num_rows, rows.manager.num_tokens(rows.seq_ids[1])
    (2, 0)
    """

    def __init__(self, manager: KVCacheManager | HybridKVCacheManager) -> None:
        self.manager = manager
        #: The sequence of each row, in row order.
        self.seq_ids: list[Hashable] = []
        #: Left-padding columns of each row (never stored by pagedkv attention).
        self.num_pads: list[int] = []
        # NOTE: ids carry a per-cache tag so several caches can share one manager.
        self._tag = next(_CACHE_TAGS)
        self._serial = itertools.count()

    @property
    def num_rows(self) -> int:
        """Rows (sequences) held."""
        return len(self.seq_ids)

    def num_tokens(self, row: int) -> int:
        """Tokens the row's sequence holds, evicted ones included."""
        return self.manager.num_tokens(self.seq_ids[row])

    def start(self, num_rows: int) -> None:
        """Start ``num_rows`` empty sequences (the cache held none)."""
        if self.seq_ids:
            raise SequenceStateError(f"{self.num_rows} rows are running; clear() them before starting anew")
        for _ in range(num_rows):
            seq_id = self._new_id()
            self.manager.add_sequence(seq_id)
            self.seq_ids.append(seq_id)
            self.num_pads.append(0)

    def select(self, sources: Sequence[int]) -> None:
        """Make row ``i`` a copy of old row ``sources[i]``: forks share blocks, old rows are freed.

        Raises:
            ConfigError: a source is not a row.
        """
        bad = [source for source in sources if not 0 <= source < self.num_rows]
        if bad:
            raise ConfigError(f"row {bad[0]} does not exist; the cache holds rows 0 .. {self.num_rows - 1}")
        new_ids: list[Hashable] = [self._new_id() for _ in sources]
        for source, child in zip(sources, new_ids):
            self.manager.fork(self.seq_ids[source], child)
        for seq_id in self.seq_ids:
            self.manager.free(seq_id)
        self.num_pads = [self.num_pads[source] for source in sources]
        self.seq_ids = new_ids

    def truncate(self, num_tokens: Sequence[int]) -> None:
        """Keep the first ``num_tokens[row]`` tokens of each row, all rows or none.

        Every row is checked (``check_truncate``: the next token must still see
        every token of its window, in every KV-cache group) before any is cut.

        Raises:
            SequenceStateError: some row would need tokens its window already evicted.
        """
        manager = self.manager
        for seq_id, keep in zip(self.seq_ids, num_tokens):
            try:
                manager.check_truncate(seq_id, keep)
            except SequenceStateError as error:
                raise SequenceStateError(
                    f"cannot crop sequence {seq_id!r} to {keep} tokens: its window already evicted "
                    f"tokens the next one needs ({error})"
                ) from error
        for seq_id, keep in zip(self.seq_ids, num_tokens):
            manager.truncate(seq_id, keep)

    def clear(self) -> None:
        """Free every row's sequence."""
        for seq_id in self.seq_ids:
            self.manager.free(seq_id)
        self.seq_ids, self.num_pads = [], []

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if len(set(self.seq_ids)) != len(self.seq_ids) or len(self.num_pads) != len(self.seq_ids):
            raise AssertionError(f"rows {self.seq_ids} with pads {self.num_pads}")
        if any(pads < 0 for pads in self.num_pads):
            raise AssertionError(f"negative pads {self.num_pads}")
        for seq_id in self.seq_ids:
            if seq_id not in self.manager:
                raise AssertionError(f"row sequence {seq_id!r} is not in the manager")

    def _new_id(self) -> tuple[str, int, int]:
        return ("hf", self._tag, next(self._serial))
