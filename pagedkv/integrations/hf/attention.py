"""pagedkv as a transformers attention implementation: ``KVCacheManager.attend`` does the work.

Registered under ``"pagedkv"`` with ``AttentionInterface`` and ``AttentionMaskInterface``
(vLLM: its Transformers backend's attention); the mask function passes only which new
positions are real, causality and windows are the manager's. What pagedkv cannot
compute is refused at setup and per call. docs/integrations.md draws the call order.
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import ConfigError, SequenceStateError, ShapeError
from pagedkv.integrations.hf.cache import ATTENTION_NAME, take_pending
from pagedkv.integrations.hf.extra import require
from pagedkv.integrations.hf.spec import attention_refusals
from pagedkv.integrations.hf.tensors import Tensor

__all__ = ["padding_mask", "pagedkv_attention", "use_pagedkv_attention"]


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> Tensor | None:
    """The mask function registered as ``"pagedkv"``: which of the ``q_length`` new columns are real.

    Returns:
        ``(batch_size, q_length)`` booleans from the 2D attention mask's last
        columns, or None when nothing is padded.

    Raises:
        ConfigError: the model asked for a custom mask pattern (``or``/``and``
            mask functions: image tokens, blockwise attention...).

    >>> padding_mask(1, 2, 3) is None  # no attention mask: nothing is padded
    True
    """
    if use_vmap:
        raise ConfigError(
            "the model combines the causal mask with a custom mask function; pagedkv attention computes "
            "causal (and sliding-window) masks only"
        )
    if attention_mask is None:
        return None
    real = attention_mask[:, -q_length:].bool()
    return None if bool(real.all()) else real


def pagedkv_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function registered as ``"pagedkv"``; transformers calls it once per layer.

    Returns:
        ``(output, None)``: output ``(batch, seq, q_heads, head_dim)``, no attention weights.

    Raises:
        SequenceStateError: no :class:`~pagedkv.integrations.hf.cache.PagedCache`
            stored this layer's keys just before (pass one as the model's cache).
        ConfigError: a softcap, sinks, dropout, a window other than the cache's, or non-causal attention.
        ShapeError: a 4D (custom) mask.
    """
    refused = [
        what
        for what, present in (
            ("logit softcapping", kwargs.get("softcap") is not None),
            ("learned sink logits", kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None),
            (f"attention dropout {dropout}", bool(dropout)),
            ("non-causal attention", kwargs.get("is_causal", getattr(module, "is_causal", True)) is False),
        )
        if present
    ]
    if refused:
        raise ConfigError(f"pagedkv attention cannot compute {', '.join(refused)}; use another attention")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ShapeError(
            f"pagedkv attention takes a padding mask (batch, seq), got a {attention_mask.ndim}D mask of "
            f"shape {tuple(attention_mask.shape)}; custom masks need another attention"
        )
    found = take_pending(key)
    if found is None:
        raise SequenceStateError(
            "pagedkv attention found no keys stored for this call: "
            "pass cache=PagedCache.from_model(model, ...) "
            "(and use_cache=True) to the model or to generate()"
        )
    cache, layer_idx = found
    window = kwargs.get("sliding_window")
    if window is not None and window != cache.spec.windows[layer_idx]:
        raise ConfigError(
            f"layer {layer_idx} attends with sliding window {window}; the cache was built with "
            f"{cache.spec.windows[layer_idx]}"
        )
    scale = cache.spec.scale if scaling is None else float(scaling)
    return cache.attend(layer_idx, query, key, value, attention_mask, scale), None


def use_pagedkv_attention(model: Any) -> Any:
    """Make ``KVCacheManager.attend`` the attention of ``model`` (with a ``PagedCache``); return the model.

    Registers ``"pagedkv"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface`` and sets it as the model's implementation.
    ``model.set_attn_implementation("sdpa")`` switches back.

    Raises:
        ConfigError: the model needs something pagedkv attention cannot compute
            (logit softcapping, learned sink logits, dropout in training,
            non-causal attention, attention bias, chunked attention); the
            message names each. The model is left as it was.
    """
    refused = attention_refusals(model)
    if refused:
        raise ConfigError(f"pagedkv attention cannot run this model: it needs {'; '.join(refused)}")
    require("transformers").AttentionInterface.register(ATTENTION_NAME, pagedkv_attention)
    require("transformers.masking_utils").AttentionMaskInterface.register(ATTENTION_NAME, padding_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ConfigError(
            f"{type(model).__name__} did not take the attention implementation {ATTENTION_NAME!r} "
            f"(it kept {model.config._attn_implementation!r}); "
            "it does not dispatch through AttentionInterface"
        )
    return model
