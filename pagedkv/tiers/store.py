"""The store tier: one small interface (put / get / exists / delete, bytes by key) and its backends.

``FileStore`` keeps each value in a file of a directory (atomic: written to a
temporary file, then renamed), bounded in total size; ``RedisStore`` keeps them
in a Redis or Valkey server through the ``redis`` client (extra ``store``).
LMCache's storage backends (local disk, Redis, Valkey) play this part; so do
SGLang HiCache's storage backends. A backend that fails raises
:class:`StoreError`; the tiers above count it and treat it as a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pagedkv.counts import check_count
from pagedkv.errors import ConfigError, InputTypeError, PagedKVError

__all__ = ["MEDIUM_DISK", "MEDIUM_REDIS", "FileStore", "KVStore", "RedisStore", "StoreError"]

#: The medium a KV event names for each backend (vLLM's ``BlockStored.medium``).
MEDIUM_DISK = "DISK"
MEDIUM_REDIS = "REDIS"


class StoreError(PagedKVError, OSError):
    """A store could not answer: its server is down or slow, its disk full or unreadable."""


@runtime_checkable
class KVStore(Protocol):
    """Bytes by key. A missing key is ``None`` from ``get``; a failure raises :class:`StoreError`.

    A store may drop any value at any time (evicted for room): callers treat
    every value as a hint and check it (:func:`~pagedkv.tiers.codec.decode_block`).
    """

    #: The tier's name in KV events: ``"DISK"``, ``"REDIS"``...
    medium: str

    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any)."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None."""
        ...

    def exists(self, key: bytes) -> bool:
        """Whether ``key`` holds a value now (it may be gone by the next call)."""
        ...

    def delete(self, key: bytes) -> None:
        """Drop ``key``'s value, if any."""
        ...


# ---------------------------------------------------------------- files

class FileStore:
    """Values as files in one directory, at most ``max_bytes`` in all; the oldest go first.

    A value is written to a temporary file in the same directory and renamed
    over its name (``os.replace``, atomic on POSIX): a reader sees the whole old
    value, the whole new one, or none, and a writer killed mid-way leaves only
    a temporary file, which is never read (and is removed on the next open).
    The size index lives in memory and is rebuilt from the directory when a
    store opens it; the files are the truth, the index only decides eviction.

    Invariants:
        * ``num_bytes`` is the sum of the indexed sizes and at most ``max_bytes``
          (after each ``put`` by this object);
        * every indexed name was written by this object or found on open.

    >>> import tempfile
    >>> store = FileStore(tempfile.mkdtemp(), max_bytes=10)
    >>> store.put(b"a", b"123456"); store.put(b"b", b"7890")
    >>> store.put(b"c", b"xyz")  # 13 > 10: the oldest ("a") goes
    >>> store.get(b"a"), store.get(b"c"), store.num_bytes
    (None, b'xyz', 7)
    """

    medium = MEDIUM_DISK

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int) -> None:
        """Use (and create) ``directory``; hold at most ``max_bytes`` of values.

        Raises:
            ConfigError, InputTypeError: ``max_bytes`` is not an int >= 1.
            StoreError: the directory cannot be made or read.
        """
        self.max_bytes = check_count("max_bytes", max_bytes)
        self.directory = Path(directory)
        self._lock = threading.Lock()
        # name -> size, oldest first (by modification time on open, then by put)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.num_bytes = 0
        #: Values dropped to make room, and values refused as larger than ``max_bytes``.
        self.num_evictions = 0
        self.num_refused = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = []
            for entry in os.scandir(self.directory):
                if entry.name.startswith(".tmp"):
                    os.unlink(entry.path)  # a writer died mid-way
                elif entry.is_file():
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, entry.name, stat.st_size))
        except OSError as error:
            raise StoreError(f"file store {str(self.directory)!r} cannot be opened: {error}") from error
        for _, name, size in sorted(found):
            self._sizes[name] = size
            self.num_bytes += size

    @staticmethod
    def _name(key: bytes) -> str:
        # NOTE: a hash of the key, not the key: keys may be long and hold any byte.
        return hashlib.blake2b(key, digest_size=20).hexdigest()

    def put(self, key: bytes, value: bytes) -> None:
        """Write ``value`` under ``key`` atomically, dropping the oldest values past ``max_bytes``.

        A value larger than ``max_bytes`` is not stored (counted in ``num_refused``).

        Raises:
            StoreError: the file cannot be written (nothing is left behind).
        """
        _check_key(key)
        name = self._name(key)
        if len(value) > self.max_bytes:
            self.num_refused += 1
            return
        with self._lock:
            self._make_room(len(value) - self._sizes.get(name, 0))
            temporary = ""
            try:
                fd, temporary = tempfile.mkstemp(prefix=".tmp", dir=self.directory)
                with os.fdopen(fd, "wb") as file:
                    file.write(value)
                os.replace(temporary, self.directory / name)
            except OSError as error:
                if temporary:
                    _unlink_quietly(temporary)
                raise StoreError(
                    f"file store {str(self.directory)!r}: cannot write a value: {error}"
                ) from error
            self.num_bytes += len(value) - self._sizes.pop(name, 0)
            self._sizes[name] = len(value)

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None (never written, evicted, or removed by another process).

        Raises:
            StoreError: the file exists but cannot be read.
        """
        _check_key(key)
        try:
            return (self.directory / self._name(key)).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"file store {str(self.directory)!r}: cannot read a value: {error}") from error

    def exists(self, key: bytes) -> bool:
        """Whether a file holds ``key``'s value now."""
        _check_key(key)
        return (self.directory / self._name(key)).is_file()

    def delete(self, key: bytes) -> None:
        """Remove ``key``'s file, if any."""
        _check_key(key)
        name = self._name(key)
        with self._lock:
            _unlink_quietly(self.directory / name)
            self.num_bytes -= self._sizes.pop(name, 0)

    def _make_room(self, num_bytes: int) -> None:
        while self._sizes and self.num_bytes + num_bytes > self.max_bytes:
            name, size = self._sizes.popitem(last=False)
            _unlink_quietly(self.directory / name)
            self.num_bytes -= size
            self.num_evictions += 1

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        if self.num_bytes != sum(self._sizes.values()):
            raise AssertionError(f"num_bytes {self.num_bytes}, the index adds to {sum(self._sizes.values())}")
        if self.num_bytes > self.max_bytes:
            raise AssertionError(f"{self.num_bytes} bytes held, bound {self.max_bytes}")


