"""A throwaway Redis (or Valkey) server on 127.0.0.1 for the store tests; skips when none is installed.

Debian's ``redis-server`` (``apt-get install redis-server``, what .ci/redis.sh installs) or
``valkey-server`` on ``PATH``. No persistence (``--save ""``, no AOF): each server starts empty
and leaves nothing behind.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = ["RedisServer", "redis_server"]


class RedisServer:
    """A running server: its port, and ``stop`` (which kills it, as a crash would)."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port

    def stop(self) -> None:
        """Kill the server (SIGKILL) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _binary() -> str:
    pytest.importorskip("redis", reason='the redis client is not installed: pip install "pagedkv[store]"')
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip("no redis-server or valkey-server on PATH (bash .ci/redis.sh installs one)")


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    """Start a server on a free loopback port, wait until it answers PING, and kill it after."""
    import redis

    binary = _binary()
    for _ in range(3):  # another process may take the free port between probe and bind
        port = _free_port()
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--logfile", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        server = RedisServer(process, port)
        client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.RedisError:
                time.sleep(0.02)
        client.close()
        if process.poll() is None and time.monotonic() < deadline:
            try:
                yield server
            finally:
                server.stop()
            return
        server.stop()
    pytest.fail(f"{binary} did not start on 127.0.0.1 in three tries")
