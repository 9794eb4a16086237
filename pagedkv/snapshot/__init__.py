"""Snapshots: a ``KVCache``, a whole ``KVCacheManager`` or ``HybridKVCacheManager`` in one file, and back.

``save(obj, path)`` writes everything that decides later outputs and block tables,
checksummed and atomically; ``load(path)`` validates the whole file before it allocates
anything, then builds an object whose every later output is identical, bit for bit. The
counterpart of llama.cpp's ``llama_state_seq_save_file``, for a whole manager. One concept
a module: ``schema`` (the JSON state), ``format`` (the file), ``capture`` (``save``),
``pools``, ``prefix`` (the keys a load believes), ``restore`` (``load``). The file, the
checks and the measurements: docs/snapshots.md.
"""

from pagedkv.snapshot.capture import save
from pagedkv.snapshot.format import FORMAT, MAX_HEADER_BYTES, VERSION
from pagedkv.snapshot.restore import load

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "VERSION", "load", "save"]
