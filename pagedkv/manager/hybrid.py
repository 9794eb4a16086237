"""``HybridKVCacheManager``: a block table per KV-cache group, one pool (vLLM: ``HybridKVCacheCoordinator``).

Each group (:mod:`pagedkv.manager.groups`) is run by a :class:`KVCacheManager`
of its own window over the shared pool, as vLLM's coordinator runs one
``SingleTypeKVCacheManager`` per group; this class keeps the groups in step:
a command reaches every group or none, and a prefix hit is the longest one
every group accepts. docs/groups.md explains the layout and the hit rule.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import numpy.typing as npt

from pagedkv.blocks.table import BlockTable
from pagedkv.counts import check_layer
from pagedkv.errors import (
    ConfigError,
    InputTypeError,
    PoolExhaustedError,
    SequenceStateError,
    refuse_pickling,
)
from pagedkv.manager.groups import GroupLayout
from pagedkv.manager.manager import KVCacheManager
from pagedkv.manager.metrics import ManagerMetrics
from pagedkv.manager.prefix_sharing import AdmissionPlan
from pagedkv.manager.reserve import Batch, Requests, ReservationPlan
from pagedkv.manager.sequence import ManagerState, SequenceState, check_settled, is_settled
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.events import KVEvent
from pagedkv.prefix.keys import ExtraKeys

__all__ = ["GroupBatch", "HybridKVCacheManager", "locate"]


class GroupBatch:
    """Slots reserved for new tokens in every group: one :class:`~pagedkv.manager.reserve.Batch` per group.

    Attributes:
        batches: each group's batch, in group order; they lay the tokens out
            alike (``seq_ids``, ``num_new_tokens``, ``query_start``), each
            with its own group's slots.
    """

    __slots__ = ("batches",)

    def __init__(self, batches: tuple[Batch, ...]) -> None:
        self.batches = batches

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The sequences, in the order their tokens are laid out."""
        return self.batches[0].seq_ids

    @property
    def num_new_tokens(self) -> tuple[int, ...]:
        """New tokens per sequence."""
        return self.batches[0].num_new_tokens

    @property
    def first_positions(self) -> tuple[int, ...]:
        """Logical index of each sequence's first new token."""
        return self.batches[0].first_positions

    @property
    def query_start(self) -> npt.NDArray[Any]:
        """``(num_seqs + 1,)`` offsets of each sequence's tokens (read-only)."""
        return self.batches[0].query_start

    @property
    def num_tokens(self) -> int:
        """New tokens across the whole batch."""
        return self.batches[0].num_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return self.batches[0].num_seqs

    def __repr__(self) -> str:
        return (
            f"GroupBatch(seq_ids={self.seq_ids!r}, num_new_tokens={self.num_new_tokens!r}, "
            f"groups={len(self.batches)})"
        )


