"""The narrow surface the manager calls: device blocks in and out of the tiers, by prefix key.

vLLM: the scheduler side of a KV connector (``get_num_new_matched_tokens``,
``update_state_after_alloc``) and the worker side's block copies: ``evicted``
(a keyed block is about to be reused), ``keyed`` (write-through),
``extend_hit`` (how far past the device hit the tiers reach), ``load`` (their
bytes into freshly allocated device blocks), and ``prefetch`` / ``take`` (the
same load split in two: fetched off the step, copied in at admission).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from pagedkv.errors import ConfigError
from pagedkv.memory.pool import KVPool
from pagedkv.tiers.codec import load_block, read_block
from pagedkv.tiers.tiered import TieredStore
from pagedkv.tiers.worker import PendingLoad, TierWorker

__all__ = ["DeviceTiering"]


class DeviceTiering:
    """Moves whole blocks between one device pool and a :class:`TieredStore`.

    >>> import numpy as np
    >>> from pagedkv.tiers.codec import BlockLayout
    >>> from pagedkv.tiers.host import HostTier
    >>> pool = KVPool(4, block_size=2, head_dim=2, dtype=np.float32)
    >>> layout = BlockLayout.of_pool(pool, "m")
    >>> host = HostTier(block_nbytes=layout.block_nbytes, num_blocks=8)
    >>> tiering = DeviceTiering(pool, TieredStore(layout, host=host))
    >>> pool.key_pages(0)[1] = 7.0
    >>> tiering.evicted(1, b"k0")            # block 1 held prefix key k0 and is about to be reused
    >>> tiering.extend_hit([b"k0", b"k1"])
    ['CPU']
    >>> tiering.load([b"k0"], [3]), float(pool.key_pages(0)[3, 0, 0, 0])
    (1, 7.0)
    """

    def __init__(self, pool: KVPool, tiers: TieredStore, worker: TierWorker | None = None) -> None:
        """Tier ``pool``'s blocks through ``tiers``.

        With ``worker`` (on the same ``tiers``), ``evicted`` and ``keyed`` copy
        the block and queue the store writes on its thread, so no store call
        runs under the pool's lock; ``extend_hit`` first waits for what was
        queued (``flush``), so a block offered is found.

        Raises:
            ConfigError: ``tiers``' layout is not ``pool``'s block layout.
        """
        nbytes = read_block(pool, 0).nbytes
        if tiers.layout.block_nbytes != nbytes or tiers.layout.block_size != pool.block_size:
            raise ConfigError(f"tiers of {tiers.layout}, but the pool's blocks are {nbytes} bytes "
                              f"of {pool.block_size} tokens")
        if worker is not None and worker.tiers is not tiers:
            raise ConfigError("the worker runs another TieredStore than the one given")
        self.pool = pool
        self.tiers = tiers
        self.worker = worker
        #: Prefetches started; blocks admissions took from them; prefetches that
        #: gave no blocks because they raised, were not done when admitted (late),
        #: were cancelled, or fetched keys other than those the prompt needed (stale).
        self.num_prefetches = 0  # counted under _lock: prefetch runs outside the pool's lock
        self._lock = threading.Lock()
        self.num_prefetched_blocks = 0
        self.num_prefetch_failed = 0
        self.num_prefetch_late = 0
        self.num_prefetch_cancelled = 0
        self.num_prefetch_stale = 0

    def evicted(self, block_id: int, prefix_key: bytes) -> None:
        """The prefix cache evicts keyed ``block_id``: offer its bytes (before anything overwrites them)."""
        payload = read_block(self.pool, block_id)
        if self.worker is not None:
            self.worker.offer(prefix_key, payload)
        else:
            self.tiers.offer(prefix_key, payload)

    def keyed(self, block_ids: Sequence[int], prefix_keys: Sequence[bytes]) -> None:
        """Blocks just got their keys (written in every layer): under write-through, store them now."""
        if self.tiers.write_policy != "write_through":
            return
        write = self.tiers.write_through if self.worker is None else self.worker.write_through
        for block_id, prefix_key in zip(block_ids, prefix_keys):
            write(prefix_key, read_block(self.pool, block_id))

    def extend_hit(self, keys_past_device_hit: Sequence[bytes]) -> list[str]:
        """The medium of each block the tiers hold of the keys after the device hit (a run from the first)."""
        self.flush()
        return self.tiers.find(keys_past_device_hit)

    def flush(self) -> None:
        """Wait until every queued offer and write-through has run (nothing to wait for without a worker)."""
        if self.worker is not None:
            self.worker.flush()

    def load(self, prefix_keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Fetch ``prefix_keys``' blocks into ``block_ids`` (freshly allocated, same order); how many loaded.

        Loads the longest run the tiers return and check; the blocks after it
        are untouched, for the caller to recompute (and free if unneeded).

        Raises:
            ConfigError: ``block_ids`` is shorter than ``prefix_keys``.
        """
        if len(block_ids) < len(prefix_keys):
            raise ConfigError(
                f"{len(prefix_keys)} keys to load into {len(block_ids)} blocks; give one block each"
            )
        payloads = self.tiers.fetch(prefix_keys)
        for block_id, payload in zip(block_ids, payloads):
            load_block(self.pool, block_id, payload)
        return len(payloads)

    def load_payloads(self, payloads: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Copy ``payloads`` (checked blocks a prefetch fetched) into ``block_ids`` (same order); how many."""
        for block_id, payload in zip(block_ids, payloads):
            load_block(self.pool, block_id, payload)
        return min(len(block_ids), len(payloads))

    # ---------------------------------------------------------------- off the step

    def prefetch(self, prefix_keys: Sequence[bytes]) -> PendingLoad:
        """Start fetching the longest run of ``prefix_keys`` the tiers hold; the caller holds no lock.

        On the worker thread when there is one (after the writes queued before
        it, so a block just offered is found); a host tier alone is a memcpy,
        done here at once. Takes no device block.
        """
        keys = list(prefix_keys)
        with self._lock:
            self.num_prefetches += 1
        if self.worker is not None and keys:
            return self.worker.load(keys, owner=self)
        future: Future[list[bytes]] = Future()
        try:
            future.set_result(self.tiers.fetch(keys) if keys else [])
        except Exception as error:  # NOTE: any failure of a tier means recompute, never a crash
            future.set_exception(error)
        return PendingLoad(future, keys, owner=self)

    def take(self, pending: PendingLoad, prefix_keys: Sequence[bytes]) -> list[bytes]:
        """The payloads ``pending`` fetched for the leading run of ``prefix_keys``; never waits.

        A load that failed, is not done (it is cancelled: the prompt computes
        those tokens now), was cancelled, or fetched none of the first key
        gives ``[]``, and is counted by why. Call under the pool's lock.
        """
        status = pending.status
        if status == "pending":
            pending.cancel()
            self.num_prefetch_late += 1
            return []
        if status == "cancelled":
            self.num_prefetch_cancelled += 1
            return []
        if status == "failed":
            self.num_prefetch_failed += 1
            return []
        payloads = pending.take(prefix_keys)
        if prefix_keys and not payloads and pending.take(pending.keys):
            self.num_prefetch_stale += 1
        self.num_prefetched_blocks += len(payloads)
        return payloads
