"""The arrays the block ids index: the pool, its pages, page views and quantized storage.

vLLM keeps these tensors in its worker (``gpu_model_runner``); SGLang in
``mem_cache/memory_pool.py``. Imports: ``pagedkv.blocks`` and the top-level helpers
(``errors``, ``counts``, ``inputs``), never the manager or prefix caching.
"""