class HybridKVCacheManager:
    """Sequences over one pool whose layers form KV-cache groups, each with its own block tables.

    Model layer ``l`` lives in group ``g`` at pool layer ``s`` (``layout.locate(l)``);
    a block belongs to one group at a time and holds that group's layers::

        Gemma 3 270M, 2,008 tokens, block_size 16, window 512:
            full group (3 layers)        126 blocks   every token
            5 sliding groups (3 layers)  33 blocks each: the window's blocks only

    >>> import numpy as np
    >>> from pagedkv import KVPool
    >>> layout = GroupLayout.from_layer_windows([2, None])  # layer 0: window 2; layer 1: full
    >>> manager = HybridKVCacheManager(KVPool(8, block_size=2, head_dim=1, num_layers=1), layout)
    >>> manager.add_sequence("a")
    0
    >>> batch = manager.reserve({"a": 5})
    >>> for layer in range(2):
    ...     manager.write(layer, batch, np.ones((5, 1, 1)), np.ones((5, 1, 1)))
    >>> _ = manager.reserve({"a": 1})  # the window group frees its two oldest blocks
    >>> [manager.block_table("a", group).num_blocks for group in range(2)]
    [3, 1]

    Invariants (``check_invariants``):
        * every group's manager holds its own invariants on the shared pool;
        * every group knows the same sequences, each in the same state with
          the same number of tokens;
        * with prefix caching, a block is keyed by one group at most.

    Threads: every command holds this manager's lock, so groups change
    together; the pool serves this manager alone (another manager taking
    its blocks between two groups' steps could split a reservation).

    Args:
        pool: the device pool; ``num_layers`` must be ``layout.layers_per_group``.
        layout: the groups (a :class:`GroupLayout`, or one window per model
            layer, None for full attention, grouped by
            ``GroupLayout.from_layer_windows``).
        num_q_heads, scale, host_pool, enable_prefix_caching, hash_algorithm,
            trusted_inputs, kv_events: as for :class:`KVCacheManager`, for
            every group (events carry their group).

    Raises:
        ConfigError, InputTypeError: an argument has the wrong type or value.
    """

    def __init__(
        self,
        pool: KVPool,
        layout: GroupLayout | Sequence[int | None],
        *,
        num_q_heads: int | None = None,
        scale: float = 1.0,
        host_pool: KVPool | None = None,
        enable_prefix_caching: bool = False,
        hash_algorithm: str = "sha256",
        trusted_inputs: bool = False,
        kv_events: bool | int = False,
    ) -> None:
        if not isinstance(layout, GroupLayout):
            layout = GroupLayout.from_layer_windows(layout)
        if not isinstance(pool, KVPool):
            raise InputTypeError(f"pool must be a KVPool, got {type(pool).__name__}")
        if pool.num_layers != layout.layers_per_group:
            raise ConfigError(
                f"the pool has {pool.num_layers} layers but each block holds a group of "
                f"{layout.layers_per_group}: create KVPool(..., num_layers={layout.layers_per_group})"
            )
        managers: list[KVCacheManager] = []
        for group in layout.groups:
            managers.append(
                KVCacheManager(
                    pool,
                    max_size=group.window,
                    num_sink_tokens=group.num_sink_tokens,
                    num_q_heads=num_q_heads,
                    scale=scale,
                    host_pool=host_pool,
                    enable_prefix_caching=enable_prefix_caching,
                    hash_algorithm=hash_algorithm,
                    trusted_inputs=trusted_inputs,
                    kv_events=kv_events,
                    num_layers=len(group.layers),
                    share_pool_with=managers[0] if managers and enable_prefix_caching else None,
                )
            )
        for index, manager in enumerate(managers):  # events say their group, as vLLM's do
            if manager.kv_events is not None:
                manager.kv_events.group_idx = index
        self.pool = pool
        self.host_pool = host_pool
        self.layout = layout
        #: One manager per group, in ``layout.groups`` order (read them; drive this manager).
        self.groups: tuple[KVCacheManager, ...] = tuple(managers)
        #: Model layers.
        self.num_layers = layout.num_layers
        self.num_q_heads = managers[0].num_q_heads
        self.scale = managers[0].scale
        # Model layer -> (group index, its pool layer): write and attend read it once a call.
        self._where = [layout.locate(layer) for layer in range(self.num_layers)]
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- queries

    @property
    def seq_ids(self) -> list[Hashable]:
        """Every known sequence id, in the order they were added."""
        return self.groups[0].seq_ids

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.groups[0]

    def state(self, seq_id: Hashable) -> SequenceState:
        """Where ``seq_id``'s blocks are."""
        return self.groups[0].state(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens reserved for ``seq_id`` so far, evicted ones included."""
        return self.groups[0].num_tokens(seq_id)

    def block_table(self, seq_id: Hashable, group: int = 0) -> BlockTable:
        """``seq_id``'s block table in ``group`` (read it; do not change it).

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
            LayerIndexError: ``group`` is out of range.
        """
        check_layer(group, len(self.groups))
        return self.groups[group].block_table(seq_id)

    def num_held_blocks(self, seq_id: Hashable | None = None) -> int:
        """Blocks held over every group: by ``seq_id``, or by every running sequence (shared ones once)."""
        if seq_id is not None:
            return sum(manager.block_table(seq_id).num_blocks for manager in self.groups)
        return self.pool.num_used_blocks

    def plan(self, requests: Requests) -> ReservationPlan:
        """What ``reserve(requests)`` would take and free over every group, without doing it.

        Raises:
            UnknownSequenceError, DuplicateSequenceError, ConfigError,
            SequenceStateError: as ``reserve`` would.
        """
        with self._lock:
            return self._plan(_stable(requests))[1]

    def can_reserve(self, requests: Requests) -> bool:
        """Whether ``reserve(requests)`` would succeed now."""
        return self.plan(requests).fits

    def lookup(self, prompt: Sequence[int], *, extra_keys: ExtraKeys | None = None) -> AdmissionPlan:
        """What admitting ``prompt`` would find cached (the hit every group accepts) and take; no change.

        Raises:
            InputTypeError, ConfigError: a bad token id or extra key.
        """
        with self._lock:
            num_hit = self._common_hit(prompt, extra_keys)
            plans = [
                manager.lookup(prompt, extra_keys=extra_keys, max_cached_tokens=num_hit)
                for manager in self.groups
            ]
        revived = tuple(block_id for plan in plans for block_id in plan.revived_block_ids)
        num_new = sum(plan.num_new_blocks for plan in plans)
        num_free = plans[0].num_free_blocks
        return AdmissionPlan(
            num_cached_tokens=num_hit,
            num_shared_blocks=sum(plan.num_shared_blocks for plan in plans),
            revived_block_ids=revived,
            num_new_blocks=num_new,
            num_free_blocks=num_free,
            fits=len(revived) + num_new <= num_free,
        )

    # --------------------------------------------------------------- commands

    def add_sequence(
        self,
        seq_id: Hashable,
        prompt: Sequence[int] | None = None,
        *,
        extra_keys: ExtraKeys | None = None,
        cache_blocks: bool = True,
    ) -> int:
        """Start a sequence in every group; with prefix caching, share the hit every group accepts.

        vLLM's rule: full attention bounds the hit; each sliding group
        accepts it when the blocks its window needs there are cached, or
        shrinks it to the longest it does accept, until no group shrinks it.

        Returns:
            How many leading prompt tokens are cached (in every group).

        Raises:
            as ``KVCacheManager.add_sequence``.
        """
        with self._lock:
            first = self.groups[0]
            num_hit = None
            if first.prefix_caching and prompt is not None:
                num_hit = self._common_hit(prompt, extra_keys)  # its lookups validate before any change
            added: list[KVCacheManager] = []
            try:
                for manager in self.groups:
                    found = manager.add_sequence(
                        seq_id,
                        prompt,
                        extra_keys=extra_keys,
                        cache_blocks=cache_blocks,
                        max_cached_tokens=num_hit,
                    )
                    added.append(manager)
            except BaseException:
                for manager in added:  # only the first group can refuse (the others see the same values)
                    manager.free(seq_id)
                raise
            return found

    def reserve(self, requests: Requests) -> GroupBatch:
        """Reserve slots for new tokens in every group, all or nothing.

        Each group first frees what its own window no longer needs; the
        groups that give blocks back reserve first, so the whole fits
        whenever the sum of the groups' needs does.

        Raises:
            as ``KVCacheManager.reserve``; PoolExhaustedError names the blocks
            every group together needs.
        """
        with self._lock:
            requests = _stable(requests)
            if self._surely_fits(requests):  # the common step: no plan needed, any order fits
                return GroupBatch(tuple(group.reserve(requests) for group in self.groups))
            plans, total = self._plan(requests)
            if not total.fits:
                raise PoolExhaustedError(
                    total.num_new_blocks,
                    total.num_free_blocks + total.num_released_blocks,
                    self.pool.num_blocks,
                    "free or preempt a sequence, reserve fewer tokens, or give the pool more blocks",
                )
            # ---- validated: each group's reservation fits in this order ----
            order = sorted(
                range(len(plans)),
                key=lambda index: plans[index].num_new_blocks - plans[index].num_released_blocks,
            )
            batches: list[Batch | None] = [None] * len(plans)
            for index in order:
                batches[index] = self.groups[index].reserve(requests)
            return GroupBatch(tuple(batches))  # type: ignore[arg-type]  # every entry filled

    def write(self, layer: int, batch: GroupBatch, keys: Any, values: Any) -> None:
        """Store model layer ``layer``'s k/v for every token of ``batch`` (in its group's blocks).

        Raises:
            LayerIndexError, SequenceStateError, ShapeError, InputTypeError,
            NonFiniteError: as ``KVCacheManager.write``.
        """
        index, slot = self._group_of(layer)
        self.groups[index].write(slot, _group_batch(batch, index), keys, values)

    def attend(
        self, layer: int, batch: GroupBatch, queries: Any, *, method: str = "loop", scale: float | None = None
    ) -> npt.NDArray[Any]:
        """Attention of model layer ``layer`` over each sequence's tokens its group sees.

        Raises:
            as ``KVCacheManager.attend``.
        """
        index, slot = self._group_of(layer)
        group_batch = _group_batch(batch, index)
        return self.groups[index].attend(slot, group_batch, queries, method=method, scale=scale)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Start ``child`` as a copy of ``parent`` in every group (copy-on-write per group).

        Raises:
            as ``KVCacheManager.fork``.
        """
        with self._lock:
            self._check_settled(parent, "fork")
            for manager in self.groups:
                manager.fork(parent, child)

    def cancel_reservation(self, seq_id: Hashable) -> None:
        """Take back ``seq_id``'s reserved tokens some layer (of any group) has not written.

        Raises:
            as ``KVCacheManager.cancel_reservation``.
        """
        with self._lock:
            for manager in self.groups:
                manager.cancel_reservation(seq_id)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens of ``seq_id`` in every group, all or nothing.

        Raises:
            as ``KVCacheManager.truncate``; a sliding group refuses a length
            whose next token would attend to tokens it already freed.
        """
        with self._lock:
            self.check_truncate(seq_id, num_tokens)
            # ---- validated in every group ----
            for manager in self.groups:
                manager.truncate(seq_id, num_tokens)

    def check_truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Raise what ``truncate(seq_id, num_tokens)`` would raise; change nothing.

        Raises:
            as ``truncate``.
        """
        for manager in self.groups:
            manager._get(seq_id).check_truncate(num_tokens, manager.max_size)

    def free(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` in every group and give its blocks back.

        Raises:
            UnknownSequenceError: ``seq_id`` is not known.
        """
        with self._lock:
            self.groups[0]._get(seq_id)
            for manager in self.groups:
                manager.free(seq_id)

    def preempt(self, seq_id: Hashable, mode: str = "recompute") -> None:
        """Take a running sequence's blocks away in every group; ``resume`` brings it back.

        Raises:
            as ``KVCacheManager.preempt``; (swap) PoolExhaustedError when the
            host pool cannot take every group's blocks, nothing changed.
        """
        with self._lock:
            first = self.groups[0]
            if mode == "swap":
                self._check_settled(seq_id, "swap out")
                if self.host_pool is not None:
                    needed = self.num_held_blocks(seq_id)
                    free = self.host_pool.num_free_blocks
                    if needed > free:
                        raise PoolExhaustedError(
                            needed, free, self.host_pool.num_blocks, "the host pool is full"
                        )
            first.preempt(seq_id, mode)  # refuses a bad mode or state with nothing changed
            for manager in self.groups[1:]:
                manager.preempt(seq_id, mode)

    def resume(self, seq_id: Hashable) -> int:
        """Bring a preempted or swapped sequence back in every group.

        Returns:
            Tokens it holds again (a recompute preemption: the prefix hit every
            group accepts).

        Raises:
            as ``KVCacheManager.resume``.
        """
        with self._lock:
            first = self.groups[0]
            state = first.state(seq_id)
            if state is SequenceState.RUNNING:
                return first.resume(seq_id)  # raises: running already
            cap = None
            if state is SequenceState.SWAPPED:
                needed = self.num_held_blocks(seq_id)
                if needed > self.pool.num_free_blocks:
                    raise PoolExhaustedError(needed, self.pool.num_free_blocks, self.pool.num_blocks)
            elif first.prefix_caching:
                history = first._get(seq_id).token_ids
                if history:
                    cap = self._common_hit(history, None)
            found = 0
            for manager in self.groups:
                found = manager.resume(seq_id, max_cached_tokens=cap)
            return found

    # ------------------------------------------------------- prefix caching

    @property
    def prefix_caching(self) -> bool:
        """Whether this manager runs prefix caching."""
        return self.groups[0].prefix_caching

    def drain_kv_events(self) -> list[tuple[int, KVEvent]]:
        """Every group's KV events since the last drain, as ``(group, event)`` pairs, group by group.

        ``BlockStored`` and ``BlockRemoved`` carry the group as ``group_idx`` too; the pair also
        places a group's ``AllBlocksCleared`` (a resync of that group alone).

        Raises:
            ConfigError: events are off.
        """
        with self._lock:
            return [
                (index, event)
                for index, manager in enumerate(self.groups)
                for event in manager.drain_kv_events()
            ]

    # ------------------------------------------------------------- reporting

    def metrics(self) -> list[ManagerMetrics]:
        """Each group's metrics: pool-wide counts are the shared pool's, the rest the group's tables."""
        with self._lock:
            return [manager.metrics() for manager in self.groups]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        with self._lock:
            first = self.groups[0]
            for index, manager in enumerate(self.groups):
                manager.check_invariants()
                if manager.seq_ids != first.seq_ids:
                    raise AssertionError(
                        f"group {index} knows sequences {manager.seq_ids}, group 0 {first.seq_ids}"
                    )
                for seq_id in first.seq_ids:
                    if (manager.state(seq_id), manager.num_tokens(seq_id)) != (
                        first.state(seq_id),
                        first.num_tokens(seq_id),
                    ):
                        raise AssertionError(f"sequence {seq_id!r} differs between group 0 and group {index}")
            if self.prefix_caching:
                keyed: set[int] = set()
                for index, manager in enumerate(self.groups):
                    cache = manager.prefix_cache
                    assert cache is not None
                    mine = {
                        block_id
                        for block_id in range(self.pool.num_blocks)
                        if cache.key_of(block_id) is not None
                    }
                    if keyed & mine:
                        raise AssertionError(
                            f"blocks {sorted(keyed & mine)} are keyed by two groups (one is {index})"
                        )
                    keyed |= mine

    def __reduce__(self) -> NoReturn:
        refuse_pickling(self)

    def locate(self, layer: int) -> tuple[KVCacheManager, int]:
        """The group's manager and the pool layer that hold model layer ``layer``.

        Raises:
            LayerIndexError: ``layer`` is not a model layer.
        """
        index, slot = self._group_of(layer)
        return self.groups[index], slot

    # ---------------------------------------------------------------- private

    def _group_of(self, layer: int) -> tuple[int, int]:
        """``(group index, pool layer)`` of model layer ``layer``.

        Raises:
            LayerIndexError: ``layer`` is not a model layer.
        """
        if layer.__class__ is not int or not 0 <= layer < self.num_layers:
            check_layer(layer, self.num_layers)
        return self._where[layer]

    def _surely_fits(self, requests: Requests) -> bool:
        """Whether every group's reservation of ``requests`` must succeed, whatever the order.

        True when each sequence is known and settled in every group (so no
        group can refuse what the first accepted) and the free blocks cover
        the most any group could take: per sequence, the blocks of its new
        tokens plus one copy on write. Anything else (a bad request included)
        is False, and ``reserve`` plans every group first.
        """
        pairs = requests.items() if isinstance(requests, dict) else requests
        block_size, bound = self.pool.block_size, 0
        try:
            for seq_id, value in pairs:
                count = value if isinstance(value, int) else len(value)
                if count < 1:
                    return False
                for group in self.groups:
                    record = group._seqs.get(seq_id)
                    if record is None or not is_settled(record):
                        return False
                bound += -(-count // block_size) + 1
        except (TypeError, ValueError):
            return False
        return bound * len(self.groups) <= self.pool.num_free_blocks

    def _plan(self, requests: Requests) -> tuple[list[ReservationPlan], ReservationPlan]:
        """Each group's plan and their sum (validation errors come from the first group)."""
        plans = [manager.plan(requests) for manager in self.groups]
        num_new = sum(plan.num_new_blocks for plan in plans)
        num_released = sum(plan.num_released_blocks for plan in plans)
        num_free = plans[0].num_free_blocks
        total = dataclasses.replace(
            plans[0],
            num_new_blocks=num_new,
            num_released_blocks=num_released,
            fits=num_new <= num_free + num_released,
            steps=tuple(step for plan in plans for step in plan.steps),
        )
        return plans, total

    def _check_settled(self, seq_id: Hashable, action: str) -> None:
        """Refuse ``action`` unless ``seq_id`` is running and every model layer wrote its tokens."""
        for index, manager in enumerate(self.groups):
            record = manager._get(seq_id)
            try:
                check_settled(record, action)
            except SequenceStateError as error:
                if record.state is not SequenceState.RUNNING:
                    raise
                layers = [self.layout.groups[index].layers[slot] for slot in record.pending_layers()]
                raise SequenceStateError(
                    f"cannot {action} sequence {seq_id!r}: layers {layers} have not written its newest tokens"
                ) from error

    def _common_hit(self, prompt: Sequence[int], extra_keys: ExtraKeys | None) -> int:
        """The longest cached prefix of ``prompt`` every group accepts, in tokens (vLLM's fixed point)."""
        cap: int | None = None
        while True:
            found = cap
            for manager in self.groups:
                hit = manager.lookup(prompt, extra_keys=extra_keys, max_cached_tokens=found).num_cached_tokens
                found = hit if found is None else min(found, hit)
            if found == cap:
                return found or 0
            cap = found

    def _export_state(self) -> list[ManagerState]:
        """Each group's ``KVCacheManager._export_state()``, in group order: the snapshot hook (copies)."""
        with self._lock:
            return [manager._export_state() for manager in self.groups]

    def _restore_state(self, states: Sequence[ManagerState]) -> None:
        """Take each group's state (``_export_state``'s, validated by the caller) into this new manager."""
        with self._lock:
            for manager, state in zip(self.groups, states, strict=True):
                manager._restore_state(state)


def _stable(requests: Requests) -> Requests:
    """``requests`` as a dict every group can read (pairs are read once); validated by the groups."""
    if isinstance(requests, dict):
        return requests
    try:
        return list(requests)
    except TypeError:
        return requests


def _group_batch(batch: object, index: int) -> Batch:
    if isinstance(batch, GroupBatch):
        return batch.batches[index]
    raise InputTypeError(f"batch must be the GroupBatch reserve() returned, got {type(batch).__name__}")


def locate(manager: KVCacheManager | HybridKVCacheManager, layer: int) -> tuple[KVCacheManager, int]:
    """The manager and pool layer holding ``layer`` of either kind of manager (a plain one holds all).

    >>> from pagedkv import KVPool
    >>> plain = KVCacheManager(KVPool(2, block_size=1, head_dim=1, num_layers=2))
    >>> locate(plain, 1) == (plain, 1)
    True
    """
    if isinstance(manager, HybridKVCacheManager):
        return manager.locate(layer)
    return manager, layer
