"""``KVCacheManager``: many sequences and many layers on one shared pool (vLLM: ``KVCacheManager``).

One forward step, as in an inference engine::

    batch = manager.reserve({"a": 5, "b": 1})   # slots for new tokens, all or nothing
    for layer in range(num_layers):
        manager.write(layer, batch, k, v)        # k, v: (batch.num_tokens, num_kv_heads, head_dim)
        out = manager.attend(layer, batch, q)    # q: (batch.num_tokens, num_q_heads, head_dim)

One block table per sequence serves every layer: block ``b`` of layer ``l`` is ``pool.keys(l)[:, b]``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from pagedkv.attention import attend_batch, attend_decode_padded, attend_sequence
from pagedkv.blocks.table import BlockTable
from pagedkv.counts import check_count, check_layer
from pagedkv.errors import ConfigError, InputTypeError, SequenceStateError, ShapeError, refuse_pickling
from pagedkv.inputs import (
    check_scale,
    check_score_bound_from_max,
    check_token_pair,
    check_tokens,
    is_torch_tensor,
    like_input,
    torch_array,
)
from pagedkv.locking import locked, run_or_defer
from pagedkv.manager.config import ManagerArguments, ManagerConfig, configure
from pagedkv.manager.metrics import COUNTERS, ManagerMetrics, collect_metrics
from pagedkv.manager.preempt import check_host_pool, preempt_record, release_record, resume_record
from pagedkv.manager.prefix_sharing import AdmissionPlan, PrefixSharing, plan_admission
from pagedkv.manager.reserve import (
    Batch,
    Requests,
    ReservationPlan,
    SlotRun,
    batch_records,
    plan_requests,
    reserve_one,
    reserve_requests,
)
from pagedkv.manager.sequence import (
    RUNNING,
    ManagerState,
    SequenceHolder,
    SequenceRecord,
    SequenceRegistry,
    SequenceState,
    check_settled,
)
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import PrefixCache, check_token_ids, pack_token_ids
from pagedkv.prefix.events import KVEvent, KVEventBuffer
from pagedkv.prefix.keys import ExtraKeys, encode_extra_keys
from pagedkv.prefix.stats import PrefixStats
from pagedkv.tiers.hooks import DeviceTiering
from pagedkv.tiers.tiered import TieredStore
from pagedkv.tiers.worker import PendingLoad, TierWorker

__all__ = ["COUNTERS", "KVCacheManager", "ManagerState", "SequenceState"]


class KVCacheManager:
    """Block tables for many sequences over one :class:`~pagedkv.KVPool`.

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

    NOTE: KV-cache groups (the next issue: full attention, sliding window and
    chunked local layers, each group with its own block table per sequence, as
    vLLM's ``KVCacheCoordinator`` holds one ``SingleTypeKVCacheManager`` per
    group) slot in where a sequence's one ``SequenceRecord.table`` is read:
    planning and committing a reservation (``manager/reserve.py``: ``plan_step``
    and ``commit_step`` per table), ``_write_layer`` and ``_attend_layer`` /
    ``_attend_one_sequence`` (a layer picks its group's table and window from
    ``layer_max_sizes``), ``fork`` / ``truncate`` / ``cancel_reservation``
    (each table alike), ``preempt.py`` (swap moves every table) and the
    queries ``block_table`` / ``num_tokens`` / ``window_start``.

    Threads: independent sequences may be driven from different threads (every
    command holds the pool's lock; attention runs outside it on per-thread
    scratch); one sequence driven from two threads at once is the caller's to
    serialise. A manager dropped without ``free`` gives every block back when
    it is collected, and its prefix cache stops, so another manager can run one.

    Invariants:
        * the pool's invariants hold, counting every running sequence's table
          (and, for the host pool, every swapped sequence's table);
        * no block id appears twice in one table;
        * a preempted sequence holds no blocks;
        * with a window ``W`` (the largest over layers), a sequence holds no
          block wholly older than its newest reservation's window;
        * every layer's written count is at most the table's token count;
        * with prefix caching, a keyed block is never written: a table that
          holds one partly (cut by ``truncate`` while another held it full)
          copies it before its next append (see
          :class:`~pagedkv.manager.prefix_sharing.PrefixSharing`).

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
            between sequences (see :mod:`pagedkv.prefix.cache`).
        hash_algorithm: ``"sha256"`` (default, collision resistant) or
            ``"xxh3_128"`` (faster, the ``xxhash`` extra, trusted prompts only).
        trusted_inputs: the engine vouches for the k, v and q values it
            passes: a ``write`` or ``attend`` of plain arrays of the pool's
            dtype and the right shape scans no values for NaN, infinity or
            magnitude, and ``attend`` skips the bound that refuses queries
            whose scores could overflow (so the largest |key| is not
            tracked). Every check of the batch, the sequences' states, the
            layers, shapes and dtypes stays: a trusted engine can get wrong
            numbers only from wrong numbers it passed, never a corrupt pool.
        kv_events: with prefix caching, record the prefix cache's changes
            for a cluster router (see :mod:`pagedkv.prefix.events`): True keeps up
            to 10,000 undrained events, an int sets that bound.
        num_layers: use only the pool's first ``num_layers`` layers (default:
            all): a KV-cache group on a pool whose pages hold a larger group's
            layers (see :class:`~pagedkv.manager.hybrid.HybridKVCacheManager`).
        share_pool_with: another prefix-caching manager on the same pool
            whose prefix cache this one's runs beside (one per KV-cache group;
            without it a pool runs one prefix cache).
        tiers: tiers below the pool (a host tier, file or Redis/Valkey
            stores; see :mod:`pagedkv.tiers` and docs/tiers.md). Prefix-cached
            blocks the pool evicts go there (and, under ``write_through``, every
            block as soon as it is keyed); ``add_sequence`` loads the blocks
            past the device hit that the tiers hold into new blocks and counts
            them as cached (``metrics().num_tier_hits``). A load that fails is
            computed instead. Store writes run on a worker thread
            (``flush_tiers`` waits for them); loads run in ``add_sequence``,
            bounded by each store's timeout, or off the step on that thread
            (``prefetch``, then ``add_sequence(..., prefetched=)``). Needs
            prefix caching, full attention (no window) and every pool layer
            (no KV-cache groups).

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
        trusted_inputs: bool = False,
        kv_events: bool | int = False,
        num_layers: int | None = None,
        share_pool_with: KVCacheManager | None = None,
        tiers: TieredStore | None = None,
    ) -> None:
        arguments = ManagerArguments(
            max_size, layer_max_sizes, num_sink_tokens, num_q_heads, scale, enable_prefix_caching,
            hash_algorithm, trusted_inputs, kv_events, num_layers,
        )
        config = configure(pool, arguments)
        tiering = None if tiers is None else _tiering(pool, config, tiers, share_pool_with)
        self.host_pool = None if host_pool is None else check_host_pool(pool, host_pool)
        self.pool = pool
        #: The validated configuration; the attributes below mirror it.
        self.config = config
        self.layer_max_sizes = config.layer_max_sizes
        #: The window that frees blocks: the largest layer window, None if any is unbounded.
        self.max_size = config.window
        self.num_sink_tokens = config.num_sink_tokens
        self.num_q_heads = config.num_q_heads
        self.scale = config.scale
        #: The block hash's name (kept for snapshots).
        self.hash_algorithm = config.hash_algorithm
        #: Whether ``write`` and ``attend`` skip scanning values (``trusted_inputs``).
        self.trusted_inputs = config.trusted_inputs
        #: The pool layers this manager writes and attends: ``0 .. num_layers - 1``.
        self.num_layers = config.num_layers
        self._seqs = SequenceRegistry()
        self._max_abs_key = [0.0] * config.num_layers
        # write's argmax/argmin results land here (check_token_pair's index): under pool.lock only.
        self._scan_index = np.empty((), np.intp)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._sharing = (
            PrefixSharing(pool, config, _shared_prefix_sharing(pool, share_pool_with))
            if config.enable_prefix_caching
            else None
        )
        #: The tiers below the pool and how blocks move to them, or None (``tiers``).
        self.tiering = tiering
        if tiering is not None and self._sharing is not None:
            self._sharing.attach_tiers(tiering)
            if tiering.worker is not None:
                weakref.finalize(self, tiering.worker.close)
        # The pools hold these weakly; the manager keeps them alive.
        self._holders = [
            SequenceHolder(self._seqs, SequenceState.RUNNING),
            SequenceHolder(self._seqs, SequenceState.SWAPPED),
        ]
        pool.attach(self._holders[0])
        if host_pool is not None:
            host_pool.attach(self._holders[1])
        weakref.finalize(self, _release_manager, pool, self.host_pool, self._seqs, self._sharing)

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

    def window_start(self, seq_id: Hashable, num_new_tokens: int = 0) -> int:
        """The first logical index after the sinks that ``seq_id`` holds once ``num_new_tokens`` are reserved.

        Reserving frees what lies wholly before the window of the first new
        token (the largest layer window), so the start is the same for any
        ``num_new_tokens >= 1``; ``0`` asks for the start now. Without a window
        it is ``num_sink_tokens`` for ever.

        >>> import numpy as np
        >>> from pagedkv import KVPool, KVCacheManager
        >>> manager = KVCacheManager(KVPool(8, block_size=2, head_dim=1), max_size=3)
        >>> manager.add_sequence("a")
        0
        >>> _ = manager.reserve({"a": 5})
        >>> manager.window_start("a"), manager.window_start("a", 1)
        (0, 3)

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            InputTypeError, ConfigError: ``num_new_tokens`` is not an int >= 0.
        """
        table = self._get(seq_id).table
        num_new_tokens = check_count("num_new_tokens", num_new_tokens, minimum=0)
        if not num_new_tokens or self.max_size is None:
            return table.window_start
        return max(table.window_start, min(table.num_tokens + 1 - self.max_size, table.num_tokens))

    def plan(self, requests: Requests, *, admit: Sequence[AdmissionPlan] = ()) -> ReservationPlan:
        """What ``reserve(requests)`` would take and free, without doing it.

        Args:
            requests: as for ``reserve``; ``{}`` (nothing to reserve, as
                ``reserve({})``'s empty step) fits and takes nothing.
            admit: ``lookup`` results of prompts to admit first, in the same
                step: their blocks count too (a cached block two of them
                revive counts once).

        Raises:
            UnknownSequenceError, DuplicateSequenceError, ConfigError,
            SequenceStateError: as ``reserve`` would.
        """
        plan = plan_requests(self._seqs, requests, self.pool, self.max_size, self._sharing is not None)
        if not admit:
            return plan
        revived = {block_id for entry in admit for block_id in entry.revived_block_ids}
        num_new = plan.num_new_blocks + len(revived) + sum(entry.num_new_blocks for entry in admit)
        fits = num_new <= plan.num_free_blocks + plan.num_released_blocks
        return dataclasses.replace(plan, num_new_blocks=num_new, fits=fits)

    def can_reserve(self, requests: Requests, *, admit: Sequence[AdmissionPlan] = ()) -> bool:
        """Whether ``reserve(requests)`` would succeed now (after admitting ``admit``, see ``plan``)."""
        return self.plan(requests, admit=admit).fits

    # --------------------------------------------------------------- commands

    @locked
    def add_sequence(
        self,
        seq_id: Hashable,
        prompt: Sequence[int] | None = None,
        *,
        extra_keys: ExtraKeys | None = None,
        cache_blocks: bool = True,
        max_cached_tokens: int | None = None,
        prefetched: PendingLoad | None = None,
    ) -> int:
        """Start a sequence; with prefix caching, share the cached blocks of its prompt.

        Args:
            seq_id: a new, hashable id.
            prompt: the prompt's token ids, looked up in the prefix cache.
                The sequence starts empty; reserve and write the prompt (from
                the returned position on) as usual.
            extra_keys: tagged keys hashed into every block key:
                ``{"salt": tenant, "adapter": id, "multimodal": hash}``.
                Sequences with different extra keys never share a block,
                except that ``multimodal`` may instead list items
                ``[(hash, offset, length), ...]``: each is mixed only into the
                blocks overlapping its placeholder tokens, so blocks before an
                image are shared (see :mod:`pagedkv.prefix.keys`).
            cache_blocks: with prefix caching, key this sequence's full blocks
                so later prompts can share them; its reservations must then
                give token ids. ``False`` lets it reserve by count, and its
                blocks are never keyed (the prompt is still looked up).
            max_cached_tokens: share at most this many leading tokens from the
                prefix cache (a hybrid manager's hit that every group accepts).
            prefetched: with ``tiers``, what ``prefetch(prompt, ...)`` fetched:
                the blocks past the device hit come from it alone (copied in
                here; no store call, no wait). A load that failed, is not done
                yet (it is cancelled), was cancelled, or fetched other keys
                than this prompt needs gives none of them, counted: those
                tokens are computed.

        Returns:
            How many leading prompt tokens are already cached (a multiple of
            ``block_size``, never the whole prompt: at least its last token is
            left to compute). The caller writes k/v only for the rest.

        Raises:
            DuplicateSequenceError: ``seq_id`` is already known.
            InputTypeError, ConfigError: a bad id, token id or extra key; a
                ``prefetched`` that is not this manager's ``prefetch``, or
                without a prompt.
        """
        self._seqs.check_new(seq_id)
        if not isinstance(cache_blocks, bool):
            raise InputTypeError(f"cache_blocks must be True or False, got {cache_blocks!r}")
        if prefetched is not None:
            self._check_prefetched(prefetched, prompt)
        extras = encode_extra_keys(extra_keys)
        max_blocks = self._max_cached_blocks(max_cached_tokens)
        what = "prompt must be a sequence of token ids"
        sharing = self._sharing
        token_ids, tokens = None, b""
        if prompt is not None and sharing is None:
            check_token_ids(prompt, what)  # validated all the same; without a prefix cache it is not kept
        elif prompt is not None:
            token_ids, tokens = pack_token_ids(prompt, what)
        # ---- validated: nothing below can fail ----
        pool = self.pool
        record = SequenceRecord(seq_id, BlockTable(pool.block_size, self.num_sink_tokens), self.num_layers)
        record.extras = extras
        self._seqs[seq_id] = record
        num_hit = 0
        if sharing is not None and token_ids is not None:
            self._counters["prefix_queries"] += len(token_ids)
            num_hit = sharing.admit(record, token_ids, tokens, max_blocks, prefetched)
            self._counters["prefix_hits"] += num_hit
        if not cache_blocks:
            record.stop_keying()
        return num_hit

    def reserve(self, requests: Requests) -> Batch:
        """Reserve slots for new tokens of several sequences, all or nothing.

        First every block wholly outside each sequence's window (for its first
        new token) goes back to the pool; then shared (or prefix-keyed), partly
        filled last blocks are copied (copy-on-write); then new blocks are taken.

        Args:
            requests: ``{seq_id: num_new_tokens}`` (or ``(seq_id, n)`` pairs),
                each ``n >= 1``; a sequence may appear once. With prefix
                caching a sequence that caches its blocks gives its new
                tokens' ids instead (``{seq_id: [17, 4, 99]}``) so full blocks
                get keys (see ``add_sequence(..., cache_blocks=...)``).
                ``{}`` (or no pairs) is an empty step: it changes nothing and
                returns the empty batch (``num_seqs == num_tokens == 0``),
                which ``write`` and ``attend`` take with ``0``-token inputs,
                as ``can_reserve({})`` (True) promises.

        Returns:
            The :class:`~pagedkv.manager.reserve.Batch` to write and attend, every layer.

        Raises:
            UnknownSequenceError: an id is not known.
            DuplicateSequenceError: an id appears twice.
            ConfigError, InputTypeError: a count is not an int >= 1, or a
                sequence that caches its blocks got a count, not token ids.
            SequenceStateError: a sequence is preempted or swapped, or has
                reserved tokens some layer has not written yet.
            PoolExhaustedError: the pool cannot hold it; nothing changes.
        """
        # NOTE: reserve and write take the pool's lock inline rather than through
        # @locked: an engine calls both for every sequence every step, and the
        # decorator's extra frame costs about as much as the lock itself.
        with self.pool.lock:
            if requests.__class__ is dict and len(requests) == 1:
                for seq_id, value in requests.items():
                    batch = reserve_one(
                        self._seqs, seq_id, value, self.pool, self.max_size, self._sharing is not None
                    )
                    if batch is not None:
                        return batch
            return reserve_requests(
                self._seqs, requests, self.pool, self.max_size, self._sharing is not None, self._counters
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
        with self.pool.lock:  # inline, as in reserve
            self._write_layer(layer, batch, keys, values)

    def attend(
        self, layer: int, batch: Batch, queries: Any, *, method: str = "loop", scale: float | None = None
    ) -> npt.NDArray[Any]:
        """Attention of every new token of ``batch`` over its own sequence, in one call.

        Token at logical index ``p`` of a sequence attends to indices
        ``max(sinks, p - W + 1) .. p`` of that sequence (``W`` the layer's
        window) and to its sink tokens.

        Args:
            layer: the layer index; ``write`` must have stored this batch in it.
            batch: from ``reserve``.
            queries: ``(batch.num_tokens, num_q_heads, head_dim)``; a CPU torch
                tensor gives a torch tensor back.
            method: ``"loop"`` (one kernel call per sequence; the default,
                measured faster, see ``benchmarks/bench_manager.py``) or
                ``"padded"`` (one vectorized call for a batch of single-token
                decodes, padded to the longest; equal within tolerance).
            scale: multiplies every score in this call instead of the
                manager's ``scale`` (transformers passes one with each call).

        Returns:
            A new ``(batch.num_tokens, num_q_heads, head_dim)`` array (a torch
            tensor sharing its memory when ``queries`` is one).

        Raises:
            LayerIndexError, SequenceStateError, ShapeError, InputTypeError,
            NonFiniteError, ConfigError: bad arguments; nothing changes.
        """
        scale = self.scale if scale is None else check_scale(scale)
        # One sequence as reserve() returned it (every decode of one request): checked in one pass.
        out = self._attend_one_sequence(layer, batch, queries, method, scale, not self.trusted_inputs)
        if out is None:
            out = self._attend_layer(layer, batch, queries, method, scale)
        return like_input(queries, out)  # type: ignore[no-any-return]

    @locked
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
        self._seqs.check_new(child)
        check_settled(seq, "fork")
        twin = seq.fork(child)
        self.pool.allocator.share(seq.table.block_ids)
        self._seqs[child] = twin
        self._counters["forks"] += 1

    @locked
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
        released = seq.take_back_unwritten()
        if self._sharing is not None:
            # NOTE: unwritten tokens are never keyed, so nothing should go here;
            # the rule of truncate holds for every path that shortens a table.
            self._sharing.retract_truncated(seq, released)
        if released:
            self.pool.allocator.free(released)

    @locked
    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens of ``seq_id`` (speculative decoding's rollback).

        Every layer forgets the later tokens; blocks that then hold nothing go
        back to the pool, and with prefix caching a block that is no longer
        full loses its key (its free slots are about to be overwritten), as
        does a dropped block no other sequence holds. A partly kept block
        that another sequence still holds keeps its key (true for that one),
        and this sequence's next append copies it first, even after the
        others left: a keyed block is never written. All or nothing.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            InputTypeError, ConfigError: ``num_tokens`` is not an int in
                ``0 .. num_tokens(seq_id)``.
            SequenceStateError: the sequence is not running, some layer has
                not written tokens it would keep, or the next token would
                attend to tokens the window already evicted.
        """
        seq = self._get(seq_id)
        num_tokens = seq.check_truncate(num_tokens, self.max_size)
        if num_tokens == seq.table.num_tokens:
            return
        # ---- validated: nothing below can fail ----
        released = seq.truncate(num_tokens)
        if self._sharing is not None:
            self._sharing.retract_truncated(seq, released)
        self.pool.allocator.free(released)

    @locked
    def check_truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Raise what ``truncate(seq_id, num_tokens)`` would raise; change nothing.

        Raises:
            as ``truncate``.
        """
        self._get(seq_id).check_truncate(num_tokens, self.max_size)

    @locked
    def free(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` and give its blocks back, tail first.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known (or already freed).
        """
        seq = self._get(seq_id)
        release_record(seq, self.pool, self.host_pool)
        del self._seqs[seq_id]

    @locked
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
        preempt_record(self._get(seq_id), mode, self.pool, self.host_pool, self._counters)

    @locked
    def resume(self, seq_id: Hashable, *, max_cached_tokens: int | None = None) -> int:
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
            (a multiple of block_size, never all), else 0; at most
            ``max_cached_tokens`` (as for ``add_sequence``).

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            SequenceStateError: it is running already.
            PoolExhaustedError: (swapped) not enough free device blocks; nothing changes.
        """
        record = self._get(seq_id)
        max_blocks = self._max_cached_blocks(max_cached_tokens)
        return resume_record(record, self.pool, self.host_pool, self._sharing, self._counters, max_blocks)

    # ------------------------------------------------------- prefix caching

    @property
    def prefix_caching(self) -> bool:
        """Whether this manager runs prefix caching (``enable_prefix_caching``)."""
        return self._sharing is not None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The key -> block map of prefix caching (read it; do not change it), or None when off."""
        return self._sharing.cache if self._sharing is not None else None

    @property
    def kv_events(self) -> KVEventBuffer | None:
        """The KV event buffer (read its counts; take events with ``drain_kv_events``), or None when off."""
        return self._sharing.cache.events if self._sharing is not None else None

    @locked
    def drain_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last drain, oldest first (see :mod:`pagedkv.prefix.events`).

        After the buffer overflowed (or ``kv_events.request_resync()``), a
        resync instead: ``AllBlocksCleared``, then every keyed block, parents
        first. Applying every drain in order leaves a consumer's index equal
        to the prefix cache's keys, overflow or not.

        With ``tiers``, the tiers' ``BlockStored`` / ``BlockRemoved`` follow the
        pool's, each naming its tier in ``medium`` (``"CPU"``, ``"DISK"``,
        ``"REDIS"``; the pool's say ``"GPU"``); a resync covers the pool only.

        Raises:
            ConfigError: events are off (``kv_events=False``).
        """
        events = self.kv_events
        if events is None:
            raise ConfigError("KV events are off: pass enable_prefix_caching=True, kv_events=True")
        drained = events.drain()
        if self.tiering is not None:
            drained.extend(self.tiering.tiers.drain_events())
        return drained

    def flush_tiers(self) -> None:
        """Wait until every block offered to the tiers (evicted, or keyed under write-through) is stored.

        Without ``tiers``, or with a host tier alone, there is nothing to wait for.
        A store that is down makes each write fail within its timeout (counted
        in ``metrics().num_tier_errors``); this never raises for it.
        """
        if self.tiering is not None:
            self.tiering.flush()

    def prefetch(
        self,
        prompt: Sequence[int],
        *,
        extra_keys: ExtraKeys | None = None,
        max_cached_tokens: int | None = None,
    ) -> PendingLoad:
        """Start loading, off the step, the blocks of ``prompt`` past its device hit that the tiers hold.

        The request waits for its KV while the engine steps: the fetch runs on
        the tiers' worker thread (a host tier alone: here, a memcpy), takes no
        device block and holds no lock while a store answers. Then
        ``add_sequence(seq_id, prompt, extra_keys=..., prefetched=load)``
        copies what it fetched into fresh blocks under the lock, never waiting::

            load = manager.prefetch(prompt)          # starts the fetch
            if load.wait(timeout_s=0.5):             # or poll load.done() each step
                manager.add_sequence("r", prompt, prefetched=load)
            load.cancel()                            # or give up: admission computes it

        Raises:
            ConfigError: the manager has no ``tiers``.
            InputTypeError, ConfigError: a bad token id or extra key.
        """
        tiering, sharing = self.tiering, self._sharing
        if tiering is None or sharing is None:
            raise ConfigError("prefetch loads from tiers: pass tiers=TieredStore(...) to the manager")
        extras = encode_extra_keys(extra_keys)
        max_blocks = self._max_cached_blocks(max_cached_tokens)
        token_ids, tokens = pack_token_ids(prompt, "prompt must be a sequence of token ids")
        with self.pool.lock:
            keys = sharing.tier_keys(tokens, len(token_ids), extras, max_blocks)
        return tiering.prefetch(keys)   # NOTE: outside the lock: a host-only fetch copies here

    @locked
    def lookup(
        self,
        prompt: Sequence[int],
        *,
        extra_keys: ExtraKeys | None = None,
        max_cached_tokens: int | None = None,
    ) -> AdmissionPlan:
        """What admitting ``prompt`` would find cached and take, changing nothing.

        ``add_sequence(seq_id, prompt, extra_keys=...)`` then returns exactly
        ``num_cached_tokens``, and it with one ``reserve`` of the rest of the
        prompt takes exactly ``num_blocks_taken`` blocks, if nothing happens
        in between. The keys computed here are kept for that ``add_sequence``
        (each block is still hashed once). ``max_cached_tokens`` caps the hit
        as it does for ``add_sequence``.

        >>> from pagedkv import KVPool, KVCacheManager
        >>> manager = KVCacheManager(KVPool(8, block_size=2, head_dim=1), enable_prefix_caching=True)
        >>> plan = manager.lookup([1, 2, 3, 4, 5])
        >>> plan.num_cached_tokens, plan.num_new_blocks, plan.fits
        (0, 3, True)

        Raises:
            InputTypeError, ConfigError: a bad token id or extra key.
        """
        max_blocks = self._max_cached_blocks(max_cached_tokens)
        pool = self.pool
        return plan_admission(self._sharing, pool.allocator, prompt, extra_keys, pool.block_size, max_blocks)

    @locked
    def reset_prefix_cache(self) -> None:
        """Drop every block key; refused while any block is in use.

        Raises:
            ConfigError: prefix caching is off.
            SequenceStateError: blocks are in use (free every sequence first).
        """
        self._prefix_sharing().reset(self.pool.num_used_blocks)

    @locked
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache hit rates: since the start or the last reset, and over the last 1,000 requests.

        Raises:
            ConfigError: prefix caching is off.
        """
        counters = self._counters
        return self._prefix_sharing().stats.stats(counters["prefix_queries"], counters["prefix_hits"])

    @locked
    def reset_prefix_stats(self) -> None:
        """Start the hit counts again: ``prefix_stats`` and the prefix counters of ``metrics``.

        Raises:
            ConfigError: prefix caching is off.
        """
        self._prefix_sharing().stats.reset()
        for name in ("prefix_queries", "prefix_hits", "resumed_reuse"):
            self._counters[name] = 0

    # ------------------------------------------------------------- reporting

    @locked
    def metrics(self) -> ManagerMetrics:
        """A snapshot of usage, occupancy, fragmentation and event counts."""
        sharing = self._sharing
        counts = dict(
            self._counters,
            cached_blocks=sharing.cache.num_cached_blocks if sharing else 0,
            prefix_evictions=sharing.cache.num_evictions if sharing else 0,
            tier_hits=sharing.num_tier_hits if sharing else 0,
            tier_errors=self._num_tier_errors(),
        )
        return collect_metrics(self.pool, self.host_pool, list(self._seqs.values()), counts)

    @locked
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self.pool.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants()
        if self._sharing is not None:
            self._sharing.cache.check_invariants()
            self._sharing.stats.check_invariants()
            self._sharing.check_invariants(self._seqs.values())
        self._seqs.check_invariants(keyed=self._sharing is not None, has_host_pool=self.host_pool is not None)

    def __reduce__(self) -> NoReturn:
        refuse_pickling(self)

    # ------------------------------------------------- snapshot hooks (internal)

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
        return self._seqs.record(seq_id)

    def _max_cached_blocks(self, max_cached_tokens: int | None) -> int | None:
        """``max_cached_tokens`` as whole blocks (None: no cap).

        Raises:
            InputTypeError, ConfigError: not None or an int >= 0.
        """
        if max_cached_tokens is None:
            return None
        return check_count("max_cached_tokens", max_cached_tokens, minimum=0) // self.pool.block_size

    def _num_tier_errors(self) -> int:
        """Store calls that failed, values refused, and prefetches that raised or were late."""
        tiering = self.tiering
        if tiering is None:
            return 0
        tiers = tiering.tiers
        num_prefetch_errors = tiering.num_prefetch_failed + tiering.num_prefetch_late
        return tiers.num_store_errors + tiers.num_refused + num_prefetch_errors

    def _check_prefetched(self, prefetched: object, prompt: Sequence[int] | None) -> None:
        """Refuse a ``prefetched`` that is not a load this manager's ``prefetch`` started, or has no prompt.

        Raises:
            InputTypeError: not a PendingLoad.
            ConfigError: no tiers, no prompt, or another manager's load.
        """
        if not isinstance(prefetched, PendingLoad):
            raise InputTypeError(
                f"prefetched must be a PendingLoad from prefetch, got {type(prefetched).__name__}"
            )
        if self.tiering is None or prefetched.owner is not self.tiering:
            raise ConfigError(
                "prefetched is not a load of this manager's tiers; pass what its prefetch returned"
            )
        if prompt is None:
            raise ConfigError("prefetched needs the prompt it was started for; pass prompt=")

    def _prefix_sharing(self) -> PrefixSharing:
        if self._sharing is None:
            raise ConfigError("prefix caching is off for this manager")
        return self._sharing

    def _write_layer(self, layer: int, batch: Batch, keys: Any, values: Any) -> None:
        """``write``'s body (the caller holds ``pool.lock``): k/v at the batch's slots, then settle.

        Updates ``_max_abs_key[layer]``, each record's written count, and (with
        prefix caching) keys the blocks now full in every layer. ``_scan_index``
        is the value scan's scratch (``check_token_pair``'s ``index``), used
        only under that lock.

        NOTE: a decode batch (``Batch.for_token``) takes the first branch: the
        same checks as the general path below (the batch is the very one
        ``reserve`` returned for a running record, the layer is in range and
        unwritten, k/v have the right type, dtype, shape and values), each made
        once, in the order that finds the common case fastest; anything unusual
        falls through to the general path, which raises what is wrong. The
        token's row is copied by its slot. Each branch is tested against the
        other (tests/manager/test_speed_write.py).
        """
        pool = self.pool
        records = self._seqs
        sharing = self._sharing
        max_abs_key = self._max_abs_key
        token = batch._token if batch.__class__ is Batch else None
        num_layers = self.num_layers
        if token is not None:
            record = self._issued_record(batch, layer)
            position = token[1]
            if record is not None and record.num_written[layer] == position:
                key_row, value_row, largest_key = check_token_pair(  # flat rows, as write_token takes them
                    keys, values, pool.dtype, pool.token_shape, not self.trusted_inputs, self._scan_index,
                    True,
                )
                # ---- validated ----
                pool.write_token(layer, token[2], key_row, value_row)
                if largest_key > max_abs_key[layer]:
                    max_abs_key[layer] = largest_key
                end = record.num_written[layer] = position + 1
                if sharing is not None and end // pool.block_size > len(record.block_keys):
                    sharing.key_full_blocks(record)
                return
        if layer.__class__ is not int or not 0 <= layer < num_layers:
            check_layer(layer, num_layers)
        seqs = batch_records(records, batch)
        first_positions, counts = batch.first_positions, batch.num_new_tokens
        for seq, start in zip(seqs, first_positions):
            if seq.num_written[layer] != start:
                raise SequenceStateError(
                    f"layer {layer} of sequence {seq.seq_id!r} is already written for this batch"
                )
        expected = (counts[0] if len(counts) == 1 else sum(counts), pool.num_kv_heads, pool.head_dim)
        if not seqs:  # the empty step (reserve({})): nothing to store
            _check_no_tokens("keys", keys, pool.dtype, expected)
            _check_no_tokens("values", values, pool.dtype, expected)
            return
        key_array, value_array, largest_key = check_token_pair(
            keys, values, pool.dtype, expected, not self.trusted_inputs, self._scan_index
        )
        # ---- validated ----
        pieces = batch._slot_pieces()
        piece = pieces[0]
        if expected[0] == 1 and isinstance(piece, int):  # one token: copied by its slot
            pool.write_token(layer, piece, key_array.ravel(), value_array.ravel())
        elif len(pieces) == 1 and isinstance(piece, SlotRun) and not pool.quantized:  # a prefill: by blocks
            pool.write_run(layer, piece.block_ids, piece.offset, key_array, value_array)
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

    def _issued_record(self, batch: Batch, layer: int) -> SequenceRecord | None:
        """The fast paths' one check: the running record ``batch`` was issued for, or None.

        ``batch`` must be the very one-sequence batch ``reserve`` returned for
        a running record and ``layer`` an int in range; anything else is None,
        and the general path (``batch_records``, ``check_layer``) says what is
        wrong. ``_write_layer`` and ``_attend_one_sequence`` add only what
        each needs of the layer (unwritten, or written).
        """
        if batch.__class__ is not Batch or layer.__class__ is not int or not 0 <= layer < self.num_layers:
            return None
        seq_ids = batch.seq_ids
        if len(seq_ids) != 1:
            return None
        record = self._seqs.get(seq_ids[0])
        if record is None or record.batch is not batch or record.state is not RUNNING:
            return None
        return record

    def _attend_one_sequence(
        self, layer: int, batch: Batch, queries: Any, method: str, scale: float, scan: bool
    ) -> npt.NDArray[Any] | None:
        """``attend``'s fast path: a batch of one sequence (every decode of one request), or None.

        Returns the general path's result when every one of its checks passes
        on the common case: ``batch`` is the very object ``reserve`` returned
        for one running sequence, ``layer`` an int in range whose k/v are
        written and ``method`` known. The queries are checked by the same
        functions as the general path (``check_tokens``, then the score bound),
        so they raise its errors. Anything else returns None (nothing changes)
        and :meth:`_attend_layer` raises what is wrong. ``scan=False``
        (``trusted_inputs``) skips the value scan and the score bound.

        >>> import numpy as np
        >>> from pagedkv import KVPool, KVCacheManager
        >>> manager = KVCacheManager(KVPool(4, block_size=2, head_dim=1))
        >>> manager.add_sequence("s")
        0
        >>> batch = manager.reserve({"s": 1})
        >>> manager.write(0, batch, np.ones((1, 1, 1)), np.full((1, 1, 1), 7.0))
        >>> manager._attend_one_sequence(0, batch, np.ones((1, 1, 1)), "loop", 1.0, True).tolist()
        [[[7.0]]]
        """
        pool = self.pool
        if method != "loop" and method != "padded":
            return None
        record = self._issued_record(batch, layer)
        if record is None:
            return None
        table = record.table
        if record.num_written[layer] != table.num_tokens:
            return None
        dtype = pool.dtype
        expected = (batch.num_new_tokens[0], self.num_q_heads, pool.head_dim)
        query_array, largest = check_tokens("queries", queries, dtype, expected, scan)
        if scan:
            check_score_bound_from_max(scale, query_array, largest, self._max_abs_key[layer], dtype)
        return attend_sequence(pool, layer, table, self.layer_max_sizes[layer], query_array, scale)

    def _attend_layer(
        self, layer: int, batch: Batch, queries: Any, method: str, scale: float
    ) -> npt.NDArray[Any]:
        """``attend``'s general path: every check in the order its errors are meant to be found.

        Raises:
            LayerIndexError, SequenceStateError, ShapeError, InputTypeError,
            NonFiniteError, ConfigError: bad arguments, or the layer is not written; nothing changes.
        """
        pool = self.pool
        scan = not self.trusted_inputs
        check_layer(layer, self.num_layers)
        if method not in ("loop", "padded"):
            raise ConfigError(f"method must be 'loop' or 'padded', got {method!r}")
        seqs = batch_records(self._seqs, batch)
        for seq in seqs:
            if seq.num_written[layer] != seq.table.num_tokens:
                raise SequenceStateError(
                    f"sequence {seq.seq_id!r} has no k/v written in layer {layer} for this batch; "
                    "call write() first"
                )
        expected = (batch.num_tokens, self.num_q_heads, pool.head_dim)
        dtype = pool.dtype
        if not seqs:  # the empty step (reserve({})): no rows to attend
            _check_no_tokens("queries", queries, dtype, expected)
            return np.empty(expected, dtype)
        query_array, largest_query = check_tokens("queries", queries, dtype, expected, scan)
        if scan:
            check_score_bound_from_max(scale, query_array, largest_query, self._max_abs_key[layer], dtype)
        window = self.layer_max_sizes[layer]
        if len(seqs) == 1:  # one sequence: its attention is the whole output (no offsets, no copy)
            return attend_sequence(pool, layer, seqs[0].table, window, query_array, scale)
        tables = [seq.table for seq in seqs]
        if method == "padded" and len(query_array) == len(tables):  # one new token each: one padded call
            return attend_decode_padded(pool, layer, tables, window, query_array, scale)
        return attend_batch(pool, layer, tables, batch.query_start, window, query_array, scale)


def _check_no_tokens(name: str, value: Any, dtype: np.dtype[Any], expected: tuple[int, int, int]) -> None:
    """Check the input of an empty step: of shape ``expected``, ``(0, num_heads, head_dim)``.

    An array (or CPU tensor) of real numbers of exactly that shape passes: it
    holds no value to scan (``check_tokens`` refuses every empty array).
    Anything else gets ``check_tokens``' own error: a ShapeError for tokens
    the empty step has no slot for.

    Raises:
        ShapeError, InputTypeError, NonFiniteError: as :func:`~pagedkv.inputs.check_tokens`.

    >>> _check_no_tokens("q", np.empty((0, 2, 3)), np.dtype(np.float64), (0, 2, 3))
    """
    array = torch_array(name, value) if is_torch_tensor(value) else value
    if array.__class__ is np.ndarray and array.shape == expected and array.dtype.kind in "fiu":
        return
    if isinstance(array, np.ndarray) and array.size == 0 and array.ndim == 3 and array.shape != expected:
        raise ShapeError(
            f"{name} must have shape (num_tokens, num_heads, head_dim) = {expected}, got {array.shape}"
        )
    check_tokens(name, value, dtype, expected)  # raises: no other value fits an empty step


def _tiering(
    pool: KVPool, config: ManagerConfig, tiers: TieredStore, share_pool_with: KVCacheManager | None
) -> DeviceTiering:
    """How ``pool``'s evicted prefix blocks move to ``tiers`` (a worker thread when they have stores).

    Raises:
        InputTypeError: ``tiers`` is not a TieredStore.
        ConfigError: no prefix caching, a window, KV-cache groups, or tiers of another block layout.
    """
    if not isinstance(tiers, TieredStore):
        raise InputTypeError(f"tiers must be a pagedkv.tiers.TieredStore, got {type(tiers).__name__}")
    if not config.enable_prefix_caching:
        raise ConfigError("tiers keep prefix-cached blocks: pass enable_prefix_caching=True with tiers")
    if config.window is not None:
        raise ConfigError(f"tiers run with full attention only for now, got a window of {config.window} "
                          "tokens; drop max_size / layer_max_sizes or the tiers")
    if share_pool_with is not None or config.num_layers != pool.num_layers:
        raise ConfigError(f"tiers copy every layer of a block: use all {pool.num_layers} pool layers "
                          f"(got num_layers={config.num_layers}) and no share_pool_with (KV-cache groups)")
    # NOTE: a worker only when there are stores: a host-only tier is a memcpy, cheaper inline.
    return DeviceTiering(pool, tiers, TierWorker(tiers) if tiers.stores else None)


def _shared_prefix_sharing(pool: KVPool, other: KVCacheManager | None) -> PrefixSharing | None:
    """The prefix sharing of ``other`` (a manager on ``pool``) for a new one to run beside, or None.

    Raises:
        InputTypeError: ``other`` is not a KVCacheManager.
        ConfigError: it runs on another pool or without prefix caching.
    """
    if other is None:
        return None
    if not isinstance(other, KVCacheManager):
        raise InputTypeError(f"share_pool_with must be a KVCacheManager, got {type(other).__name__}")
    if other.pool is not pool or other._sharing is None:
        raise ConfigError("share_pool_with must be a prefix-caching manager on the same pool")
    return other._sharing


def _release_manager(
    pool: KVPool, host_pool: KVPool | None, records: SequenceRegistry, sharing: PrefixSharing | None
) -> None:
    """A dropped manager's finalizer: give every block back and close its prefix cache (never waits)."""
    device: list[int] = []
    host: list[int] = []
    for record in records.values():
        if record.state is SequenceState.RUNNING:
            device.extend(record.table.clear())
        elif record.state is SequenceState.SWAPPED:
            host.extend(record.table.clear())
    records.clear()

    def give_back() -> None:
        pool.allocator.free(device)
        if sharing is not None:
            sharing.cache.close()

    run_or_defer(pool, give_back)
    if host_pool is not None and host:
        run_or_defer(host_pool, lambda: host_pool.allocator.free(host))
