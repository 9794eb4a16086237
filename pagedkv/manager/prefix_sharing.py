"""Admission and prefix sharing: starting a sequence from its prompt's cached blocks, keying full ones.

:mod:`pagedkv.prefix.cache` maps keys to blocks and knows nothing of sequences;
this module joins it to the manager's records (vLLM: ``get_computed_blocks`` and
``cache_full_blocks``; :func:`plan_admission` is ``get_num_blocks_to_allocate``)::

    prompt  [t0 .. t15 | t16 .. t31 | t32 t33]     block_size 16
    keys     k0         k1 = H(k0, t16..t31)        (the partial block has no key)
    lookup   k0 hit, k1 hit  -> share 2 blocks, the caller computes t32 on
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable
from pagedkv.counts import ceil_div
from pagedkv.errors import SequenceStateError
from pagedkv.manager.config import ManagerConfig
from pagedkv.manager.sequence import SequenceRecord, SequenceState
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import (
    ROOT_KEY,
    PrefixCache,
    block_keys,
    check_token_ids,
    hash_function,
    pack_token_ids,
)
from pagedkv.prefix.events import KVEventBuffer
from pagedkv.prefix.keys import ExtraKeys, decode_extra_keys, encode_extra_keys
from pagedkv.prefix.stats import HitWindow
from pagedkv.tiers.hooks import DeviceTiering
from pagedkv.tiers.worker import PendingLoad

__all__ = ["AdmissionPlan", "PrefixSharing", "plan_admission"]


class _KeyMemo:
    """The last prompt hashed from scratch: ``(extras, its packed full blocks, their keys)``, or None."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple[bytes, bytes, list[bytes]] | None = None


