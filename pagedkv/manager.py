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

import enum
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.batch import Batch, ReservationPlan
from pagedkv.block_table import BlockTable
from pagedkv.errors import (
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    LayerIndexError,
    NonFiniteError,
    PoolExhaustedError,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
)
from pagedkv.inputs import as_vectors, check_count, check_max_size, check_scale
from pagedkv.metrics import ManagerMetrics
from pagedkv.paged_attention import attend_decode_padded, attend_sequence
from pagedkv.pool import KVPool
from pagedkv.prefix_cache import (
    ROOT_KEY,
    PrefixCache,
    block_keys,
    encode_extra_keys,
    hash_function,
    token_bytes,
)

__all__ = ["KVCacheManager", "SequenceState"]

# NOTE: one counter for every manager, so a Batch from another manager never
# matches a stamp here (per-manager counters both start at 1).
_RESERVATION_IDS = itertools.count(1)


class SequenceState(enum.Enum):
    """Where a sequence's blocks are."""

    RUNNING = "running"  #: on the device pool
    PREEMPTED = "preempted"  #: freed for recompute; the caller re-feeds its tokens
    SWAPPED = "swapped"  #: copied to the host pool


class _Sequence:
    __slots__ = (
        "block_keys",
        "extras",
        "num_written",
        "reservation_id",
        "seq_id",
        "state",
        "table",
        "token_ids",
    )

    def __init__(self, seq_id: Hashable, table: BlockTable, num_layers: int) -> None:
        self.seq_id = seq_id
        self.table = table
        self.state = SequenceState.RUNNING
        #: Tokens whose k/v are written, per layer.
        self.num_written = [0] * num_layers
        self.reservation_id = 0
        #: Prefix caching: every token id so far (None once a reservation gave
        #: only a count), the chained key of each full logical block from 0,
        #: and the encoded extra keys (salt, adapter, multimodal).
        self.token_ids: list[int] | None = []
        self.block_keys: list[bytes] = []
        self.extras = b""

    def copy_keys_from(self, other: _Sequence) -> None:
        self.token_ids = None if other.token_ids is None else list(other.token_ids)
        self.block_keys = list(other.block_keys)
        self.extras = other.extras

    def pending_layers(self) -> list[int]:
        return [layer for layer, n in enumerate(self.num_written) if n != self.table.num_tokens]


