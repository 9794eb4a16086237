"""Tiers below the device pool: a host tier and stores (files, Redis/Valkey) that keep evicted prefix blocks.

vLLM: the OffloadingConnector (CPU tier, ``BlockStored.medium``); SGLang: HiCache;
LMCache: its local and remote backends. ``codec`` (a block as bytes, its store key
and checked value), ``store`` (put / get / exists / delete backends), ``host`` (the
bounded host pool and its policies), ``tiered`` (the chain), ``worker`` (off the
step), ``hooks`` (what the manager calls). Imports: ``blocks``, ``memory``,
``prefix`` and the top-level helpers; the manager may import it, never the reverse.
"""

from pagedkv.tiers.codec import BlockLayout, RefusedValueError, decode_block, encode_block, store_key
from pagedkv.tiers.hooks import DeviceTiering
from pagedkv.tiers.host import HOST_POLICIES, HostTier
from pagedkv.tiers.store import FileStore, KVStore, RedisStore, StoreError
from pagedkv.tiers.tiered import MEDIUM_CPU, WRITE_POLICIES, TieredStore
from pagedkv.tiers.worker import PendingLoad, TierWorker

__all__ = [
    "HOST_POLICIES",
    "MEDIUM_CPU",
    "WRITE_POLICIES",
    "BlockLayout",
    "DeviceTiering",
    "FileStore",
    "HostTier",
    "KVStore",
    "PendingLoad",
    "RedisStore",
    "RefusedValueError",
    "StoreError",
    "TierWorker",
    "TieredStore",
    "decode_block",
    "encode_block",
    "store_key",
]