class PrefixSharing:
    """One manager's prefix cache and the rules that tie it to sequences.

    Invariants (``check_invariants``, over the manager's running records):
        * a key names its block's contents: a held block among a record's
          first ``len(block_keys)`` logical blocks has no key or that key;
        * a keyed block is never written: a table may hold a keyed block
          partly (``truncate`` cut into it while another table held it full,
          and the key stayed true for that one), and then its next append
          copies it first, whatever its ref count by then
          (``BlockAllocator.must_copy_before_append``).

    NOTE: truncation drops the key of a block it leaves partly held only
    when no other table holds it (then it is about to be overwritten in
    place); a key still true for another holder stays, and the truncated
    table never writes into the block. Dropping the key instead when the
    last full holder leaves would need to know which tables hold a block
    fully, which the allocator's ref counts do not say::

        block_size 2         a: [1 2] [3 4]   b: [1 2] [3 4] [5]   (block 1 keyed, ref count 2)
        truncate(a, 3)       a: [1 2] [3 .]   key of block 1 stays: b holds it full
        free(b)              block 1: ref count 1, keyed, held partly by a
        reserve(a, [9])      a copies block 1 first; block 1 waits, still keyed, in the cached free queue

    Args:
        pool: the device pool (its allocator's blocks are keyed).
        config: the manager's configuration: its sink tokens (sink blocks are
            always shared), the window that frees blocks, its layers (a hit
            counts as written in every one), the block hash's name and the
            bound of the KV event buffer (none when 0).
        share_with: the prefix sharing of another KV-cache group on the same pool:
            its cache runs beside this one's, and a prompt's keys are hashed once for both.

    Raises:
        ConfigError: an unknown hash, or the allocator already runs a prefix cache.
        ImportError: ``"xxh3_128"`` without the ``xxhash`` extra.
    """

    def __init__(self, pool: KVPool, config: ManagerConfig, share_with: PrefixSharing | None = None) -> None:
        allocator = pool.allocator
        self._hash_algorithm = config.hash_algorithm
        self._hasher = hash_function(config.hash_algorithm)
        self._allocator = allocator
        self._block_size = pool.block_size
        self._num_sink_tokens = config.num_sink_tokens
        self._window = config.window
        self._num_layers = config.num_layers
        #: The key -> block map itself.
        beside: PrefixCache | None = None if share_with is None else share_with.cache
        self.cache: PrefixCache = PrefixCache(allocator, share_with=beside)
        self.cache.events = (
            KVEventBuffer(config.kv_events, sliding_window=config.window) if config.kv_events else None
        )
        #: Hit rates, cumulative and over the most recent requests.
        self.stats = HitWindow()
        #: The tiers below the pool (``KVCacheManager(tiers=...)``), or None; see :meth:`attach_tiers`.
        self.tiering: DeviceTiering | None = None
        #: Prompt tokens loaded from the tiers (each also counted as a prefix hit).
        self.num_tier_hits = 0
        # The last prompt hashed from scratch; shared with the KV-cache groups beside this one
        # (same pool, same hash: the same keys), so a hybrid admission hashes each block once.
        self._memo: _KeyMemo = _KeyMemo()
        if share_with is not None and share_with._hash_algorithm == config.hash_algorithm:
            self._memo = share_with._memo

    def attach_tiers(self, tiering: DeviceTiering) -> None:
        """Evicted keyed blocks go to ``tiering``; admissions look past the device hit into it.

        NOTE: full attention only (the manager refuses tiers with a window):
        a windowed hit needs only the blocks its window reaches (``find_hit``),
        which a run of keys from the first does not describe.
        """
        self.tiering = tiering
        self.cache.on_evict_key = tiering.evicted

    def tier_run(self, keys: list[bytes], num_device_blocks: int, max_blocks: int | None) -> list[str]:
        """The medium of each block past a device hit of ``num_device_blocks`` that the tiers hold (a run).

        Empty without tiers or with a window. Changes nothing but the tiers' error counts.
        """
        if self.tiering is None or self._window is not None:
            return []
        end = len(keys) if max_blocks is None else min(len(keys), max_blocks)
        if num_device_blocks >= end:
            return []
        return self.tiering.extend_hit(keys[num_device_blocks:end])

    def tier_keys(self, tokens: bytes, num_tokens: int, extras: bytes, max_blocks: int | None) -> list[bytes]:
        """The keys of a prompt's blocks past its device hit (``KVCacheManager.prefetch``); changes nothing.

        ``tokens`` is ``token_bytes`` of the ``num_tokens`` prompt tokens. No
        tier is asked (no store call under the pool's lock): the prefetch
        fetches the longest run of these that the tiers hold.
        """
        if self.tiering is None or self._window is not None:
            return []
        num_usable = max(0, (num_tokens - 1) // self._block_size)
        keys = self.prompt_keys([], tokens, num_usable, extras)
        end = len(keys) if max_blocks is None else min(len(keys), max_blocks)
        num_blocks = self.find_hit(keys[:end])[0]
        return keys[num_blocks:end]

    def reset(self, num_used_blocks: int) -> None:
        """Drop every key (``KVCacheManager.reset_prefix_cache``); refused while blocks are in use.

        Raises:
            SequenceStateError: ``num_used_blocks`` blocks are in use.
        """
        if num_used_blocks:
            raise SequenceStateError(
                f"{num_used_blocks} blocks are in use; free every sequence before a reset"
            )
        self.cache.reset()

    def prompt_keys(self, known: list[bytes], tokens: bytes, num_usable: int, extras: bytes) -> list[bytes]:
        """Keys of the first ``num_usable`` full blocks of ``tokens``; ``known`` leading keys are reused.

        The last lookup's keys are remembered (one entry), so ``lookup`` then
        ``add_sequence`` of the same prompt hashes each block once.
        """
        keys = known[:num_usable]
        if len(keys) >= num_usable:
            return keys
        bs = self._block_size
        step = 8 * bs
        memo = self._memo.entry
        if (
            memo is not None and not keys and memo[0] == extras and len(memo[2]) >= num_usable
            and tokens[: step * num_usable] == memo[1][: step * num_usable]
        ):
            return memo[2][:num_usable]
        parent = keys[-1] if keys else ROOT_KEY
        keys += block_keys(
            parent, tokens[step * len(keys) : step * num_usable], bs, extras, self._hasher, len(keys)
        )
        if not known:
            self._memo.entry = (extras, tokens[: step * num_usable], keys)
        return keys

    def find_hit(self, keys: list[bytes]) -> tuple[int, int, list[int]]:
        """Where a prompt with block ``keys`` would start: ``(hit blocks, window start, held ids)``.

        Without a window the hit is the longest run of cached keys from the
        first. With a window ``W`` a prompt of ``n`` blocks needs only what its
        next token attends to: the sink blocks and the blocks from its window
        start on (vLLM's sliding-window rule); the largest such ``n`` wins, and
        the blocks before the window need not be cached at all::

            block_size 2, W 3, keys k0 k1 k2 k3, cached: _ _ k2 k3  (k0, k1 evicted)
            n = 4: the next token (index 8) attends 6..8: block 3 only -> hit 4 blocks

        Changes nothing.
        """
        bs, sinks, window = self._block_size, self._num_sink_tokens, self._window
        if window is None:  # the longest run from the first key, which stops at the first miss
            hit = self.cache.longest_prefix(keys)
            return (len(hit), min(sinks, len(hit) * bs), hit) if hit else (0, sinks, [])
        found = [self.cache.block_for(key) for key in keys]
        # run[i]: how many cached blocks end at block i, consecutively.
        run, length = [], 0
        for block_id in found:
            length = length + 1 if block_id is not None else 0
            run.append(length)
        lead = next((i for i, block_id in enumerate(found) if block_id is None), len(found))
        num_sink_blocks = ceil_div(sinks, bs)
        for num_hit in range(len(found), 0, -1):
            num_tokens = num_hit * bs
            window_start = min(max(sinks, num_tokens + 1 - window), num_tokens)
            num_sinks = min(num_sink_blocks, num_hit)
            first = max(num_sinks, window_start // bs)
            if lead >= num_sinks and (first >= num_hit or run[num_hit - 1] >= num_hit - first):
                held = [*found[:num_sinks], *found[first:num_hit]]
                return num_hit, window_start, held  # type: ignore[return-value]  # all cached: ints
        return 0, sinks, []

    def admit(
        self,
        record: SequenceRecord,
        token_ids: list[int],
        tokens: bytes,
        max_blocks: int | None = None,
        prefetched: PendingLoad | None = None,
    ) -> int:
        """Share the cached prefix of new ``record``'s prompt (``add_sequence``); return its cached tokens.

        The same as :meth:`share_cached_prefix`, and the request counts in ``stats``.
        """
        num_hit = self.share_cached_prefix(record, token_ids, tokens, max_blocks, prefetched)
        self.stats.record(len(token_ids), num_hit)
        return num_hit

    def share_cached_prefix(
        self,
        record: SequenceRecord,
        token_ids: list[int],
        tokens: bytes,
        max_blocks: int | None = None,
        prefetched: PendingLoad | None = None,
    ) -> int:
        """Share the cached blocks a prompt of ``token_ids`` starts from into ``record``; return its tokens.

        ``max_blocks`` caps the hit (the longest hit every KV-cache group accepts).
        Past the device hit, the tiers' blocks come from ``prefetched`` when
        given (only what it fetched, for exactly these keys: no store call
        here), else from the tiers, synchronously.

        ``record`` must hold no blocks. ``tokens`` is ``token_bytes(token_ids)``.
        Keys ``record`` already has (``block_keys``, then ``prompt_keys``: a
        sequence resumed after a recompute preemption) must be keys of
        ``token_ids``' leading blocks; they are used, not hashed again. Every
        other usable block is hashed here, once: the keys past the hit stay
        in ``record.prompt_keys`` until their blocks are written.

        NOTE: the whole chain is computed (a key proves its entire prefix),
        but with a sliding window only the sink blocks and the blocks the next
        token's window reaches are shared (see ``find_hit``): blocks that slid
        out of the window are not needed and stay free for others.
        """
        bs = self._block_size
        num_usable = (len(token_ids) - 1) // bs  # always leave the last token to compute
        known = record.block_keys + record.prompt_keys
        keys = self.prompt_keys(known, tokens, num_usable, record.extras)
        reference = tokens if len(tokens) >= len(record.prompt_tokens) else (
            tokens + record.prompt_tokens[len(tokens) :]
        )
        chain = keys if len(keys) >= len(known) else known
        num_blocks, window_start, held = self.find_hit(keys if max_blocks is None else keys[:max_blocks])
        record.block_keys = keys[:num_blocks]
        record.prompt_keys = chain[num_blocks:]
        record.prompt_tokens = reference if record.prompt_keys else b""
        payloads = None
        if prefetched is not None and self.tiering is not None:
            end = len(keys) if max_blocks is None else min(len(keys), max_blocks)
            payloads = self.tiering.take(prefetched, keys[num_blocks:end])
            num_tier_found = len(payloads)
        else:
            num_tier_found = len(self.tier_run(keys, num_blocks, max_blocks))
        if not num_blocks and not num_tier_found:
            return 0
        allocator = self._allocator
        for block_id in held:
            if allocator.ref_count(block_id) == 0:
                allocator.revive(block_id)
            else:
                allocator.share([block_id])
        loaded = self._load_from_tiers(keys[num_blocks : num_blocks + num_tier_found], payloads)
        num_device_blocks, num_blocks = num_blocks, num_blocks + len(loaded)
        num_hit = num_blocks * bs
        if not num_hit:
            return 0
        if loaded:
            window_start = min(self._num_sink_tokens, num_hit)  # full attention: tiers run without a window
            record.block_keys = keys[:num_blocks]
            record.prompt_keys = chain[num_blocks:]
            record.prompt_tokens = reference if record.prompt_keys else b""
        record.table = BlockTable.restored(bs, self._num_sink_tokens, num_hit, window_start, [*held, *loaded])
        record.num_written = [num_hit] * self._num_layers
        record.token_ids = token_ids[:num_hit]
        if loaded:
            self._register(record, range(num_device_blocks, num_blocks))
            self.num_tier_hits += len(loaded) * bs
        return num_hit

    def _load_from_tiers(self, keys: list[bytes], payloads: list[bytes] | None = None) -> list[int]:
        """Load the blocks of ``keys`` (a run the tiers hold) into fresh device blocks; their ids.

        ``payloads``: the blocks' checked bytes, fetched already (a prefetch);
        None fetches them now. Takes only as many blocks as are free; blocks
        whose load failed (the store went down, a value did not check) go
        back, and the caller computes from the first of them on.
        """
        tiering, allocator = self.tiering, self._allocator
        if tiering is None or not keys:
            return []
        block_ids = allocator.allocate(min(len(keys), allocator.num_free_blocks))
        if payloads is None:
            num_loaded = tiering.load(keys[: len(block_ids)], block_ids)
        else:
            num_loaded = tiering.load_payloads(payloads[: len(block_ids)], block_ids)
        allocator.free(block_ids[num_loaded:][::-1])
        return block_ids[:num_loaded]

    def key_full_blocks(self, record: SequenceRecord) -> None:
        """Give keys to ``record``'s blocks that are full and written in every layer.

        A block's key is its prompt key when admission computed one, else it
        is hashed now: each block is hashed once.
        """
        if record.token_ids is None:
            return
        bs = self._block_size
        first = len(record.block_keys)
        num_full = min(record.num_written) // bs
        if num_full <= first:
            return
        pending = record.prompt_keys
        new_keys = pending[: num_full - first]
        if new_keys:
            del pending[: len(new_keys)]
            if not pending:
                record.prompt_tokens = b""
        num_ready = first + len(new_keys)
        if num_ready < num_full:
            parent = new_keys[-1] if new_keys else record.block_keys[-1] if record.block_keys else ROOT_KEY
            # ids reserve (or add_sequence) validated: their bytes alone are wanted (token_bytes' rule)
            tokens = array("q", record.token_ids[num_ready * bs : num_full * bs]).tobytes()
            new_keys += block_keys(parent, tokens, bs, record.extras, self._hasher, num_ready)
        record.block_keys.extend(new_keys)
        self._register(record, range(first, num_full))
        tiering = self.tiering
        if tiering is not None and tiering.tiers.write_policy == "write_through":
            block_ids = record.table.ids_of_blocks(range(first, num_full))
            written = [(b, k) for b, k in zip(block_ids, new_keys) if b is not None]
            tiering.keyed([b for b, _ in written], [k for _, k in written])

    def retract_truncated(self, record: SequenceRecord, released: list[int]) -> None:
        """After ``record.truncate``, drop the keys its rollback made untrue or unowned.

        The block now holding the newest token is no longer full: its key goes
        unless another sequence still holds it. A kept key stays true, for the
        block is never written under it: the next append of ``record`` copies
        it first, even once the others have left (see the class docstring). A
        released block loses its key when no one else holds it. Call before
        freeing ``released``.
        """
        allocator, cache = self._allocator, self.cache
        table = record.table
        tail = [table.last_block_id] if table.num_blocks and table.num_tokens % self._block_size else []
        for block_id in [*released, *tail]:
            if allocator.ref_count(block_id) == 1:
                cache.forget(block_id)

    def check_invariants(self, records: Iterable[SequenceRecord]) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken for ``records``.

        Args:
            records: every record of the manager (only running ones hold device blocks).
        """
        cache, allocator, bs = self.cache, self._allocator, self._block_size
        for record in records:
            if record.state is not SequenceState.RUNNING:
                continue
            table = record.table
            name = f"sequence {record.seq_id!r}"
            logical_blocks = range(len(record.block_keys))
            for logical_block, block_id in zip(logical_blocks, table.ids_of_blocks(logical_blocks)):
                key = None if block_id is None else cache.key_of(block_id)
                if key is not None and key != record.block_keys[logical_block]:
                    raise AssertionError(
                        f"{name}: block {block_id} (logical block {logical_block}) is keyed for "
                        "other contents than the sequence wrote there: a keyed block was written"
                    )
            if not table.num_blocks or not table.num_tokens % bs:
                continue
            last = table.last_block_id
            if cache.key_of(last) is not None and not allocator.must_copy_before_append(last):
                raise AssertionError(
                    f"{name} holds keyed block {last} partly and would append into it without a copy"
                )

    def rekey_restored(self, record: SequenceRecord) -> None:
        """After a swap-in, key the restored full blocks whose keys are free again."""
        self._register(record, range(len(record.block_keys)))

    def _register(self, record: SequenceRecord, logical_blocks: range) -> None:
        """Key ``record``'s held blocks among ``logical_blocks`` whose keys are free; report the runs.

        With events on, each run of consecutive newly keyed blocks is one
        ``BlockStored``, whose parent is the key of the block before it.
        """
        keys = record.block_keys[logical_blocks.start : logical_blocks.stop]
        stored = self.cache.register_blocks(record.table.ids_of_blocks(logical_blocks), keys)
        if self.cache.events is None:
            return
        run: list[int] = []
        for logical_block, fresh in zip(logical_blocks, stored):
            if fresh:
                run.append(logical_block)
                continue
            self._report(record, run)
            run = []
        self._report(record, run)

    def _report(self, record: SequenceRecord, run: list[int]) -> None:
        events = self.cache.events
        if events is None or not run:
            return
        bs = self._block_size
        first, end = run[0], run[-1] + 1
        token_ids = [] if record.token_ids is None else record.token_ids[first * bs : end * bs]
        events.stored(
            record.block_keys[first:end],
            record.block_keys[first - 1] if first else None,
            token_ids,
            block_size=bs,
            adapter=self._adapter(record),
        )

    @staticmethod
    def _adapter(record: SequenceRecord) -> str | int | None:
        adapter = decode_extra_keys(record.extras).get("adapter") if record.extras else None
        return adapter if isinstance(adapter, (str, int)) else None


# ------------------------------------------------------------------ looking before admitting


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
        num_tier_blocks: blocks past the device hit that the tiers below the
            pool hold (``KVCacheManager(tiers=...)``); admitting loads them
            into new blocks (counted in ``num_new_blocks``) and counts their
            tokens in ``num_cached_tokens``. A load may still fail (the store
            went down, evicted or damaged a value): then admission computes them.
    """

    num_cached_tokens: int
    num_shared_blocks: int
    revived_block_ids: tuple[int, ...]
    num_new_blocks: int
    num_free_blocks: int
    fits: bool
    num_tier_blocks: int = 0

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
    max_blocks: int | None = None,
) -> AdmissionPlan:
    """``KVCacheManager.lookup``: the admission of ``prompt`` as ``add_sequence`` would do it; change nothing.

    Raises:
        InputTypeError, ConfigError: a bad token id or extra key.
    """
    extras = encode_extra_keys(extra_keys)
    what = "prompt must be a sequence of token ids"
    held: list[int] = []
    num_hit = num_tier = 0
    if sharing is None:
        check_token_ids(prompt, what)
    else:
        token_ids, tokens = pack_token_ids(prompt, what)
        num_usable = max(0, (len(token_ids) - 1) // block_size)
        keys = sharing.prompt_keys([], tokens, num_usable, extras)
        num_hit, _, held = sharing.find_hit(keys if max_blocks is None else keys[:max_blocks])
        num_tier = len(sharing.tier_run(keys, num_hit, max_blocks))
    revived = tuple(block_id for block_id in held if allocator.ref_count(block_id) == 0)
    num_new = ceil_div(len(prompt), block_size) - num_hit
    num_free = allocator.num_free_blocks
    num_tier = min(num_tier, num_free - len(revived))
    return AdmissionPlan(
        num_cached_tokens=(num_hit + num_tier) * block_size,
        num_shared_blocks=len(held),
        revived_block_ids=revived,
        num_new_blocks=num_new,
        num_free_blocks=num_free,
        fits=len(revived) + num_new <= num_free,
        num_tier_blocks=max(0, num_tier),
    )
