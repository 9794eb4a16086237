"""Loads and stores off the step: one worker thread per tiered store, a pending load per waiting request.

vLLM: the OffloadingConnector's worker-side transfer handlers (async loads, a
request waiting for its KV); SGLang: HiCache's prefetch and write-back threads.
A load that fails, times out or is cancelled yields no blocks: the request
recomputes its prefix, so a slow tier costs time, never a wrong output.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from pagedkv.tiers.codec import Payload
from pagedkv.tiers.tiered import TieredStore

__all__ = ["PendingLoad", "TierWorker"]


class PendingLoad:
    """The blocks of one prompt's prefix past its device hit, on their way from the tiers (off the step).

    ``KVCacheManager.prefetch`` starts one; ``add_sequence(..., prefetched=)``
    takes its blocks (vLLM: a request waiting for remote KV; SGLang: HiCache's
    prefetch). Its life::

        pending --fetch returns--> ready (payloads of the leading keys found)
           |    --fetch raises---> failed (no blocks)
           +--cancel()-----------> cancelled (no blocks, from any state)

    Nothing here raises for a tier's failure, and nothing waits unbounded
    unless asked (``wait(None)``): a failed, cancelled or late load gives no
    blocks, and the prompt's tokens are computed.

    Invariants:
        * a cancelled load never hands out a block (``take`` gives ``[]``);
        * every payload handed out is for the key at the same place in
          ``keys`` (a key proves its whole prefix, so it is the right KV).
    """

    def __init__(self, future: Future[list[bytes]], keys: Sequence[bytes], owner: object = None) -> None:
        """A load of ``keys`` running as ``future``, made by ``owner`` (whose manager alone may take it)."""
        self._future = future
        self._cancelled = False
        #: The prefix keys asked for, in order (a run of a prompt's chained block keys).
        self.keys = list(keys)
        #: What started the load (a :class:`~pagedkv.tiers.hooks.DeviceTiering`), or None.
        self.owner = owner

    @property
    def status(self) -> str:
        """``"pending"``, ``"ready"``, ``"failed"`` or ``"cancelled"`` (see the class docstring)."""
        if self._cancelled or self._future.cancelled():
            return "cancelled"
        if not self._future.done():
            return "pending"
        return "failed" if self._future.exception() is not None else "ready"

    def done(self) -> bool:
        """Whether the load finished, failed or was cancelled: ``take`` and ``payloads`` will not wait."""
        return self.status != "pending"

    def cancel(self) -> bool:
        """Give up the load: its blocks are never used; True if it was dropped before it ran."""
        self._cancelled = True
        return self._future.cancel()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the load is done, at most ``timeout_s`` seconds (None: no bound); whether it is."""
        if not self.done():
            futures_wait([self._future], timeout=timeout_s)
        return self.done()

    def payloads(self, timeout_s: float | None = None) -> list[bytes]:
        """The leading payloads found, waiting at most ``timeout_s`` (None: no bound); ``[]`` unless ready."""
        self.wait(timeout_s)
        return self.take(self.keys)

    def take(self, keys: Sequence[bytes]) -> list[bytes]:
        """Payloads of the longest run of ``keys``, from the first, that this load fetched; never waits.

        ``[]`` unless the load is ready. ``keys`` may start anywhere in
        ``self.keys`` (the device hit grew since the load started) and may
        go past its end (those blocks are computed).

        >>> from concurrent.futures import Future
        >>> future: Future[list[bytes]] = Future()
        >>> load = PendingLoad(future, [b"k0", b"k1", b"k2"])
        >>> future.set_result([b"p0", b"p1"])           # k2 was not in any tier
        >>> load.take([b"k1", b"k2"]), load.take([b"k0"]), load.take([b"x", b"k1"])
        ([b'p1'], [b'p0'], [])
        """
        if self.status != "ready":
            return []
        found = dict(zip(self.keys, self._future.result()))
        run: list[bytes] = []
        for key in keys:
            payload = found.get(key)
            if payload is None:
                break
            run.append(payload)
        return run


class TierWorker:
    """Two threads for a :class:`TieredStore`: one runs its writes in order, one its loads in order.

    NOTE: loads have a thread of their own so that ``flush`` (which a
    synchronous admission calls under the pool's lock) waits for the writes
    alone, never behind a prefetch stalled on a slow store; a load still
    starts only after the writes queued before it, so a block just offered is
    found::

        writes:  offer k0 | offer k1 | write_through k2 ...      flush waits here
        loads:            (wait for offer k1) fetch [k0, k1] ...

    >>> from pagedkv.tiers.codec import BlockLayout
    >>> from pagedkv.tiers.host import HostTier
    >>> tiers = TieredStore(BlockLayout("m", 1, 1, 1, 1, "float32", None, None, 0, 2),
    ...                     host=HostTier(block_nbytes=2, num_blocks=2))
    >>> with TierWorker(tiers) as worker:
    ...     worker.offer(b"k", b"ab")
    ...     worker.load([b"k", b"j"]).payloads(timeout_s=5)
    [b'ab']
    """

    def __init__(self, tiers: TieredStore) -> None:
        self.tiers = tiers
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tier-writes")
        self._loads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tier-loads")
        self._lock = threading.Lock()
        self._last_write: Future[None] | None = None
        #: Loads that gave no blocks because they raised or were cancelled before they ran.
        self.num_failed_loads = 0

    def load(self, keys: Sequence[bytes], owner: object = None) -> PendingLoad:
        """Start fetching the longest run of ``keys`` the tiers hold, after every write queued so far."""
        keys = list(keys)
        with self._lock:
            after = self._last_write
        future = self._loads.submit(self._fetch_after, after, keys)
        future.add_done_callback(self._count_if_failed)
        return PendingLoad(future, keys, owner)

    def offer(self, prefix_key: bytes, payload: Payload) -> None:
        """Queue ``tiers.offer`` of a copy of ``payload`` (the caller's buffer may be reused at once)."""
        with self._lock:  # submitted and remembered at once, so the last write remembered is the last queued
            self._last_write = self._writes.submit(self.tiers.offer, prefix_key, bytes(payload))

    def write_through(self, prefix_key: bytes, payload: Payload) -> None:
        """Queue ``tiers.write_through`` of a copy of ``payload``."""
        with self._lock:
            self._last_write = self._writes.submit(self.tiers.write_through, prefix_key, bytes(payload))

    def flush(self) -> None:
        """Wait until every write submitted so far has run (not the loads: each has its ``PendingLoad``)."""
        with self._lock:
            last = self._last_write
        if last is not None:
            futures_wait([last])

    def close(self) -> None:
        """Finish what was submitted, then stop the threads."""
        self._writes.shutdown(wait=True)
        self._loads.shutdown(wait=True)

    def __enter__(self) -> TierWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fetch_after(self, write: Future[None] | None, keys: list[bytes]) -> list[bytes]:
        if write is not None:
            futures_wait([write])
        return self.tiers.fetch(keys)

    def _count_if_failed(self, future: Future[list[bytes]]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                self.num_failed_loads += 1
