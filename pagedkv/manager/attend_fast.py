"""``attend``'s fast path: a batch of one sequence (every decode step of one request), checked once.

``KVCacheManager.attend`` runs once per layer per step, so whatever it does
beyond the kernel is paid ``num_layers`` times a token. For the common case,
a batch of one sequence as ``reserve`` returned it and a plain query array of
the pool's dtype, :func:`attend_one_sequence` makes the general path's checks
in one pass, the cheapest first, and calls the same kernel on the same
arrays; anything else returns None and the general path
(:func:`pagedkv.manager.forward.attend_layer`) decides, raising what is wrong::

    attend(layer, batch, q)
      fast: one sequence, its very batch, the layer written  -> check q, attend_sequence
      else: None -> the general path: check_layer, batch_records, check_tokens, ... -> raises or attends

The score bound (:func:`~pagedkv.inputs.check_score_bound`, the one rule)
scans the queries once more; :func:`~pagedkv.inputs.check_score_bound_from_max` first tries
the bound the query scan has already paid for (``head_dim * max|q|``), which
is never below the exact one, and runs the exact rule only when that cheap
bound is too large. So the queries refused are exactly those the rule refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from pagedkv.inputs import check_score_bound_from_max, check_tokens
from pagedkv.manager.batch import Batch
from pagedkv.manager.sequence import RUNNING, SequenceRegistry
from pagedkv.memory.pool import KVPool
from pagedkv.paged_attention import attend_sequence

__all__ = ["attend_one_sequence"]


def attend_one_sequence(
    pool: KVPool,
    records: SequenceRegistry,
    max_abs_key: list[float],
    scale: float,
    num_q_heads: int,
    windows: Sequence[int | None],
    layer: int,
    batch: Batch,
    queries: Any,
    method: str,
    scan: bool = True,
) -> npt.NDArray[Any] | None:
    """``attend_layer`` for a batch of one sequence, or None when the general path must decide.

    Takes ``attend_layer``'s arguments. Returns its result when every check
    of the general path passes on the common case: ``batch`` is the very
    object ``reserve`` returned for one running sequence, ``layer`` an int
    in range whose k/v are written and ``method`` known; the general path
    would then make the same checks and pass them. The queries are checked
    as the general path checks them, by the same functions, so they raise
    its errors. Anything else returns None (nothing changes), and the
    general path raises what is wrong.

    ``scan=False`` skips scanning the query values and the score bound
    (``check_tokens(..., scan=False)``; type, dtype and shape are checked
    either way): what a ``trusted_inputs`` manager passes.

    >>> import numpy as np
    >>> from pagedkv import KVCacheManager
    >>> manager = KVCacheManager(KVPool(4, block_size=2, head_dim=1))
    >>> manager.add_sequence("s")
    0
    >>> batch = manager.reserve({"s": 1})
    >>> manager.write(0, batch, np.ones((1, 1, 1)), np.full((1, 1, 1), 7.0))
    >>> attend_one_sequence(manager.pool, manager._seqs, [1.0], 1.0, 1, [None], 0, batch,
    ...                     np.ones((1, 1, 1)), "loop").tolist()
    [[[7.0]]]
    """
    if (
        batch.__class__ is not Batch
        or layer.__class__ is not int
        or not 0 <= layer < pool.num_layers
        or (method != "loop" and method != "padded")
    ):
        return None
    seq_ids = batch.seq_ids
    if len(seq_ids) != 1:
        return None
    record = records.get(seq_ids[0])
    if record is None or record.batch is not batch or record.state is not RUNNING:
        return None
    table = record.table
    if record.num_written[layer] != table.num_tokens:
        return None
    dtype = pool.dtype
    expected = (batch.num_new_tokens[0], num_q_heads, pool.head_dim)
    query_array, largest = check_tokens("queries", queries, dtype, expected, scan)
    if scan:
        check_score_bound_from_max(scale, query_array, largest, max_abs_key[layer], dtype)
    return attend_sequence(pool, layer, table, windows[layer], query_array, scale)
