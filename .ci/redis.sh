#!/usr/bin/env bash
# The Redis server the store-tier tests start on 127.0.0.1 (tests/support/redis_server.py),
# and the Python client (the "store" extra). Debian's package: a maintained 7.x server;
# the tests start their own on a free port, so the service apt may start is not used.
set -euo pipefail
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
fi
redis-server --version
