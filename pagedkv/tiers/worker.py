"""Loads and stores off the step: one worker thread per tiered store, a pending load per waiting request.

vLLM: the OffloadingConnector's worker-side transfer handlers (async loads, a
request waiting for its KV); SGLang: HiCache's prefetch and write-back threads.
A load that fails, times out or is cancelled yields no blocks: the request
recomputes its prefix, so a slow tier costs time, never a wrong output.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pagedkv.tiers.codec import Payload
from pagedkv.tiers.tiered import TieredStore

__all__ = ["PendingLoad", "TierWorker"]


class PendingLoad:
    """The blocks of one request's prefix, on their way from the tiers.

    ``payloads`` never raises: a failed, cancelled or late load gives ``[]``
    (recompute); a partial one gives the leading blocks it found.
    """

    def __init__(self, future: Future[list[bytes]], keys: Sequence[bytes], worker: TierWorker) -> None:
        self._future = future
        self._worker = worker
        #: The prefix keys asked for, in order.
        self.keys = list(keys)

    def done(self) -> bool:
        """Whether the load finished (or failed, or was cancelled): ``payloads`` will not wait."""
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the load if it has not started; True if cancelled (``payloads`` then gives ``[]``)."""
        return self._future.cancel()

    def payloads(self, timeout_s: float | None = None) -> list[bytes]:
        """The leading payloads found, waiting at most ``timeout_s`` (None: no bound); ``[]`` on a failure."""
        try:
            return self._future.result(timeout=timeout_s)
        except (CancelledError, FutureTimeout):
            self._worker._count_failure()
            return []
        except Exception:  # NOTE: any failure of a tier means recompute, never a crash of the step
            self._worker._count_failure()
            return []


class TierWorker:
    """One thread that runs a :class:`TieredStore`'s loads and stores in order of submission.

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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tiers")
        self._lock = threading.Lock()
        #: Loads that gave no blocks because they failed, timed out or were cancelled.
        self.num_failed_loads = 0

    def load(self, keys: Sequence[bytes]) -> PendingLoad:
        """Start fetching the longest run of ``keys`` the tiers hold."""
        keys = list(keys)
        return PendingLoad(self._executor.submit(self.tiers.fetch, keys), keys, self)

    def offer(self, prefix_key: bytes, payload: Payload) -> None:
        """Queue ``tiers.offer`` of a copy of ``payload`` (the caller's buffer may be reused at once)."""
        self._executor.submit(self.tiers.offer, prefix_key, bytes(payload))

    def write_through(self, prefix_key: bytes, payload: Payload) -> None:
        """Queue ``tiers.write_through`` of a copy of ``payload``."""
        self._executor.submit(self.tiers.write_through, prefix_key, bytes(payload))

    def flush(self) -> None:
        """Wait until everything submitted so far has run."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> TierWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count_failure(self) -> None:
        with self._lock:
            self.num_failed_loads += 1
