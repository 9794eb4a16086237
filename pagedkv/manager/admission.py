"""Admission: starting a sequence, and with prefix caching sharing its prompt's cached blocks.

``plan_admission`` looks before ``admit`` takes: it finds the same hit and
counts the same blocks, changing nothing (vLLM's ``get_computed_blocks`` and
``get_num_blocks_to_allocate``), so a scheduler can decide first.

The manager checks the new id and holds the pool's lock; ``admit`` validates
the rest first, then creates the record, so a bad prompt or extra key leaves
the manager unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable
from pagedkv.counts import ceil_div
from pagedkv.errors import InputTypeError
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.manager.sequence import SequenceRecord, SequenceRegistry
from pagedkv.prefix.cache import check_token_ids, pack_token_ids
from pagedkv.prefix.keys import ExtraKeys, encode_extra_keys

__all__ = ["AdmissionPlan", "admit", "plan_admission"]


def admit(
    seqs: SequenceRegistry,
    sharing: PrefixSharing | None,
    counters: dict[str, int],
    seq_id: Hashable,
    prompt: Sequence[int] | None,
    extra_keys: ExtraKeys | None,
    cache_blocks: bool,
    *,
    block_size: int,
    num_sink_tokens: int,
    num_layers: int,
) -> int:
    """Add a record for new ``seq_id`` to ``seqs``; return how many prompt tokens were cached.

    Raises:
        DuplicateSequenceError: ``seq_id`` is already known.
        InputTypeError, ConfigError: a bad id, token id, extra key or ``cache_blocks``.
    """
    seqs.check_new(seq_id)
    if not isinstance(cache_blocks, bool):
        raise InputTypeError(f"cache_blocks must be True or False, got {cache_blocks!r}")
    extras = encode_extra_keys(extra_keys)
    what = "prompt must be a sequence of token ids"
    token_ids, tokens = None, b""
    if prompt is not None and sharing is None:
        check_token_ids(prompt, what)  # validated all the same; without a prefix cache it is not kept
    elif prompt is not None:
        token_ids, tokens = pack_token_ids(prompt, what)
    # ---- validated: nothing below can fail ----
    record = SequenceRecord(seq_id, BlockTable(block_size, num_sink_tokens), num_layers)
    record.extras = extras
    seqs[seq_id] = record
    num_hit = 0
    if sharing is not None and token_ids is not None:
        counters["prefix_queries"] += len(token_ids)
        num_hit = sharing.share_cached_prefix(record, token_ids, tokens)
        counters["prefix_hits"] += num_hit
        sharing.stats.record(len(token_ids), num_hit)
    if not cache_blocks:
        record.stop_keying()
    return num_hit


class AdmissionPlan(NamedTuple):
    """What admitting a prompt would take, found without taking it (``KVCacheManager.lookup``).

    Attributes:
        num_cached_tokens: leading prompt tokens the prefix cache holds
            (what ``add_sequence`` would return).
        num_shared_blocks: cached blocks the new sequence would hold.
        revived_block_ids: those of them that wait in the cached free queue
            now: admitting takes them out of the free blocks.
        num_new_blocks: blocks one ``reserve`` of the rest of the prompt takes.
        num_free_blocks: the pool's free blocks now (plain and cached).
        fits: whether ``len(revived_block_ids) + num_new_blocks <= num_free_blocks``.
    """

    num_cached_tokens: int
    num_shared_blocks: int
    revived_block_ids: tuple[int, ...]
    num_new_blocks: int
    num_free_blocks: int
    fits: bool

    @property
    def num_blocks_taken(self) -> int:
        """Blocks leaving the free queues: the revived ones and the new ones."""
        return len(self.revived_block_ids) + self.num_new_blocks


def plan_admission(
    sharing: PrefixSharing | None,
    allocator: BlockAllocator,
    prompt: Sequence[int],
    extra_keys: ExtraKeys | None,
    block_size: int,
) -> AdmissionPlan:
    """``KVCacheManager.lookup``: the admission of ``prompt`` as ``add_sequence`` would do it; change nothing.

    Raises:
        InputTypeError, ConfigError: a bad token id or extra key.
    """
    extras = encode_extra_keys(extra_keys)
    what = "prompt must be a sequence of token ids"
    held: list[int] = []
    num_hit = 0
    if sharing is None:
        check_token_ids(prompt, what)
    else:
        token_ids, tokens = pack_token_ids(prompt, what)
        num_usable = max(0, (len(token_ids) - 1) // block_size)
        keys = sharing.prompt_keys([], tokens, num_usable, extras)
        num_hit, _, held = sharing.find_hit(keys)
    revived = tuple(block_id for block_id in held if allocator.ref_count(block_id) == 0)
    num_new = ceil_div(len(prompt), block_size) - num_hit
    num_free = allocator.num_free_blocks
    return AdmissionPlan(
        num_cached_tokens=num_hit * block_size,
        num_shared_blocks=len(held),
        revived_block_ids=revived,
        num_new_blocks=num_new,
        num_free_blocks=num_free,
        fits=len(revived) + num_new <= num_free,
    )
