"""The serving manager: many sequences and many layers on one shared pool.

``KVCacheManager`` (vLLM: ``vllm/v1/core/kv_cache_manager.py``) owns the sequences
(``sequence``), plans and commits reservations (``reserve``), preempts (``preempt``)
and shares prefixes (``prefix_sharing``); ``HybridKVCacheManager`` (vLLM:
``kv_cache_coordinator.py``) runs one per KV-cache group (``groups``). Imports:
everything below it (``blocks``, ``memory``, ``pagedkv.attention``, ``prefix``);
nothing imports it but the tools.
"""
