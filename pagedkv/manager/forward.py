"""One layer of a forward step: writing a batch's keys and values, and attending its queries.

The manager reserves once per step (:mod:`pagedkv.manager.reserve`); then, per
layer, :func:`write_layer` stores the new tokens' k/v at the batch's slots and
:func:`attend_layer` computes each new token's attention over its own
sequence. Both check the batch against the records first (only the very batch
``reserve`` returned, still reserved) and change nothing when they raise::

    batch = reserve(...)                 once per step
    write_layer(layer 0) -> attend_layer(layer 0) -> write_layer(layer 1) -> ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.counts import check_layer
from pagedkv.errors import ConfigError, SequenceStateError
from pagedkv.inputs import check_score_bound_from_max, check_token_pair, check_tokens
from pagedkv.manager.attend_fast import attend_one_sequence
from pagedkv.manager.batch import Batch, SlotRun, batch_records, issued_slots
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.manager.sequence import RUNNING, SequenceRegistry
from pagedkv.memory.pool import KVPool
from pagedkv.paged_attention import attend_batch, attend_sequence

__all__ = ["attend_layer", "write_layer"]


def write_layer(
    pool: KVPool,
    records: SequenceRegistry,
    sharing: PrefixSharing | None,
    max_abs_key: list[float],
    trusted_inputs: bool,
    layer: int,
    batch: Batch,
    keys: Any,
    values: Any,
    scan_index: npt.NDArray[np.intp],
) -> None:
    """Store one layer's k/v for every token of ``batch`` (the caller holds ``pool.lock``).

    Updates ``max_abs_key[layer]``, each record's written count, and (with
    ``sharing``) keys the blocks now full in every layer. ``scan_index``: the
    caller's scratch for the value scan (``check_token_pair``'s ``index``),
    used only under that lock.

    NOTE: a single-token batch (a decode) takes the first branch: the same
    checks as the general path below (the batch is the very one ``reserve``
    returned for a running record, the layer is in range and unwritten, k/v
    have the right type, dtype, shape and values), each made once, in the
    order that finds the common case fastest; anything unusual falls through
    to the general path, which raises what is wrong. The token's row is
    copied by its slot (one ``(num_kv_heads, head_dim)`` row per side
    of token-major pages). Each branch is tested against the other
    (tests/test_speed_write.py).

    Raises:
        LayerIndexError, InputTypeError: a bad ``layer``.
        SequenceStateError: the batch is stale, not the one ``reserve`` returned, or already written.
        ShapeError, InputTypeError, NonFiniteError: bad ``keys``/``values``.
    """
    token = batch.__dict__.get("_token") if batch.__class__ is Batch else None  # token_slot(batch)
    if token is not None and layer.__class__ is int and 0 <= layer < pool.num_layers:
        seq_id, position, slot, _ = token
        record = records.get(seq_id)
        if (
            record is not None
            and record.batch is batch
            and record.state is RUNNING
            and record.num_written[layer] == position
        ):
            key_row, value_row, largest_key = check_token_pair(  # flat rows, as write_token takes them
                keys, values, pool.dtype, pool.token_shape, not trusted_inputs, scan_index, True
            )
            # ---- validated ----
            pool.write_token(layer, slot, key_row, value_row)
            if largest_key > max_abs_key[layer]:
                max_abs_key[layer] = largest_key
            end = record.num_written[layer] = position + 1
            if sharing is not None and end // pool.block_size > len(record.block_keys):
                sharing.key_full_blocks(record)
            return
    if layer.__class__ is not int or not 0 <= layer < pool.num_layers:
        check_layer(layer, pool.num_layers)
    seqs = batch_records(records, batch)
    first_positions, counts = batch.first_positions, batch.num_new_tokens
    for seq, start in zip(seqs, first_positions):
        if seq.num_written[layer] != start:
            raise SequenceStateError(
                f"layer {layer} of sequence {seq.seq_id!r} is already written for this batch"
            )
    expected = (counts[0] if len(counts) == 1 else sum(counts), pool.num_kv_heads, pool.head_dim)
    key_array, value_array, largest_key = check_token_pair(
        keys, values, pool.dtype, expected, not trusted_inputs, scan_index
    )
    # ---- validated ----
    pieces = issued_slots(batch)
    slot = pieces[0]
    if expected[0] == 1 and isinstance(slot, int):  # one token: copied by its slot
        pool.write_token(layer, slot, key_array.ravel(), value_array.ravel())
    elif len(pieces) == 1 and isinstance(slot, SlotRun) and not pool.quantized:  # a prefill: by blocks
        pool.write_run(layer, slot.block_ids, slot.offset, key_array, value_array)
    else:
        pool.write(layer, batch.slot_mapping, key_array, value_array)
    if largest_key > max_abs_key[layer]:
        max_abs_key[layer] = largest_key
    # Settle: the layer holds the batch's tokens; blocks full in every layer get keys.
    for seq, start, num_new in zip(seqs, first_positions, counts):
        end = seq.num_written[layer] = start + num_new
        # A block can only get its key once some layer's count crosses its end.
        if sharing is not None and end // pool.block_size > len(seq.block_keys):
            sharing.key_full_blocks(seq)


def attend_layer(
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
    trusted: bool = False,
) -> npt.NDArray[Any]:
    """Attention of every new token of ``batch`` over its own sequence, in layer ``layer``.

    ``trusted`` (``KVCacheManager(trusted_inputs=True)``) skips scanning the
    query values and the score bound; every other check stays.

    Raises:
        LayerIndexError, SequenceStateError, ShapeError, InputTypeError,
        NonFiniteError, ConfigError: bad arguments, or the layer is not written; nothing changes.
    """
    # One sequence as reserve() returned it (every decode of one request): checked in one pass.
    out = attend_one_sequence(
        pool, records, max_abs_key, scale, num_q_heads, windows, layer, batch, queries, method, not trusted
    )
    if out is not None:
        return out
    check_layer(layer, pool.num_layers)
    if method not in ("loop", "padded"):
        raise ConfigError(f"method must be 'loop' or 'padded', got {method!r}")
    seqs = batch_records(records, batch)
    for seq in seqs:
        if seq.num_written[layer] != seq.table.num_tokens:
            raise SequenceStateError(
                f"sequence {seq.seq_id!r} has no k/v written in layer {layer} for this batch; "
                "call write() first"
            )
    expected = (batch.num_tokens, num_q_heads, pool.head_dim)
    query_array, largest_query = check_tokens("queries", queries, pool.dtype, expected, not trusted)
    if not trusted:
        check_score_bound_from_max(scale, query_array, largest_query, max_abs_key[layer], pool.dtype)
    if len(seqs) == 1:  # one sequence: its attention is the whole output (no offsets, no copy)
        return attend_sequence(pool, layer, seqs[0].table, windows[layer], query_array, scale)
    tables = [seq.table for seq in seqs]
    return attend_batch(pool, layer, tables, batch.query_start, windows[layer], query_array, scale, method)
