"""Snapshots: a ``KVCache`` or a whole ``KVCacheManager`` in one safetensors file, and back.

``save(obj, path)`` writes everything that decides later outputs and block
tables: the configuration, the allocator's ref counts and free queues (in
order), every block table, the prefix keys in LRU order, the counters, and
the pages in use (blocks some table holds or a prefix key can revive, never
the whole pool), of the device pool and of the host tier. ``load(path)``
builds a fresh object whose every later output is identical, bit for bit
(and with ``trust_cached_keys=True`` every later prefix hit too: by default
the keys of blocks no sequence holds are dropped, see
:mod:`~pagedkv.snapshot.prefix`).

* **Checksum**: SHA-256 over the format, version, state and every tensor's
  name, dtype, shape and bytes, so ``load`` tells a damaged file from a valid
  one. (It detects damage, not forgery: it is no signature.)
* **Atomic save**: a temporary file in the same folder, locked while it is
  written, fsync, rename over ``path``, fsync of the folder. A process
  killed mid-save leaves the previous snapshot intact; the next save of the
  same path removes the temporary files killed saves left (never one a live
  save still holds).
* **Validated load**: the header is checked against the file size and
  ``max_bytes`` before it is parsed, and what the pools will take at the
  peak (pages and bookkeeping of every block) before anything is allocated:
  a 1 KB file declaring 10^12 blocks is refused without allocating them.
  Then the state is validated whole (version, dtypes, shapes against the
  configuration, block ids in range, ref counts equal to the tables'
  counts, lengths within the pool, pages finite and within the recorded
  largest key, every prefix key recomputed from the token ids of a sequence
  holding its block, or dropped) before a pool is made. A failure raises
  :class:`~pagedkv.errors.SnapshotError` and touches nothing that exists.

The package, one concept a module, each importing only those above it:

* :mod:`~pagedkv.snapshot.schema`: the state's JSON form, its typed reader
  and the checks every load shares;
* :mod:`~pagedkv.snapshot.format`: the file (safetensors, checksum, atomic
  write, a read that checks the header first);
* :mod:`~pagedkv.snapshot.capture`: a live object's state and pages, through
  its ``_export_state`` hook; ``save``;
* :mod:`~pagedkv.snapshot.pools`: one saved pool (configuration, allocator
  state, pages), validated before it is built;
* :mod:`~pagedkv.snapshot.prefix`: the prefix keys a load believes;
* :mod:`~pagedkv.snapshot.restore`: validate everything, then build through
  each class's ``_restore_state`` hook; ``load``.

>>> import os, tempfile
>>> from pagedkv import KVCache
>>> cache = KVCache(max_size=4, block_size=2)
>>> outputs = [cache.attend([1.0], [0.5], [float(i)]) for i in range(6)]
>>> path = os.path.join(tempfile.mkdtemp(), "cache.safetensors")
>>> save(cache, path)
>>> twin = load(path)
>>> twin.attend([1.0], [0.5], [6.0]) == cache.attend([1.0], [0.5], [6.0])
True
>>> twin.block_ids == cache.block_ids
True
"""

from pagedkv.snapshot.capture import save
from pagedkv.snapshot.format import FORMAT, MAX_HEADER_BYTES, VERSION
from pagedkv.snapshot.restore import load

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "VERSION", "load", "save"]