class _Holder:
    """Reports the block ids a manager holds on one pool (for ``KVPool.check_invariants``)."""

    def __init__(self, manager: KVCacheManager, state: SequenceState) -> None:
        self._manager = manager
        self._state = state

    def _held_block_ids(self) -> list[int]:
        return [
            block_id
            for seq in self._manager._seqs.values()
            if seq.state is self._state
            for block_id in seq.table.block_ids
        ]


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
        if host_pool is not None:
            _check_same_shape(pool, host_pool)
        self.host_pool = host_pool
        self._seqs: dict[Hashable, _Sequence] = {}
        self._max_abs_key = [0.0] * pool.num_layers
        self._counters = dict.fromkeys(
            (
                "forks",
                "copy_on_write",
                "preemptions",
                "swaps_out",
                "swaps_in",
                "prefix_queries",
                "prefix_hits",
                "resumed_reuse",
            ),
            0,
        )
        self._prefix: PrefixCache | None = None
        #: The block hash's name (kept for snapshots).
        self.hash_algorithm = hash_algorithm
        if enable_prefix_caching:
            self._hasher = hash_function(hash_algorithm)
            if pool.allocator.on_evict is not None:
                raise ConfigError("another manager already runs prefix caching on this pool")
            self._prefix = PrefixCache(pool.allocator)
        # The pools hold these weakly; the manager keeps them alive.
        self._holders = [_Holder(self, SequenceState.RUNNING), _Holder(self, SequenceState.SWAPPED)]
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
        return self._plan(_as_pairs(requests))[0]

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

        Returns:
            How many leading prompt tokens are already cached (a multiple of
            ``block_size``, never the whole prompt: at least its last token is
            left to compute). The caller writes k/v only for the rest.

        Raises:
            DuplicateSequenceError: ``seq_id`` is already known.
            InputTypeError, ConfigError: a bad id, token id or extra key.
        """
        self._check_new_id(seq_id)
        extras = encode_extra_keys(extra_keys)
        tokens = token_bytes(list(prompt)) if prompt is not None else b""
        seq = _Sequence(
            seq_id, BlockTable(self.pool.block_size, self.num_sink_tokens), self.pool.num_layers
        )
        seq.extras = extras
        self._seqs[seq_id] = seq
        if self._prefix is None or prompt is None:
            return 0
        self._counters["prefix_queries"] += len(prompt)
        num_hit = self._share_cached_prefix(seq, list(prompt), tokens)
        self._counters["prefix_hits"] += num_hit
        return num_hit

    def reset_prefix_cache(self) -> None:
        """Drop every block key; refused while any block is in use.

        Raises:
            ConfigError: prefix caching is off.
            SequenceStateError: blocks are in use (free every sequence first).
        """
        if self._prefix is None:
            raise ConfigError("prefix caching is off for this manager")
        if self.pool.num_used_blocks:
            raise SequenceStateError(
                f"{self.pool.num_used_blocks} blocks are in use; free every sequence before a reset"
            )
        self._prefix.reset()

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
        pairs = _as_pairs(requests)
        plan, steps = self._plan(pairs)
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
            for (seq_id, _, _), (window_start, _, _) in zip(pairs, steps):
                table = self._seqs[seq_id].table
                if window_start > table.window_start:
                    released = table.evict_to(window_start)
                    if released:
                        allocator.free(released)
        for (seq_id, num_new, token_ids), (_, copy_on_write, num_blocks) in zip(pairs, steps):
            seq = self._seqs[seq_id]
            if seq.token_ids is not None:
                if token_ids is None:
                    seq.token_ids = None
                else:
                    seq.token_ids.extend(token_ids)
            table = seq.table
            if copy_on_write:
                copy = allocator.allocate_one()
                self.pool.copy_blocks([table.last_block_id], [copy])
                allocator.free_one(table.replace_last(copy))
                self._counters["copy_on_write"] += 1
            start = table.num_tokens
            table.append(num_new, allocator.allocate(num_blocks) if num_blocks else [])
            first_positions.append(start)
            if num_new == 1:
                slots.append(table.last_block_id * bs + start % bs)
            else:
                slots.extend(table.slots(start, start + num_new))
            seq.reservation_id = stamp = next(_RESERVATION_IDS)
            stamps.append(stamp)
        counts = [n for _, n, _ in pairs]
        return Batch(
            seq_ids=tuple(seq_id for seq_id, _, _ in pairs),
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
            if self._prefix is not None:
                self._key_full_blocks(seq)

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
        bound = abs(self.scale) * float(np.abs(query_array).sum(axis=-1).max()) * self._max_abs_key[layer]
        if bound > float(np.finfo(self.pool.dtype).max) / 16:
            raise NonFiniteError(f"attention scores could reach {bound:.3g}; scale q or k down")
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
        twin = _Sequence(child, seq.table.copy(), self.pool.num_layers)
        twin.num_written = list(seq.num_written)
        twin.copy_keys_from(seq)
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
            device_ids = seq.table.block_ids
            host_ids = host.allocator.allocate(len(device_ids))
            _copy_between(self.pool, device_ids, host, host_ids)
            self.pool.allocator.free(seq.table.replace_all(host_ids))
            seq.state = SequenceState.SWAPPED
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
            host_ids = seq.table.block_ids
            device_ids = self.pool.allocator.allocate(len(host_ids))
            _copy_between(self._host(), host_ids, self.pool, device_ids)
            self._host().allocator.free(seq.table.replace_all(device_ids))
            self._counters["swaps_in"] += 1
            seq.state = SequenceState.RUNNING
            if self._prefix is not None:
                self._rekey_restored(seq)
            return seq.table.num_tokens
        seq.state = SequenceState.RUNNING
        if self._prefix is None or not seq.token_ids:
            seq.token_ids = None if seq.token_ids is None else []
            seq.block_keys = []
            return 0
        history = seq.token_ids
        seq.token_ids, seq.block_keys = [], []
        num_reused = self._share_cached_prefix(seq, history, token_bytes(history))
        self._counters["resumed_reuse"] += num_reused
        return num_reused

    # -------------------------------------------------------------- reporting

    def metrics(self) -> ManagerMetrics:
        """A snapshot of usage, occupancy, fragmentation and event counts."""
        pool = self.pool
        bs = pool.block_size
        ref_count = pool.allocator.ref_count
        live: dict[int, int] = {}  # shared block id -> bitmask of live offsets
        num_live_tokens = num_live_slots = 0
        for seq in self._seqs.values():
            if seq.state is not SequenceState.RUNNING:
                continue
            table = seq.table
            num_live_tokens += table.num_cached_tokens
            if pool.allocator.max_ref_count(table.block_ids) <= 1:
                num_live_slots += table.num_cached_tokens  # nothing shared: count directly
                continue
            ranges = table.live_ranges()
            for logical_block, block_id in table.held_blocks():
                first = logical_block * bs
                mask = 0
                for start, end in ranges:
                    lo, hi = max(start, first), min(end, first + bs)
                    if lo < hi:
                        mask |= (1 << (hi - first)) - (1 << (lo - first))
                if ref_count(block_id) == 1:
                    num_live_slots += bin(mask).count("1")
                else:
                    live[block_id] = live.get(block_id, 0) | mask
        num_live_slots += sum(bin(mask).count("1") for mask in live.values())
        used = pool.num_used_blocks
        host_used = self.host_pool.num_used_blocks if self.host_pool is not None else 0
        states = [seq.state for seq in self._seqs.values()]
        return ManagerMetrics(
            num_blocks=pool.num_blocks,
            num_used_blocks=used,
            num_free_blocks=pool.num_free_blocks,
            block_size=bs,
            block_usage=used / pool.num_blocks,
            num_live_slots=num_live_slots,
            num_live_tokens=num_live_tokens,
            token_occupancy=num_live_slots / (pool.num_blocks * bs),
            internal_fragmentation=(1 - num_live_slots / (used * bs)) if used else 0.0,
            num_sequences=len(self._seqs),
            num_running=states.count(SequenceState.RUNNING),
            num_swapped=states.count(SequenceState.SWAPPED),
            num_host_used_blocks=host_used,
            num_forks=self._counters["forks"],
            num_copy_on_write=self._counters["copy_on_write"],
            num_preemptions=self._counters["preemptions"],
            num_swaps_out=self._counters["swaps_out"],
            num_swaps_in=self._counters["swaps_in"],
            num_prefix_queries=self._counters["prefix_queries"],
            num_prefix_hits=self._counters["prefix_hits"],
            prefix_hit_rate=(
                self._counters["prefix_hits"] / self._counters["prefix_queries"]
                if self._counters["prefix_queries"]
                else 0.0
            ),
            num_cached_blocks=self._prefix.num_cached_blocks if self._prefix else 0,
            num_cached_free_blocks=pool.allocator.num_cached_free_blocks,
            num_prefix_evictions=self._prefix.num_evictions if self._prefix else 0,
            num_resumed_reuse_tokens=self._counters["resumed_reuse"],
            bytes_per_token=pool.bytes_per_token,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self.pool.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        if self._prefix is not None:
            self._prefix.check_invariants()
        bs = self.pool.block_size
        for seq in self._seqs.values():
            keyed = self._prefix is not None and seq.token_ids is not None
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

    # ---------------------------------------------------------------- private

    def _get(self, seq_id: Hashable) -> _Sequence:
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

    def _check_settled(self, seq: _Sequence, action: str) -> None:
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

    def _batch_seqs(self, batch: Batch) -> list[_Sequence]:
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

    def _plan(
        self, pairs: list[tuple[Hashable, int, list[int] | None]]
    ) -> tuple[ReservationPlan, list[tuple[int, bool, int]]]:
        allocator = self.pool.allocator
        bs = self.pool.block_size
        seen: set[Hashable] = set()
        ref_drops: dict[int, int] = {}
        steps = []
        num_new = num_cow = num_released = 0
        for seq_id, count, _ in pairs:
            seq = self._get(seq_id)
            if seq_id in seen:
                raise DuplicateSequenceError(f"sequence {seq_id!r} appears twice in one reservation")
            seen.add(seq_id)
            if count < 1:
                check_count(f"tokens for sequence {seq_id!r}", count)
            table = seq.table
            # Fast path: the last layer written and one layer means settled.
            settled = seq.state is SequenceState.RUNNING and seq.num_written[-1] == table.num_tokens
            if not settled or (self.pool.num_layers > 1 and seq.pending_layers()):
                self._check_settled(seq, "reserve for")
            window_start = table.window_start
            if self.max_size is not None:
                window_start = table.num_tokens + 1 - self.max_size
                for block_id in table.window_block_ids(table.num_blocks_released_by(window_start)):
                    ref_drops[block_id] = ref_drops.get(block_id, 0) + 1
                    if ref_drops[block_id] == allocator.ref_count(block_id):
                        num_released += 1
            copy_on_write = False
            if table.num_tokens % bs and table.num_blocks:
                last = table.last_block_id
                refs = allocator.ref_count(last) - ref_drops.get(last, 0)
                if refs > 1:
                    copy_on_write = True
                    ref_drops[last] = ref_drops.get(last, 0) + 1
            num_blocks = table.num_new_blocks(count)
            num_new += num_blocks + copy_on_write
            num_cow += copy_on_write
            steps.append((window_start, copy_on_write, num_blocks))
        num_free = allocator.num_free_blocks
        plan = ReservationPlan(
            fits=num_new <= num_free + num_released,
            num_new_blocks=num_new,
            num_copy_on_write=num_cow,
            num_released_blocks=num_released,
            num_free_blocks=num_free,
        )
        return plan, steps

    def _share_cached_prefix(self, seq: _Sequence, token_ids: list[int], tokens: bytes) -> int:
        """Share the longest cached run of ``token_ids``' full blocks; return its tokens.

        NOTE: with a sliding window the whole chain is looked up (a key proves
        its entire prefix), but only the hit blocks the next token's window
        reaches, and the sink blocks, are shared: blocks that slid out of the
        window are not needed and stay free for others.
        """
        assert self._prefix is not None
        bs = self.pool.block_size
        num_usable = (len(token_ids) - 1) // bs  # always leave the last token to compute
        keys = block_keys(ROOT_KEY, tokens[: 8 * bs * num_usable], bs, seq.extras, self._hasher)
        hit = self._prefix.longest_prefix(keys)
        num_hit = len(hit) * bs
        if not hit:
            return 0
        window_start = self.num_sink_tokens
        if self.max_size is not None:
            window_start = max(window_start, num_hit + 1 - self.max_size)
        window_start = min(window_start, num_hit)
        num_sink_blocks = min(seq.table.num_sink_blocks, len(hit))
        first = max(num_sink_blocks, window_start // bs)
        held = hit[:num_sink_blocks] + hit[first:]
        allocator = self.pool.allocator
        for block_id in held:
            if allocator.ref_count(block_id) == 0:
                allocator.revive(block_id)
            else:
                allocator.share([block_id])
        seq.table = BlockTable.restored(bs, self.num_sink_tokens, num_hit, window_start, held)
        seq.num_written = [num_hit] * self.pool.num_layers
        seq.token_ids = token_ids[:num_hit]
        seq.block_keys = keys[: len(hit)]
        return num_hit

    def _key_full_blocks(self, seq: _Sequence) -> None:
        """Give keys to ``seq``'s blocks that are full and written in every layer."""
        assert self._prefix is not None
        if seq.token_ids is None:
            return
        bs = self.pool.block_size
        first = len(seq.block_keys)
        num_full = min(seq.num_written) // bs
        if num_full <= first:
            return
        parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
        tokens = token_bytes(seq.token_ids[first * bs : num_full * bs])
        new_keys = block_keys(parent, tokens, bs, seq.extras, self._hasher)
        table = seq.table
        for logical_block, key in enumerate(new_keys, start=first):
            if logical_block < table.num_sink_blocks or logical_block >= table.first_block_index:
                self._prefix.register(table.slot(logical_block * bs) // bs, key)
        seq.block_keys.extend(new_keys)

    def _rekey_restored(self, seq: _Sequence) -> None:
        """After a swap-in, key the restored full blocks whose keys are free again."""
        assert self._prefix is not None
        bs = self.pool.block_size
        table = seq.table
        for logical_block, key in enumerate(seq.block_keys):
            held = logical_block < table.num_sink_blocks or logical_block >= table.first_block_index
            if held and self._prefix.block_for(key) is None:
                self._prefix.register(table.slot(logical_block * bs) // bs, key)

    def _release(self, seq: _Sequence) -> None:
        released = seq.table.clear()
        if seq.state is SequenceState.RUNNING:
            self.pool.allocator.free(released)
        elif seq.state is SequenceState.SWAPPED:
            self._host().allocator.free(released)


# NOTE: Mapping is invariant in its key type, so Mapping[Hashable, ...] would refuse a
# dict[str, int]; Any keys (validated as hashable at run time) accept every dict.
Requests = Mapping[Any, "int | Sequence[int]"] | Iterable[tuple[Hashable, "int | Sequence[int]"]]


def _as_pairs(requests: Requests) -> list[tuple[Hashable, int, list[int] | None]]:
    """``(seq_id, num_new_tokens, token_ids or None)`` for every request, validated."""
    try:
        items = list(requests.items() if isinstance(requests, Mapping) else requests)
        pairs = [(seq_id, value) for seq_id, value in items]
    except (TypeError, ValueError) as error:
        raise InputTypeError(
            f"requests must be a mapping or (seq_id, num_new_tokens) pairs, got {requests!r}"
        ) from error
    if not pairs:
        raise ConfigError("a reservation needs at least one sequence")
    result: list[tuple[Hashable, int, list[int] | None]] = []
    for seq_id, value in pairs:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            result.append((seq_id, int(value), None))
            continue
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence | np.ndarray):
            raise InputTypeError(
                f"sequence {seq_id!r}: give a token count or a list of token ids, got {value!r}"
            )
        token_ids = [int(t) if isinstance(t, np.integer) else t for t in value]
        token_bytes(token_ids)  # validates
        result.append((seq_id, len(token_ids), token_ids))
    return result


def _copy_between(source: KVPool, source_ids: list[int], target: KVPool, target_ids: list[int]) -> None:
    for layer in range(source.num_layers):
        target.keys(layer)[:, target_ids] = source.keys(layer)[:, source_ids]
        target.values(layer)[:, target_ids] = source.values(layer)[:, source_ids]
    source.copy_block_scales(source_ids, target_ids, target)


def _check_same_shape(pool: KVPool, host_pool: KVPool) -> None:
    if not isinstance(host_pool, KVPool):
        raise InputTypeError(f"host_pool must be a KVPool, got {type(host_pool).__name__}")
    fields = ("block_size", "num_kv_heads", "head_dim", "num_layers", "dtype", "key_dtype", "value_dtype")
    for name in fields:
        if getattr(pool, name) != getattr(host_pool, name):
            raise ConfigError(
                f"host_pool.{name}={getattr(host_pool, name)} but the pool's is {getattr(pool, name)}"
            )


def _preview(items: list[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]" if items else "none"