def _unlink_quietly(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise InputTypeError(f"a store key must be bytes, got {key!r} ({type(key).__name__})")


# ---------------------------------------------------------------- Redis / Valkey

class RedisStore:
    """Values in a Redis or Valkey server, through the standard ``redis`` client (extra ``store``).

    Every connect and every command has a timeout and no retry, so a server
    that is down or slow costs at most ``timeout_s`` and raises
    :class:`StoreError`. After a failure the store stays *down* for
    ``retry_after_s``: calls raise at once, without touching the network, so a
    dead server costs one timeout, not one per block. A value the server
    evicted (``maxmemory``) is simply a miss.

    Args:
        host, port: the server (``127.0.0.1``; another machine by configuration only).
        timeout_s: the bound on connecting and on each command.
        retry_after_s: how long a failure keeps the store down.
        ttl_s: expire values after this many seconds (None: the server's eviction alone).
        prefix: prepended to every key (a namespace on a shared server).

    Raises:
        ImportError: the ``redis`` package is missing (``pip install "pagedkv[store]"``).
        ConfigError: a timeout is not > 0.
    """

    medium = MEDIUM_REDIS

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        *,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        ttl_s: float | None = None,
        prefix: bytes = b"",
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as error:
            raise ImportError('RedisStore needs the redis package: pip install "pagedkv[store]"') from error
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"ttl_s must be None or a number of seconds > 0, got {ttl_s!r}")
        self.host, self.port = host, port
        self.timeout_s, self.retry_after_s, self.ttl_s = float(timeout_s), float(retry_after_s), ttl_s
        self.prefix = prefix
        self._client: Any = redis.Redis(
            host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._down_until = 0.0
        #: Calls that failed (the server down, slow or refusing), and calls refused while down.
        self.num_errors = 0
        self.num_skipped = 0

    def _call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < self._down_until:
            self.num_skipped += 1
            raise StoreError(f"redis {self.host}:{self.port} is down (a call failed less than "
                             f"{self.retry_after_s} s ago); {what} skipped")
        try:
            return getattr(self._client, what)(*args, **kwargs)
        except self._errors as error:
            self.num_errors += 1
            self._down_until = time.monotonic() + self.retry_after_s
            raise StoreError(f"redis {self.host}:{self.port}: {what} failed within {self.timeout_s} s: "
                             f"{error}") from error

    def put(self, key: bytes, value: bytes) -> None:
        """``SET`` ``value`` under ``key`` (with the TTL, if any)."""
        _check_key(key)
        ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        self._call("set", self.prefix + key, value, px=ttl_ms)

    def get(self, key: bytes) -> bytes | None:
        """``GET`` ``key``: its value, or None."""
        _check_key(key)
        value = self._call("get", self.prefix + key)
        return None if value is None else bytes(value)

    def exists(self, key: bytes) -> bool:
        """``EXISTS`` ``key``."""
        _check_key(key)
        return bool(self._call("exists", self.prefix + key))

    def delete(self, key: bytes) -> None:
        """``DEL`` ``key``."""
        _check_key(key)
        self._call("delete", self.prefix + key)

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()
