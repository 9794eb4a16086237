"""Prefix keys on load: recompute every sequence's keys, and keep a block's key only if one vouches for it.

The checksum is no signature: a re-signed file could put tenant V's block
key on a block holding another tenant's keys and values, and V's next
identical prompt would hit it. So a load believes a key only when the rest
of the file implies it:

* every sequence with token ids must carry exactly the key chain its token
  ids and extra keys hash to (``block_keys`` recomputed from ``ROOT_KEY``);
  a sequence whose keys differ is refused;
* a block keeps its prefix key only when some running sequence holds it at
  logical block ``j`` and that sequence's key ``j`` is that key; a sequence
  whose recomputed key ``j`` differs is refused (the key names other
  contents than the block holds);
* a key that no sequence vouches for -- on a cached free block, which no
  sequence holds any more, or on a block held only by sequences without
  token ids -- is dropped: the block becomes a plain free (or plain used)
  block. That is always safe: only a cache hit is lost. Keys of sequences
  without token ids (added with ``cache_blocks=False``), which nothing can
  recompute, are dropped too: a swap-in would register them again.

``trust_cached_keys=True`` keeps the unvouched keys (a file you wrote
yourself and nobody else could change); contradictions are refused still.

    sequence v   token ids t0..t7, salt "v"   keys [k0, k1]   table [b3, b4]
    prefix keys  b3: k0  b4: k1   -> both vouched (v holds them at 0 and 1)
    forged       b9: k0           -> b9 is held by w at 0 with key w0 != k0: refused
    forged       b6: k0 (free)    -> nobody holds b6: dropped, v's prompt misses
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from pagedkv.blocks.table import BlockTable
from pagedkv.manager.sequence import RecordState, SequenceState
from pagedkv.prefix.cache import ROOT_KEY, block_keys, hash_function, token_bytes
from pagedkv.snapshot.schema import fail

__all__ = ["VouchedKeys", "vouch_keys"]


@dataclasses.dataclass(frozen=True, slots=True)
class VouchedKeys:
    """What a load keeps of the saved prefix keys.

    Attributes:
        keys: ``(block_id, key)`` kept, in the saved (insertion) order.
        unkeyed: blocks whose saved key was dropped.
        records: the records, those whose keys nothing can recompute cleared
            (unless trusted).
    """

    keys: list[tuple[int, bytes]]
    unkeyed: set[int]
    records: list[RecordState]


def vouch_keys(records: list[RecordState], tables: dict[Hashable, BlockTable], keys: list[tuple[int, bytes]],
               block_size: int, hash_algorithm: str, *, trust: bool) -> VouchedKeys:
    """Check every record's keys against its token ids, and each prefix key against the records.

    Args:
        records: every saved sequence record, validated otherwise.
        tables: each record's block table, by sequence id.
        keys: the saved ``(block_id, key)`` pairs of the device pool.
        block_size: the device pool's block size.
        hash_algorithm: the manager's block hash.
        trust: keep keys that no sequence vouches for.

    Raises:
        SnapshotError: a record's keys are not its token ids' chain, or a
            running sequence holds a keyed block whose key is not its own.
        ImportError: ``"xxh3_128"`` without the ``xxhash`` extra.
    """
    hasher = hash_function(hash_algorithm)
    checked: list[RecordState] = []
    claims: dict[int, list[tuple[bytes, Hashable, int, bool]]] = {}  # block -> (key, seq_id, j, recomputed)
    for record in records:
        recomputed = record.token_ids is not None
        if recomputed:
            assert record.token_ids is not None
            num_keyed = len(record.block_keys)
            tokens = record.token_ids[: num_keyed * block_size]
            if len(tokens) < num_keyed * block_size or record.block_keys != block_keys(
                ROOT_KEY, token_bytes(tokens), block_size, record.extras, hasher
            ):
                fail(f"sequence {record.seq_id!r}: its block keys are not the chain its token ids and "
                     "extra keys hash to (forged or damaged keys)")
        elif record.block_keys and not trust:
            record = dataclasses.replace(record, block_keys=[])
        checked.append(record)
        if record.state is not SequenceState.RUNNING:
            continue  # its blocks, if any, are on the host pool, which has no prefix keys
        table = tables[record.seq_id]
        for logical_block, key in enumerate(record.block_keys):
            if table.holds_block(logical_block):
                claims.setdefault(table.block_id(logical_block), []).append(
                    (key, record.seq_id, logical_block, recomputed))
    kept: list[tuple[int, bytes]] = []
    unkeyed: set[int] = set()
    for block_id, key in keys:
        found = claims.get(block_id, [])
        for own, seq_id, logical_block, recomputed in found:
            if recomputed and own != key:
                fail(f"block {block_id} has the prefix key {key.hex()[:16]}..., but sequence {seq_id!r} "
                     f"holds it as logical block {logical_block}, whose key is {own.hex()[:16]}... (a "
                     "key moved onto other contents)")
        if trust or any(own == key for own, *_ in found):
            kept.append((block_id, key))
        else:
            unkeyed.add(block_id)
    return VouchedKeys(kept, unkeyed, checked)
