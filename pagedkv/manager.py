"""``KVCacheManager``: many sequences and many layers on one shared pool.

The flow of one forward step, as in an inference engine::

    batch = manager.reserve({"a": 5, "b": 1})   # slots for new tokens, all or nothing
    for layer in range(num_layers):
        manager.write(layer, batch, k, v)        # k, v: (batch.num_tokens, num_kv_heads, head_dim)
        out = manager.attend(layer, batch, q)    # q: (batch.num_tokens, num_q_heads, head_dim)

One block table per sequence serves every layer: block ``b`` of layer ``l``
lives at ``pool.keys(l)[:, b]``, so reserving once per step is enough.

>>> import numpy as np
>>> from pagedkv import KVPool, KVCacheManager
>>> manager = KVCacheManager(KVPool(8, block_size=4, head_dim=2))
>>> manager.add_sequence("a")  # returns how many prompt tokens were cached
0
>>> batch = manager.reserve({"a": 3})
>>> kv = np.ones((3, 1, 2))
>>> manager.write(0, batch, kv, kv)
>>> manager.attend(0, batch, np.ones((3, 1, 2))).shape
(3, 1, 2)
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.batch import Batch
from pagedkv.block_table import BlockTable
from pagedkv.counts import check_count, check_max_size
from pagedkv.errors import (
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    LayerIndexError,
    PoolExhaustedError,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
)
from pagedkv.inputs import as_vectors, check_scale, check_score_bound
from pagedkv.metrics import ManagerMetrics, collect_metrics
from pagedkv.paged_attention import attend_decode_padded, attend_sequence
from pagedkv.pool import KVPool
from pagedkv.prefix_cache import PrefixCache, encode_extra_keys, hash_function, token_bytes
from pagedkv.prefix_sharing import PrefixSharing
from pagedkv.reservation import Request, Requests, ReservationPlan, parse_requests, plan_reservation
from pagedkv.sequence import RecordState, SequenceHolder, SequenceRecord, SequenceState
from pagedkv.swap import check_host_pool, swap_in, swap_out

__all__ = ["KVCacheManager", "ManagerState", "SequenceState"]

# NOTE: one counter for every manager, so a Batch from another manager never
# matches a stamp here (per-manager counters both start at 1).
_RESERVATION_IDS = itertools.count(1)

#: The event counters every manager keeps (and a snapshot saves).
COUNTERS = (
    "forks",
    "copy_on_write",
    "preemptions",
    "swaps_out",
    "swaps_in",
    "prefix_queries",
    "prefix_hits",
    "resumed_reuse",
)


class ManagerState:
    """A manager's state beyond its configuration and pools (what a snapshot saves).

    Attributes:
        max_abs_key: the largest |key| written so far, per layer.
        counters: the event counters (``COUNTERS``).
        records: every sequence's record, in the order they were added.
        prefix_keys: ``(block_id, key)`` of every prefix key in insertion order
            (empty without prefix caching).
        num_prefix_evictions: prefix keys dropped for reuse so far.
    """

    __slots__ = ("counters", "max_abs_key", "num_prefix_evictions", "prefix_keys", "records")

    def __init__(
        self,
        max_abs_key: list[float],
        counters: dict[str, int],
        records: list[RecordState],
        prefix_keys: list[tuple[int, bytes]],
        num_prefix_evictions: int,
    ) -> None:
        self.max_abs_key = max_abs_key
        self.counters = counters
        self.records = records
        self.prefix_keys = prefix_keys
        self.num_prefix_evictions = num_prefix_evictions


class KVCacheManager:
    """Block tables for many sequences over one :class:`~pagedkv.KVPool`.

    Invariants:
        * the pool's invariants hold, counting every running sequence's table
          (and, for the host pool, every swapped sequence's table);
        * no block id appears twice in one table;
        * a preempted sequence holds no blocks;
        * with a window ``W`` (the largest over layers), a sequence holds no
          block wholly older than its newest reservation's window;
        * every layer's written count is at most the table's token count.

    Args:
        pool: the device pool; its ``num_layers``, ``num_kv_heads``,
            ``head_dim`` and ``dtype`` define the model.
        max_size: the sliding window ``W`` of every layer: each token attends
            to the ``W`` newest tokens, itself included (plus the sinks).
        layer_max_sizes: a window per layer instead (``None`` entries mean
            unbounded), as Mistral allows; blocks are freed by the largest.
        num_sink_tokens: the first tokens of each sequence, kept forever and
            attended by every token (StreamingLLM's attention sinks). Keys are
            stored as given: positional encoding is the caller's.
        num_q_heads: query heads (a multiple of ``num_kv_heads``); defaults
            to ``num_kv_heads``.
        scale: multiplies every score.
        host_pool: a second pool, shaped like ``pool``, for swap preemption.
        enable_prefix_caching: key full blocks by their prefix and share them
            between sequences (see :mod:`pagedkv.prefix_cache`).
        hash_algorithm: ``"sha256"`` (default, collision resistant) or
            ``"xxh3_128"`` (faster, the ``xxhash`` extra, trusted prompts only).

    Raises:
        ConfigError, InputTypeError: an argument has the wrong type or value.
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        max_size: int | None = None,
        layer_max_sizes: Sequence[int | None] | None = None,
        num_sink_tokens: int = 0,
        num_q_heads: int | None = None,
        scale: float = 1.0,
        host_pool: KVPool | None = None,
        enable_prefix_caching: bool = False,
        hash_algorithm: str = "sha256",
    ) -> None:
        if not isinstance(pool, KVPool):
            raise InputTypeError(f"pool must be a KVPool, got {type(pool).__name__}")
        if pool.growable:
            raise ConfigError("a manager needs a fixed pool; create KVPool(..., growable=False)")
        self.pool = pool
        window = check_max_size(max_size)
        if layer_max_sizes is not None:
            if window is not None:
                raise ConfigError("give max_size or layer_max_sizes, not both")
            windows = [check_max_size(w) for w in layer_max_sizes]
            if len(windows) != pool.num_layers:
                raise ConfigError(
                    f"layer_max_sizes has {len(windows)} entries, the pool has {pool.num_layers} layers"
                )
        else:
            windows = [window] * pool.num_layers
        self.layer_max_sizes: tuple[int | None, ...] = tuple(windows)
        #: The window that frees blocks: the largest layer window, None if any is unbounded.
        self.max_size: int | None = (
            None if any(w is None for w in windows) else max(w for w in windows if w is not None)
        )
        self.num_sink_tokens = check_count("num_sink_tokens", num_sink_tokens, minimum=0)
        self.num_q_heads = (
            pool.num_kv_heads if num_q_heads is None else check_count("num_q_heads", num_q_heads)
        )
        if self.num_q_heads % pool.num_kv_heads:
            raise ConfigError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={pool.num_kv_heads}"
            )
        self.scale = check_scale(scale)
        self.host_pool = None if host_pool is None else check_host_pool(pool, host_pool)
        self._seqs: dict[Hashable, SequenceRecord] = {}
        self._max_abs_key = [0.0] * pool.num_layers
        self._counters = dict.fromkeys(COUNTERS, 0)
        hash_function(hash_algorithm)  # validated even with prefix caching off: snapshots save it
        #: The block hash's name (kept for snapshots).
        self.hash_algorithm = hash_algorithm
        self._sharing: PrefixSharing | None = None
        if enable_prefix_caching:
            self._sharing = PrefixSharing(
                pool.allocator,
                block_size=pool.block_size,
                num_sink_tokens=self.num_sink_tokens,
                max_size=self.max_size,
                num_layers=pool.num_layers,
                hash_algorithm=hash_algorithm,
            )
        # The pools hold these weakly; the manager keeps them alive.
        self._holders = [
            SequenceHolder(self._seqs, SequenceState.RUNNING),
            SequenceHolder(self._seqs, SequenceState.SWAPPED),
        ]
        pool.attach(self._holders[0])
        if host_pool is not None:
            host_pool.attach(self._holders[1])

    # ---------------------------------------------------------------- queries

    @property
    def seq_ids(self) -> list[Hashable]:
        """Every known sequence id, in the order they were added."""
        return list(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    @property
    def prefix_caching(self) -> bool:
        """Whether this manager runs prefix caching (``enable_prefix_caching``)."""
        return self._sharing is not None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The key -> block map of prefix caching (read it; do not change it), or None when off."""
        return self._sharing.cache if self._sharing is not None else None

    def state(self, seq_id: Hashable) -> SequenceState:
        """Where ``seq_id``'s blocks are."""
        return self._get(seq_id).state

    def block_table(self, seq_id: Hashable) -> BlockTable:
        """``seq_id``'s block table (read it; do not change it)."""
        return self._get(seq_id).table

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens reserved for ``seq_id`` so far, evicted ones included."""
        return self._get(seq_id).table.num_tokens

    def plan(self, requests: Requests) -> ReservationPlan:
        """What ``reserve(requests)`` would take and free, without doing it.

        Raises:
            UnknownSequenceError, DuplicateSequenceError, ConfigError,
            SequenceStateError: as ``reserve`` would.
        """
        requests_list = parse_requests(requests)
        return self._plan(requests_list, self._request_records(requests_list))

    def can_reserve(self, requests: Requests) -> bool:
        """Whether ``reserve(requests)`` would succeed now."""
        return self.plan(requests).fits

    # --------------------------------------------------------------- commands

    def add_sequence(
        self,
        seq_id: Hashable,
        prompt: Sequence[int] | None = None,
        *,
        extra_keys: Mapping[str, str | bytes | int] | None = None,
        cache_blocks: bool = True,
    ) -> int:
        """Start a sequence; with prefix caching, share the cached blocks of its prompt.

        Args:
            seq_id: a new, hashable id.
            prompt: the prompt's token ids, looked up in the prefix cache.
                The sequence starts empty; reserve and write the prompt (from
                the returned position on) as usual.
            extra_keys: tagged keys hashed into every block key:
                ``{"salt": tenant, "adapter": id, "multimodal": hash}``.
                Sequences with different extra keys never share a block.
            cache_blocks: with prefix caching, key this sequence's full blocks
                so later prompts can share them; its reservations must then
                give token ids. ``False`` lets it reserve by count, and its
                blocks are never keyed (the prompt is still looked up).

        Returns:
            How many leading prompt tokens are already cached (a multiple of
            ``block_size``, never the whole prompt: at least its last token is
            left to compute). The caller writes k/v only for the rest.

        Raises:
            DuplicateSequenceError: ``seq_id`` is already known.
            InputTypeError, ConfigError: a bad id, token id or extra key.
        """
        self._check_new_id(seq_id)
        if not isinstance(cache_blocks, bool):
            raise InputTypeError(f"cache_blocks must be True or False, got {cache_blocks!r}")
        extras = encode_extra_keys(extra_keys)
        token_ids = None if prompt is None else _prompt_ids(prompt)
        tokens = token_bytes(token_ids) if token_ids is not None else b""
        record = SequenceRecord(
            seq_id, BlockTable(self.pool.block_size, self.num_sink_tokens), self.pool.num_layers
        )
        record.extras = extras
        self._seqs[seq_id] = record
        num_hit = 0
        if self._sharing is not None and token_ids is not None:
            self._counters["prefix_queries"] += len(token_ids)
            num_hit = self._sharing.share_cached_prefix(record, token_ids, tokens)
            self._counters["prefix_hits"] += num_hit
        if not cache_blocks:
            record.token_ids = None
        return num_hit

    def reset_prefix_cache(self) -> None:
        """Drop every block key; refused while any block is in use.

        Raises:
            ConfigError: prefix caching is off.
            SequenceStateError: blocks are in use (free every sequence first).
        """
        if self._sharing is None:
            raise ConfigError("prefix caching is off for this manager")
        if self.pool.num_used_blocks:
            raise SequenceStateError(
                f"{self.pool.num_used_blocks} blocks are in use; free every sequence before a reset"
            )
        self._sharing.cache.reset()

    def reserve(self, requests: Requests) -> Batch:
        """Reserve slots for new tokens of several sequences, all or nothing.

        First every block wholly outside each sequence's window (for its first
        new token) goes back to the pool; then shared, partly filled last
        blocks are copied (copy-on-write); then new blocks are taken.

        Args:
            requests: ``{seq_id: num_new_tokens}`` (or ``(seq_id, n)`` pairs),
                each ``n >= 1``; a sequence may appear once. With prefix
                caching give the new tokens' ids instead of a count
                (``{seq_id: [17, 4, 99]}``) so full blocks get keys; a count
                stops keying that sequence's later blocks.

        Returns:
            The :class:`~pagedkv.batch.Batch` to write and attend, every layer.

        Raises:
            UnknownSequenceError: an id is not known.
            DuplicateSequenceError: an id appears twice.
            ConfigError, InputTypeError: a count is not an int >= 1.
            SequenceStateError: a sequence is preempted or swapped, or has
                reserved tokens some layer has not written yet.
            PoolExhaustedError: the pool cannot hold it; nothing changes.
        """
        requests_list = parse_requests(requests)
        records = self._request_records(requests_list)
        plan = self._plan(requests_list, records)
        if not plan.fits:
            raise PoolExhaustedError(
                plan.num_new_blocks,
                plan.num_free_blocks + plan.num_released_blocks,
                self.pool.num_blocks,
                "free or preempt a sequence, reserve fewer tokens, or give the pool more blocks",
            )
        # ---- validated: nothing below can fail ----
        allocator = self.pool.allocator
        bs = self.pool.block_size
        slots: list[int] = []
        first_positions, stamps = [], []
        if self.max_size is not None:
            # Every eviction first: the plan counts a later sequence's released
            # blocks as available to an earlier sequence's new blocks.
            for record, step in zip(records, plan.steps):
                if step.window_start > record.table.window_start:
                    released = record.table.evict_to(step.window_start)
                    if released:
                        allocator.free(released)
        for record, request, step in zip(records, requests_list, plan.steps):
            if record.token_ids is not None and request.token_ids is not None:
                record.token_ids.extend(request.token_ids)
            table = record.table
            if step.copy_on_write:
                copy = allocator.allocate_one()
                self.pool.copy_blocks([table.last_block_id], [copy])
                allocator.free_one(table.replace_last(copy))
                self._counters["copy_on_write"] += 1
            start = table.num_tokens
            num_new = request.num_new_tokens
            table.append(num_new, allocator.allocate(step.num_new_blocks) if step.num_new_blocks else [])
            first_positions.append(start)
            if num_new == 1:
                slots.append(table.last_block_id * bs + start % bs)
            else:
                slots.extend(table.slots(start, start + num_new))
            record.reservation_id = stamp = next(_RESERVATION_IDS)
            stamps.append(stamp)
        counts = [request.num_new_tokens for request in requests_list]
        return Batch(
            seq_ids=tuple(request.seq_id for request in requests_list),
            num_new_tokens=tuple(counts),
            first_positions=tuple(first_positions),
            query_start=np.array([0, *accumulate(counts)], np.int64),
            slot_mapping=np.array(slots, np.int64),
            reservation_ids=tuple(stamps),
        )

    def write(self, layer: int, batch: Batch, keys: Any, values: Any) -> None:
        """Store one layer's k/v for every token of ``batch``.

        Args:
            layer: the layer index.
            batch: from ``reserve``.
            keys: ``(batch.num_tokens, num_kv_heads, head_dim)``.
            values: same shape.

        Raises:
            LayerIndexError: ``layer`` is out of range.
            SequenceStateError: the batch is stale, or this layer was written.
            ShapeError, InputTypeError, NonFiniteError: bad ``keys``/``values``.
        """
        self._check_layer(layer)
        seqs = self._batch_seqs(batch)
        for seq, start in zip(seqs, batch.first_positions):
            if seq.num_written[layer] != start:
                raise SequenceStateError(
                    f"layer {layer} of sequence {seq.seq_id!r} is already written for this batch"
                )
        pool = self.pool
        expected = (batch.num_tokens, pool.num_kv_heads, pool.head_dim)
        key_array = self._tokens("keys", keys, expected)
        value_array = self._tokens("values", values, expected)
        # ---- validated ----
        pool.write(layer, batch.slot_mapping, key_array, value_array)
        self._max_abs_key[layer] = max(self._max_abs_key[layer], float(np.abs(key_array).max()))
        for seq, start, num_new in zip(seqs, batch.first_positions, batch.num_new_tokens):
            seq.num_written[layer] = start + num_new
            if self._sharing is not None:
                self._sharing.key_full_blocks(seq)

    def attend(self, layer: int, batch: Batch, queries: Any, *, method: str = "loop") -> npt.NDArray[Any]:
        """Attention of every new token of ``batch`` over its own sequence, in one call.

        Token at logical index ``p`` of a sequence attends to indices
        ``max(sinks, p - W + 1) .. p`` of that sequence (``W`` the layer's
        window) and to its sink tokens.

        Args:
            layer: the layer index; ``write`` must have stored this batch in it.
            batch: from ``reserve``.
            queries: ``(batch.num_tokens, num_q_heads, head_dim)``.
            method: ``"loop"`` (one kernel call per sequence; the default,
                measured faster, see ``benchmarks/bench_manager.py``) or
                ``"padded"`` (one vectorized call for a batch of single-token
                decodes, padded to the longest; equal within tolerance).

        Returns:
            A new ``(batch.num_tokens, num_q_heads, head_dim)`` array.

        Raises:
            LayerIndexError, SequenceStateError, ShapeError, InputTypeError,
            NonFiniteError, ConfigError: bad arguments; nothing changes.
        """
        self._check_layer(layer)
        if method not in ("loop", "padded"):
            raise ConfigError(f"method must be 'loop' or 'padded', got {method!r}")
        seqs = self._batch_seqs(batch)
        for seq in seqs:
            if seq.num_written[layer] != seq.table.num_tokens:
                raise SequenceStateError(
                    f"sequence {seq.seq_id!r} has no k/v written in layer {layer} for this batch; "
                    "call write() first"
                )
        expected = (batch.num_tokens, self.num_q_heads, self.pool.head_dim)
        query_array = self._tokens("queries", queries, expected)
        check_score_bound(self.scale, query_array, self._max_abs_key[layer], self.pool.dtype)
        window = self.layer_max_sizes[layer]
        if method == "padded" and all(n == 1 for n in batch.num_new_tokens):
            tables = [seq.table for seq in seqs]
            return attend_decode_padded(self.pool, layer, tables, window, query_array, self.scale)
        out = np.empty_like(query_array)
        for seq, lo, hi in zip(seqs, batch.query_start[:-1], batch.query_start[1:]):
            out[lo:hi] = attend_sequence(self.pool, layer, seq.table, window, query_array[lo:hi], self.scale)
        return out

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start ``child`` as a copy of ``parent`` that shares every block (no copy).

        The first append to a shared, partly filled block copies it first
        (copy-on-write), so neither sequence ever sees the other's later tokens.

        Raises:
            UnknownSequenceError: ``parent`` is not known.
            DuplicateSequenceError: ``child`` is already known.
            SequenceStateError: ``parent`` is not running or has unwritten layers.
        """
        seq = self._get(parent)
        self._check_new_id(child)
        self._check_settled(seq, "fork")
        twin = seq.fork(child)
        self.pool.allocator.share(seq.table.block_ids)
        self._seqs[child] = twin
        self._counters["forks"] += 1

    def cancel_reservation(self, seq_id: Hashable) -> None:
        """Take back ``seq_id``'s reserved tokens that some layer has not written.

        The sequence returns to the tokens every layer has written (its last
        batch becomes stale); blocks that then hold nothing go back to the
        pool. Use it when a step is abandoned half-way, for instance after
        another sequence of the same batch was freed or preempted.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            SequenceStateError: it is not running.
        """
        seq = self._get(seq_id)
        if seq.state is not SequenceState.RUNNING:
            raise SequenceStateError(f"sequence {seq_id!r} is {seq.state.value}, not running")
        keep = min(seq.num_written)
        if keep == seq.table.num_tokens:
            return
        released = seq.table.truncate(keep)
        if released:
            self.pool.allocator.free(released)
        seq.num_written = [keep] * self.pool.num_layers
        if seq.token_ids is not None:
            del seq.token_ids[keep:]
        seq.reservation_id = 0

    def free(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` and give its blocks back, tail first.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known (or already freed).
        """
        seq = self._get(seq_id)
        self._release(seq)
        del self._seqs[seq_id]

    def preempt(self, seq_id: Hashable, mode: str = "recompute") -> None:
        """Take a running sequence's blocks away; ``resume`` brings it back.

        Args:
            seq_id: a running sequence.
            mode: ``"recompute"`` frees its blocks and forgets its tokens (the
                caller re-feeds them after ``resume``); ``"swap"`` copies its
                blocks to the host pool first, and ``resume`` restores them.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            SequenceStateError: it is not running, or (swap) has unwritten layers.
            ConfigError: swap without a host pool, or an unknown mode.
            PoolExhaustedError: (swap) the host pool is full; nothing changes.
        """
        seq = self._get(seq_id)
        if mode not in ("recompute", "swap"):
            raise ConfigError(f"mode must be 'recompute' or 'swap', got {mode!r}")
        if seq.state is not SequenceState.RUNNING:
            raise SequenceStateError(f"sequence {seq_id!r} is {seq.state.value}, not running")
        if mode == "recompute":
            self._release(seq)
            seq.state = SequenceState.PREEMPTED
            seq.num_written = [0] * self.pool.num_layers
        else:
            host = self._host()
            self._check_settled(seq, "swap out")
            swap_out(seq, self.pool, host)
            self._counters["swaps_out"] += 1
        seq.reservation_id = 0
        self._counters["preemptions"] += 1

    def resume(self, seq_id: Hashable) -> int:
        """Bring a preempted or swapped sequence back to running.

        A swapped sequence gets its blocks back in whatever device blocks are
        free, with identical contents. A recompute-preempted one comes back
        empty, except that with prefix caching the still-cached blocks of its
        own token history are shared again; the caller re-feeds the rest.
        Such reuse is counted apart from prefix hits (vLLM #25780 counted
        recomputation after preemption as hits).

        Returns:
            Tokens the sequence holds again: all of them after a swap; after a
            recompute preemption the leading tokens found in the prefix cache
            (a multiple of block_size, never all), else 0.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            SequenceStateError: it is running already.
            PoolExhaustedError: (swapped) not enough free device blocks; nothing changes.
        """
        seq = self._get(seq_id)
        if seq.state is SequenceState.RUNNING:
            raise SequenceStateError(f"sequence {seq_id!r} is running; only preempted ones resume")
        if seq.state is SequenceState.SWAPPED:
            swap_in(seq, self.pool, self._host())
            self._counters["swaps_in"] += 1
            if self._sharing is not None:
                self._sharing.rekey_restored(seq)
            return seq.table.num_tokens
        seq.state = SequenceState.RUNNING
        if self._sharing is None or not seq.token_ids:
            seq.token_ids = None if seq.token_ids is None else []
            seq.block_keys = []
            return 0
        history = seq.token_ids
        seq.token_ids, seq.block_keys = [], []
        num_reused = self._sharing.share_cached_prefix(seq, history, token_bytes(history))
        self._counters["resumed_reuse"] += num_reused
        return num_reused

    # -------------------------------------------------------------- reporting

    def metrics(self) -> ManagerMetrics:
        """A snapshot of usage, occupancy, fragmentation and event counts."""
        cache = self._sharing.cache if self._sharing is not None else None
        return collect_metrics(
            self.pool,
            self.host_pool,
            [record.state for record in self._seqs.values()],
            [record.table for record in self._seqs.values() if record.state is SequenceState.RUNNING],
            self._counters,
            num_cached_blocks=cache.num_cached_blocks if cache else 0,
            num_prefix_evictions=cache.num_evictions if cache else 0,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self.pool.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        if self._sharing is not None:
            self._sharing.cache.check_invariants()
        bs = self.pool.block_size
        for seq in self._seqs.values():
            keyed = self._sharing is not None and seq.token_ids is not None
            if keyed and seq.state is not SequenceState.PREEMPTED:
                assert seq.token_ids is not None
                if len(seq.token_ids) != seq.table.num_tokens:
                    raise AssertionError(f"sequence {seq.seq_id!r}: token ids and table disagree")
                if len(seq.block_keys) > min(seq.num_written) // bs:
                    raise AssertionError(f"sequence {seq.seq_id!r} has keys for unwritten blocks")
            seq.table.check_invariants()
            if seq.state is SequenceState.PREEMPTED and seq.table.num_blocks:
                raise AssertionError(f"preempted sequence {seq.seq_id!r} still holds blocks")
            if any(n > seq.table.num_tokens for n in seq.num_written):
                raise AssertionError(f"sequence {seq.seq_id!r} has more written than reserved")
            if seq.state is SequenceState.SWAPPED and self.host_pool is None:
                raise AssertionError("a swapped sequence without a host pool")

    # ------------------------------------------------------- internal hooks

    def _export_state(self) -> ManagerState:
        """Everything of this manager that its configuration and pools do not say (copies).

        With ``_restore_state`` this is the manager's internal hook for
        :mod:`pagedkv.snapshot`; no other module reads its private fields.
        """
        cache = self._sharing.cache if self._sharing is not None else None
        keys, num_evictions = cache._export_state() if cache is not None else ([], 0)
        return ManagerState(
            max_abs_key=list(self._max_abs_key),
            counters=dict(self._counters),
            records=[record.export_state() for record in self._seqs.values()],
            prefix_keys=keys,
            num_prefix_evictions=num_evictions,
        )

    def _restore_state(self, state: ManagerState) -> None:
        """Take ``state`` into this new, empty manager whose pools' allocators are already restored.

        The caller (a snapshot load) has validated ``state`` against the pools.
        """
        if self._sharing is not None:
            self._sharing.cache._restore_state(state.prefix_keys, state.num_prefix_evictions)
        self._max_abs_key = list(state.max_abs_key)
        self._counters.update(state.counters)
        bs = self.pool.block_size
        for record_state in state.records:
            record = SequenceRecord.from_state(record_state, bs, self.num_sink_tokens)
            self._seqs[record.seq_id] = record

    # ---------------------------------------------------------------- private

    def _get(self, seq_id: Hashable) -> SequenceRecord:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"no sequence {seq_id!r}; known: {_preview(list(self._seqs))}"
            ) from None
        except TypeError as error:
            raise InputTypeError(f"sequence ids must be hashable, got {seq_id!r}") from error

    def _check_new_id(self, seq_id: Hashable) -> None:
        try:
            known = seq_id in self._seqs
        except TypeError as error:
            raise InputTypeError(f"sequence ids must be hashable, got {seq_id!r}") from error
        if known:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")

    def _check_settled(self, seq: SequenceRecord, action: str) -> None:
        if seq.state is not SequenceState.RUNNING:
            raise SequenceStateError(f"cannot {action} sequence {seq.seq_id!r}: it is {seq.state.value}")
        pending = seq.pending_layers()
        if pending:
            raise SequenceStateError(
                f"cannot {action} sequence {seq.seq_id!r}: layers {pending} have not written its "
                f"{seq.table.num_tokens - min(seq.num_written)} newest tokens"
            )

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InputTypeError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.pool.num_layers:
            raise LayerIndexError(f"layer {layer} is out of range 0..{self.pool.num_layers - 1}")

    def _host(self) -> KVPool:
        if self.host_pool is None:
            raise ConfigError("swap needs a host pool: KVCacheManager(..., host_pool=KVPool(...))")
        return self.host_pool

    def _tokens(self, name: str, value: Any, expected: tuple[int, int, int]) -> npt.NDArray[Any]:
        array, _ = as_vectors(name, value, self.pool.dtype, ndims=(3,))
        if array.shape != expected:
            raise ShapeError(
                f"{name} must have shape (num_tokens, num_heads, head_dim) = {expected}, got {array.shape}"
            )
        return array

    def _batch_seqs(self, batch: Batch) -> list[SequenceRecord]:
        if not isinstance(batch, Batch):
            raise InputTypeError(f"batch must be a Batch from reserve(), got {type(batch).__name__}")
        seqs = []
        for seq_id, stamp in zip(batch.seq_ids, batch.reservation_ids):
            seq = self._seqs.get(seq_id)
            if seq is None or seq.reservation_id != stamp or seq.state is not SequenceState.RUNNING:
                raise SequenceStateError(
                    f"this batch's slots for sequence {seq_id!r} are no longer reserved (it was "
                    "freed, preempted or reserved again); reserve again (cancel_reservation() "
                    "takes back the other sequences' unwritten tokens)"
                )
            seqs.append(seq)
        return seqs

    def _request_records(self, requests: list[Request]) -> list[SequenceRecord]:
        """Each request's record, every request checked: known, once, settled, a count >= 1."""
        seen: set[Hashable] = set()
        records = []
        keyed = self._sharing is not None
        num_layers = self.pool.num_layers
        for request in requests:
            seq = self._get(request.seq_id)
            if request.seq_id in seen:
                raise DuplicateSequenceError(
                    f"sequence {request.seq_id!r} appears twice in one reservation"
                )
            seen.add(request.seq_id)
            if request.num_new_tokens < 1:
                check_count(f"tokens for sequence {request.seq_id!r}", request.num_new_tokens)
            # Fast path: the last layer written and one layer means settled.
            settled = seq.state is SequenceState.RUNNING and seq.num_written[-1] == seq.table.num_tokens
            if not settled or (num_layers > 1 and seq.pending_layers()):
                self._check_settled(seq, "reserve for")
            if keyed and request.token_ids is None and seq.token_ids is not None:
                raise ConfigError(
                    f"sequence {request.seq_id!r} caches its blocks by prefix, so its reservations need "
                    f"token ids ({{{request.seq_id!r}: [17, 4, ...]}}), not a count; or add it with "
                    "add_sequence(..., cache_blocks=False)"
                )
            records.append(seq)
        return records

    def _plan(self, requests: list[Request], records: list[SequenceRecord]) -> ReservationPlan:
        return plan_reservation(
            [record.table for record in records], requests, self.pool.allocator, self.max_size
        )

    def _release(self, seq: SequenceRecord) -> None:
        released = seq.table.clear()
        if seq.state is SequenceState.RUNNING:
            self.pool.allocator.free(released)
        elif seq.state is SequenceState.SWAPPED:
            self._host().allocator.free(released)


def _prompt_ids(prompt: object) -> list[int]:
    """A prompt's token ids as a list, validated (ints in int64 range, non-negative)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence | np.ndarray):
        raise InputTypeError(f"prompt must be a sequence of token ids, got {prompt!r}")
    token_ids = [int(t) if isinstance(t, np.integer) else t for t in prompt]
    token_bytes(token_ids)  # validates
    return token_ids


def _preview(items: list[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]" if items else "none"
