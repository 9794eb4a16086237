"""Admission: starting a sequence, and with prefix caching sharing its prompt's cached blocks.

The manager checks the new id and holds the pool's lock; ``admit`` validates
the rest first, then creates the record, so a bad prompt or extra key leaves
the manager unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from pagedkv.block_table import BlockTable
from pagedkv.errors import InputTypeError
from pagedkv.prefix_cache import check_token_ids, encode_extra_keys, pack_token_ids
from pagedkv.prefix_sharing import PrefixSharing
from pagedkv.sequence import SequenceRecord, SequenceRegistry

__all__ = ["admit"]


def admit(
    seqs: SequenceRegistry,
    sharing: PrefixSharing | None,
    counters: dict[str, int],
    seq_id: Hashable,
    prompt: Sequence[int] | None,
    extra_keys: Mapping[str, str | bytes | int] | None,
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
    if not cache_blocks:
        record.stop_keying()
    return num_hit
