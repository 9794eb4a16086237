"""Hugging Face transformers models generate through pagedkv (the ``hf`` extra: torch, transformers).

Two ways, both token for token what ``DynamicCache`` gives (see docs/integrations.md)::

    cache = PagedCache.from_model(model, num_blocks=64)      # storage: transformers' attention
    model.generate(input_ids, cache=cache, max_new_tokens=40)

    use_pagedkv_attention(model)                              # KVCacheManager.attend does it
    model.generate(input_ids, cache=PagedCache.from_model(model, num_blocks=64), ...)

Runs on the CPU. Importing this module needs numpy alone; building a cache or
registering the attention without the extra raises ``ImportError`` naming it.

>>> from pagedkv.integrations.transformers import ATTENTION_NAME
>>> ATTENTION_NAME
'pagedkv'
"""

from __future__ import annotations

from pagedkv.integrations.hf.attention import padding_mask, pagedkv_attention, use_pagedkv_attention
from pagedkv.integrations.hf.cache import ATTENTION_NAME, PagedCache
from pagedkv.integrations.hf.extra import HF_EXTRA_HINT
from pagedkv.integrations.hf.spec import ModelSpec, attention_refusals, read_spec

__all__ = [
    "ATTENTION_NAME",
    "HF_EXTRA_HINT",
    "ModelSpec",
    "PagedCache",
    "attention_refusals",
    "padding_mask",
    "pagedkv_attention",
    "read_spec",
    "use_pagedkv_attention",
]
