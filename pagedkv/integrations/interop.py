"""Block tables in the forms GPU kernels read: FlashInfer's CSR and vLLM's slot mapping.

:func:`flashinfer_csr` exports a batch's pages as FlashInfer's ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` (int32), the arrays vLLM's FlashInfer backend builds; vLLM's other
kernels take one slot per new token, ``block_id * block_size + offset``, which
:attr:`pagedkv.Batch.slot_mapping` is. Both drawn in "Interop" in docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import numpy.typing as npt

from pagedkv.blocks.table import BlockTable
from pagedkv.errors import SequenceStateError, ShapeError
from pagedkv.manager.manager import KVCacheManager, SequenceState

__all__ = ["PagedCSR", "flashinfer_csr", "slot_mapping"]


@dataclass(frozen=True)
class PagedCSR:
    """A batch's block tables as FlashInfer's CSR arrays, all int32.

    Attributes:
        kv_indptr: ``(num_seqs + 1,)`` offsets into ``kv_indices``.
        kv_indices: block ids of every sequence, concatenated in order.
        kv_last_page_len: ``(num_seqs,)`` tokens in each last block, in
            ``1 .. block_size``.
        kv_first_page_offset: ``(num_seqs,)`` entries already evicted from
            each first block by a sliding window (0 without a window); pass
            the window to the kernel (FlashInfer's ``window_left``) so it
            skips them.
    """

    kv_indptr: npt.NDArray[np.int32]
    kv_indices: npt.NDArray[np.int32]
    kv_last_page_len: npt.NDArray[np.int32]
    kv_first_page_offset: npt.NDArray[np.int32]


def flashinfer_csr(manager: KVCacheManager, seq_ids: Sequence[Hashable]) -> PagedCSR:
    """Export the block tables of ``seq_ids`` as FlashInfer's paged-KV CSR arrays.

    No ids (the empty batch of ``reserve({})``) export as ``kv_indptr``
    ``[0]`` and empty int32 arrays.

    Raises:
        UnknownSequenceError: an id is not known.
        SequenceStateError: a sequence is not running or holds no tokens.
        AssertionError: a computed ``last_page_len`` is outside
            ``1 .. block_size`` (FlashInfer #320 accepted such values silently).

    Example:
        >>> from pagedkv import KVPool, KVCacheManager
        >>> manager = KVCacheManager(KVPool(8, block_size=4, head_dim=1))
        >>> manager.add_sequence("a"), manager.add_sequence("b")
        (0, 0)
        >>> batch = manager.reserve({"a": 6, "b": 3})
        >>> batch.slot_mapping.tolist()
        [0, 1, 2, 3, 4, 5, 8, 9, 10]
        >>> csr = flashinfer_csr(manager, ["a", "b"])
        >>> csr.kv_indptr.tolist(), csr.kv_indices.tolist(), csr.kv_last_page_len.tolist()
        ([0, 2, 3], [0, 1, 2], [2, 3])
    """
    block_size = manager.pool.block_size
    indptr = [0]
    indices: list[int] = []
    last_lens, first_offsets = [], []
    for seq_id in seq_ids:
        if manager.state(seq_id) is not SequenceState.RUNNING:
            raise SequenceStateError(f"sequence {seq_id!r} is {manager.state(seq_id).value}, not running")
        table = manager.block_table(seq_id)
        if table.num_live_tokens == 0:
            raise SequenceStateError(f"sequence {seq_id!r} holds no tokens; nothing to export")
        indices.extend(table.block_ids)
        indptr.append(len(indices))
        last_len = (table.num_tokens - 1) % block_size + 1
        if not 1 <= last_len <= block_size:
            raise AssertionError(f"last_page_len {last_len} outside 1..{block_size}")
        last_lens.append(last_len)
        plan = table.read_plan()  # a blocks plan starts at its offset; with sinks the offset is 0
        first_offsets.append(plan.offset if plan.slots is None else 0)
    return PagedCSR(
        kv_indptr=np.array(indptr, np.int32),
        kv_indices=np.array(indices, np.int32),
        kv_last_page_len=np.array(last_lens, np.int32),
        kv_first_page_offset=np.array(first_offsets, np.int32),
    )


def slot_mapping(
    block_ids: Sequence[int], positions: Sequence[int], block_size: int
) -> npt.NDArray[np.int64]:
    """vLLM's slot mapping for tokens at logical ``positions`` of one block table.

    ``block_ids`` is the table from logical block 0 (no evicted blocks).

    >>> slot_mapping([3, 7], [0, 5], 4).tolist()
    [12, 29]
    """
    num_slots = len(block_ids) * block_size
    bad = [
        p for p in positions if isinstance(p, bool) or not isinstance(p, Integral) or not 0 <= p < num_slots
    ]
    if bad:
        raise ShapeError(
            f"position {bad[0]!r} is not a logical index of this table (0 to {num_slots - 1}: "
            f"{len(block_ids)} blocks of {block_size})"
        )
    table = BlockTable.restored(block_size, 0, num_slots, 0, list(block_ids))
    slots = table.slot_array([(int(position), int(position) + 1) for position in positions])
    return slots.astype(np.int64)
