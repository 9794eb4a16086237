"""Prefix keys on load: recompute every sequence's keys, and keep a block's key only if one vouches for it.

The checksum is no signature, so a load believes a block's prefix key only when a running
sequence holds the block at logical block ``j`` and that sequence's recomputed key ``j`` is
that key. A key nobody vouches for is dropped (only a cache hit is lost); a contradiction
refuses the file. ``trust_cached_keys=True`` keeps unvouched keys. The rules and a worked
example: "Prefix keys: what a load believes" in docs/snapshots.md.
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
