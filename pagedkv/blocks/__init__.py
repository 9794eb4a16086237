"""Block ids and the tables of them: the allocator (ref counts, cached marks) and block tables.

``allocator`` (``BlockAllocator``), ``table`` (``BlockTable``, its slot arithmetic and
``ReadPlan``), ``occupancy`` (the live-slot count). Ids and integers only: nothing here
holds a token's keys or values. vLLM: ``vllm/v1/core/block_pool.py`` and the block tables
of ``single_type_kv_cache_manager.py``. Imports: ``pagedkv.errors``, ``pagedkv.counts``
(and numpy for a table's slot arrays; the allocator never imports numpy).
"""
