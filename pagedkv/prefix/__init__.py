"""Prefix caching: block keys, the index of cached blocks, hit statistics and KV events.

vLLM: ``kv_cache_utils.py`` (block hashes) and ``block_pool.py``'s cached-block map;
SGLang: ``mem_cache/radix_cache.py``. Imports: ``pagedkv.blocks`` and the top-level
helpers, never the manager.
"""
