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
>>> manager.add_sequence("a")
>>> batch = manager.reserve({"a": 3})
>>> kv = np.ones((3, 1, 2))
>>> manager.write(0, batch, kv, kv)
>>> manager.attend(0, batch, np.ones((3, 1, 2))).shape
(3, 1, 2)
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.attention import attend_dense, attend_dense_masked, attend_padded
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
from pagedkv.pool import KVPool

__all__ = ["KVCacheManager", "SequenceState"]


class SequenceState(enum.Enum):
    """Where a sequence's blocks are."""

    RUNNING = "running"  #: on the device pool
    PREEMPTED = "preempted"  #: freed for recompute; the caller re-feeds its tokens
    SWAPPED = "swapped"  #: copied to the host pool


class _Sequence:
    __slots__ = ("num_written", "reservation_id", "seq_id", "state", "table")

    def __init__(self, seq_id: Hashable, table: BlockTable, num_layers: int) -> None:
        self.seq_id = seq_id
        self.table = table
        self.state = SequenceState.RUNNING
        #: Tokens whose k/v are written, per layer.
        self.num_written = [0] * num_layers
        self.reservation_id = 0

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
        self._next_reservation = 1
        self._counters = dict.fromkeys(
            ("forks", "copy_on_write", "preemptions", "swaps_out", "swaps_in"), 0
        )
        pool.attach(_Holder(self, SequenceState.RUNNING))
        if host_pool is not None:
            host_pool.attach(_Holder(self, SequenceState.SWAPPED))

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

    def plan(self, requests: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> ReservationPlan:
        """What ``reserve(requests)`` would take and free, without doing it.

        Raises:
            UnknownSequenceError, DuplicateSequenceError, ConfigError,
            SequenceStateError: as ``reserve`` would.
        """
        return self._plan(_as_pairs(requests))[0]

    def can_reserve(self, requests: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> bool:
        """Whether ``reserve(requests)`` would succeed now."""
        return self.plan(requests).fits

    # --------------------------------------------------------------- commands

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence.

        Raises:
            DuplicateSequenceError: ``seq_id`` is already known.
            InputTypeError: ``seq_id`` is not hashable.
        """
        self._check_new_id(seq_id)
        self._seqs[seq_id] = _Sequence(
            seq_id, BlockTable(self.pool.block_size, self.num_sink_tokens), self.pool.num_layers
        )

    def reserve(self, requests: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> Batch:
        """Reserve slots for new tokens of several sequences, all or nothing.

        First every block wholly outside each sequence's window (for its first
        new token) goes back to the pool; then shared, partly filled last
        blocks are copied (copy-on-write); then new blocks are taken.

        Args:
            requests: ``{seq_id: num_new_tokens}`` (or ``(seq_id, n)`` pairs),
                each ``n >= 1``; a sequence may appear once.

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
        slots: list[npt.NDArray[np.int64]] = []
        first_positions, stamps = [], []
        for (seq_id, num_new), (window_start, copy_on_write, num_blocks) in zip(pairs, steps):
            seq = self._seqs[seq_id]
            table = seq.table
            released = table.evict_to(window_start)
            if released:
                allocator.free(released)
            if copy_on_write:
                copy = allocator.allocate_one()
                self.pool.copy_blocks([table.last_block_id], [copy])
                allocator.free_one(table.replace_last(copy))
                self._counters["copy_on_write"] += 1
            start = table.num_tokens
            table.append(num_new, allocator.allocate(num_blocks))
            first_positions.append(start)
            slots.append(_range_slots(table, [(start, start + num_new)], bs).astype(np.int64))
            seq.reservation_id = self._next_reservation
            stamps.append(self._next_reservation)
            self._next_reservation += 1
        counts = [n for _, n in pairs]
        return Batch(
            seq_ids=tuple(seq_id for seq_id, _ in pairs),
            num_new_tokens=tuple(counts),
            first_positions=tuple(first_positions),
            query_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            slot_mapping=np.concatenate(slots),
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
        if method == "padded" and all(n == 1 for n in batch.num_new_tokens):
            return self._attend_padded(layer, seqs, query_array)
        out = np.empty_like(query_array)
        window = self.layer_max_sizes[layer]
        for seq, lo, hi in zip(seqs, batch.query_start[:-1], batch.query_start[1:]):
            out[lo:hi] = self._attend_one(layer, seq, window, query_array[lo:hi])
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
        self.pool.allocator.share(seq.table.block_ids)
        self._seqs[child] = twin
        self._counters["forks"] += 1

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

    def resume(self, seq_id: Hashable) -> None:
        """Bring a preempted or swapped sequence back to running.

        A recompute-preempted sequence comes back empty; a swapped one gets its
        blocks back in whatever device blocks are free, with identical contents.

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

    # -------------------------------------------------------------- reporting

    def metrics(self) -> ManagerMetrics:
        """A snapshot of usage, occupancy, fragmentation and event counts."""
        pool = self.pool
        bs = pool.block_size
        live: dict[int, tuple[int, int]] = {}
        num_live_tokens = 0
        for seq in self._seqs.values():
            if seq.state is not SequenceState.RUNNING:
                continue
            table = seq.table
            num_live_tokens += table.num_cached_tokens
            for start, end in table.live_ranges():
                for logical_block in range(start // bs, (end - 1) // bs + 1):
                    block_id = table.slot(max(start, logical_block * bs)) // bs
                    lo = max(start, logical_block * bs) - logical_block * bs
                    hi = min(end, (logical_block + 1) * bs) - logical_block * bs
                    old = live.get(block_id)
                    live[block_id] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        num_live_slots = sum(hi - lo for lo, hi in live.values())
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
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self.pool.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        for seq in self._seqs.values():
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
                    "freed, preempted or reserved again); reserve again"
                )
            seqs.append(seq)
        return seqs

    def _plan(
        self, pairs: list[tuple[Hashable, int]]
    ) -> tuple[ReservationPlan, list[tuple[int, bool, int]]]:
        allocator = self.pool.allocator
        bs = self.pool.block_size
        seen: set[Hashable] = set()
        ref_drops: dict[int, int] = {}
        steps = []
        num_new = num_cow = num_released = 0
        for seq_id, count in pairs:
            seq = self._get(seq_id)
            if seq_id in seen:
                raise DuplicateSequenceError(f"sequence {seq_id!r} appears twice in one reservation")
            seen.add(seq_id)
            check_count(f"tokens for sequence {seq_id!r}", count)
            self._check_settled(seq, "reserve for")
            table = seq.table
            window_start = table.window_start
            if self.max_size is not None:
                window_start = table.num_tokens + 1 - self.max_size
            num_release = table.num_blocks_released_by(window_start)
            window_ids = table.block_ids[table.num_blocks - table.num_window_blocks :]
            for block_id in window_ids[:num_release]:
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

    def _release(self, seq: _Sequence) -> None:
        released = seq.table.clear()
        if seq.state is SequenceState.RUNNING:
            self.pool.allocator.free(released)
        elif seq.state is SequenceState.SWAPPED:
            self._host().allocator.free(released)

    def _visible(self, seq: _Sequence, window: int | None, position: int) -> list[tuple[int, int]]:
        """Logical index ranges the token at ``position`` attends in a layer with ``window``."""
        sinks = min(self.num_sink_tokens, position + 1)
        start = sinks if window is None else max(sinks, position + 1 - window)
        ranges = [(0, sinks)] if sinks else []
        if position + 1 > start:
            ranges.append((start, position + 1))
        return ranges

    def _attend_one(
        self, layer: int, seq: _Sequence, window: int | None, queries: npt.NDArray[Any]
    ) -> npt.NDArray[Any]:
        table = seq.table
        pool = self.pool
        last = table.num_tokens - 1
        held = table.live_ranges()
        if len(queries) == 1:
            visible = self._visible(seq, window, last)
            if visible == held:
                keys, values = pool.gather(layer, table)
            else:
                keys, values = pool.gather_slots(layer, _range_slots(table, visible, pool.block_size))
            return attend_dense(queries[0], keys, values, self.scale)[None]
        keys, values = pool.gather(layer, table)
        positions = np.concatenate([np.arange(start, end) for start, end in held])
        query_positions = np.arange(last + 1 - len(queries), last + 1)
        mask = positions[None, :] <= query_positions[:, None]
        if window is not None:
            in_window = positions[None, :] > query_positions[:, None] - window
            mask &= in_window | (positions[None, :] < self.num_sink_tokens)
        return attend_dense_masked(queries, keys, values, mask, self.scale)

    def _attend_padded(
        self, layer: int, seqs: list[_Sequence], queries: npt.NDArray[Any]
    ) -> npt.NDArray[Any]:
        window = self.layer_max_sizes[layer]
        bs = self.pool.block_size
        slot_lists = [
            _range_slots(seq.table, self._visible(seq, window, seq.table.num_tokens - 1), bs)
            for seq in seqs
        ]
        lengths = np.array([len(s) for s in slot_lists])
        width = int(lengths.max())
        padded = np.zeros((len(seqs), width), np.intp)
        for row, slots in enumerate(slot_lists):
            padded[row, : len(slots)] = slots
        keys, values = self.pool.gather_slots(layer, padded.ravel())
        shape = (self.pool.num_kv_heads, len(seqs), width, self.pool.head_dim)
        return attend_padded(queries, keys.reshape(shape), values.reshape(shape), lengths, self.scale)


def _as_pairs(
    requests: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]],
) -> list[tuple[Hashable, int]]:
    if isinstance(requests, Mapping):
        return list(requests.items())
    try:
        pairs = [(seq_id, count) for seq_id, count in requests]
    except (TypeError, ValueError) as error:
        raise InputTypeError(
            f"requests must be a mapping or (seq_id, num_new_tokens) pairs, got {requests!r}"
        ) from error
    if not pairs:
        raise ConfigError("a reservation needs at least one sequence")
    return pairs


def _range_slots(table: BlockTable, ranges: list[tuple[int, int]], block_size: int) -> npt.NDArray[np.intp]:
    """Slots of the held logical indices in ``ranges``, in order."""
    block_ids = np.array(table.block_ids, np.intp)
    num_sink_held = table.num_blocks - table.num_window_blocks
    positions = np.concatenate([np.arange(start, end) for start, end in ranges])
    logical_block = positions // block_size
    index = np.where(
        logical_block < table.num_sink_blocks,
        logical_block,
        logical_block - table.first_block_index + num_sink_held,
    )
    slots: npt.NDArray[np.intp] = block_ids[index] * block_size + positions % block_size
    return slots


def _copy_between(source: KVPool, source_ids: list[int], target: KVPool, target_ids: list[int]) -> None:
    for layer in range(source.num_layers):
        target.keys(layer)[:, target_ids] = source.keys(layer)[:, source_ids]
        target.values(layer)[:, target_ids] = source.values(layer)[:, source_ids]


def _check_same_shape(pool: KVPool, host_pool: KVPool) -> None:
    if not isinstance(host_pool, KVPool):
        raise InputTypeError(f"host_pool must be a KVPool, got {type(host_pool).__name__}")
    fields = ("block_size", "num_kv_heads", "head_dim", "num_layers", "dtype")
    for name in fields:
        if getattr(pool, name) != getattr(host_pool, name):
            raise ConfigError(
                f"host_pool.{name}={getattr(host_pool, name)} but the pool's is {getattr(pool, name)}"
            )


def _preview(items: list[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]" if items else "none"
