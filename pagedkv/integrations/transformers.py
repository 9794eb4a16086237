"""Hugging Face transformers models generate through pagedkv (the ``hf`` extra: torch, transformers).

Two modes, both token for token what ``DynamicCache`` gives: ``PagedCache`` as the model's
cache (transformers' attention reads it), or with ``use_pagedkv_attention(model)``
(``KVCacheManager.attend`` computes), registered as vLLM's Transformers backend registers its
own attention. Runs on the CPU; importing needs numpy alone, and building a cache or
registering the attention without the extra raises ``ImportError`` naming it. docs/integrations.md.

>>> from pagedkv.integrations.transformers import ATTENTION_NAME
>>> ATTENTION_NAME
'pagedkv'
"""

from __future__ import annotations

from pagedkv.integrations.hf.attention import padding_mask, pagedkv_attention, use_pagedkv_attention
from pagedkv.integrations.hf.cache import ATTENTION_NAME, PagedCache
from pagedkv.integrations.hf.extra import HF_EXTRA_HINT
from pagedkv.integrations.hf.models import MODELS_EXTRA_HINT, kv_bytes, load_model
from pagedkv.integrations.hf.spec import ModelSpec, attention_refusals, read_spec

__all__ = [
    "ATTENTION_NAME",
    "HF_EXTRA_HINT",
    "MODELS_EXTRA_HINT",
    "ModelSpec",
    "PagedCache",
    "attention_refusals",
    "kv_bytes",
    "load_model",
    "padding_mask",
    "pagedkv_attention",
    "read_spec",
    "use_pagedkv_attention",
]
