"""What pagedkv needs to know about a transformers model, and what it refuses.

:func:`read_spec` reads a config (``layer_types``, windows, chunks, heads, dtype) into a
:class:`ModelSpec`: which layers store keys (a shared-KV layer gets no pool layer, or
it would wedge every later step), each layer's window, and the dtype pages are stored
in. :func:`attention_refusals` lists what attention mode cannot compute (vLLM: its
backends' ``supports_*`` checks). docs/integrations.md ("Reading a model") has the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.counts import ChunkedWindow
from pagedkv.errors import ConfigError
from pagedkv.inputs import FLOAT_DTYPES
from pagedkv.integrations.hf.extra import require

__all__ = ["ModelSpec", "attention_refusals", "read_spec"]

#: Layer types that keep per-token keys and values, with whether they slide.
_STORING_TYPES = {"full_attention": False, "sliding_attention": True, "chunked_attention": True}
#: Layer types that store nothing (shared-KV consumers, MLP- or MoE-only layers).
_EMPTY_TYPES = ("dummy", "moe", "mlp")
#: 16-bit model dtypes: pages stored in them (``KVPool(key_dtype=...)``), attention computed in float32.
_HALF_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's attention, as pagedkv sees it.

    Invariants:
        * ``storing_layers`` is strictly increasing, inside ``0 .. num_layers - 1``;
        * ``windows`` and ``layer_types`` have one entry per model layer;
        * ``num_q_heads`` is a multiple of ``num_kv_heads``.

    Attributes:
        num_layers: the model's layers, storing or not.
        storing_layers: the model layer of each pool layer, in order.
        layer_types: transformers' type of each model layer.
        windows: each model layer's sliding window (None: unbounded).
        num_q_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: values per head.
        scale: the score scale the model's attention uses.
        dtype: the pool's compute dtype: the model's float32 or float64, or
            float32 for a 16-bit model.
        page_dtype: a 16-bit model's dtype, ``"float16"`` or ``"bfloat16"``, in
            which its pages are stored; None: the model computes in ``dtype``.

    >>> spec = ModelSpec(2, (0, 1), ("full_attention",) * 2, (None, None), 4, 2, 16, 0.25,
    ...                  np.dtype(np.float32))
    >>> spec.pool_layer(1), spec.pool_windows
    (1, [None, None])
    """

    num_layers: int
    storing_layers: tuple[int, ...]
    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: np.dtype[Any]
    page_dtype: str | None = None
    #: model layer -> pool layer, made once (``pool_layer`` runs every layer of every step).
    _pool_of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.check_invariants()
        object.__setattr__(self, "_pool_of", {layer: i for i, layer in enumerate(self.storing_layers)})

    @property
    def model_dtype(self) -> str:
        """The dtype the model computes in, as torch names it (``"bfloat16"``, ``"float32"``...)."""
        return self.page_dtype or self.dtype.name

    @property
    def pool_windows(self) -> list[int | None]:
        """The window of each pool layer (the manager's ``layer_max_sizes``)."""
        return [self.windows[layer] for layer in self.storing_layers]

    def pool_layer(self, layer_idx: int) -> int:
        """The pool layer of model layer ``layer_idx``.

        Raises:
            ConfigError: that model layer stores no keys (its config type says so).
        """
        pool_layer = self._pool_of.get(layer_idx)
        if pool_layer is not None:
            return pool_layer
        kind = self.layer_types[layer_idx] if 0 <= layer_idx < self.num_layers else "out of range"
        raise ConfigError(
            f"model layer {layer_idx} ({kind}) has no pool layer: the config says it stores no keys; "
            f"storing layers are {list(self.storing_layers)}"
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        layers = self.storing_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise AssertionError(f"storing layers {layers} of {self.num_layers}")
        if len(self.windows) != self.num_layers or len(self.layer_types) != self.num_layers:
            raise AssertionError("windows and layer_types need one entry per layer")
        if self.num_q_heads % self.num_kv_heads:
            raise AssertionError(f"{self.num_q_heads} query heads over {self.num_kv_heads} kv heads")
        if self.page_dtype is not None and (self.page_dtype not in _HALF_DTYPES or self.dtype != np.float32):
            raise AssertionError(f"pages of {self.page_dtype} computed in {self.dtype}")


def _layer_types(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """transformers' own reading of a config's layer types (layer_types, sliding_window, KV sharing)."""
    types, kwargs = require("transformers.cache_utils").get_layer_types_and_kwargs(config)
    return list(types), list(kwargs)


def _model_scale(model: Any, head_dim: int) -> float:
    """The ``scaling`` the model's attention modules pass, else ``head_dim ** -0.5``."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float) and hasattr(module, "layer_idx"):
            return float(scaling)
    return 1.0 / math.sqrt(head_dim)


def read_spec(model: Any) -> ModelSpec:
    """Read a decoder-only transformers model's attention shape from its config.

    Raises:
        ConfigError: an encoder-decoder model, a layer type pagedkv cannot store
            (linear attention, hybrid), or a dtype other than float32/float64/float16/bfloat16.

    >>> read_spec(object())
    Traceback (most recent call last):
    ...
    pagedkv.errors.ConfigError: object has no transformers config (model.config); pass a transformers model
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ConfigError(
            f"{type(model).__name__} has no transformers config (model.config); pass a transformers model"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{config.model_type} is an encoder-decoder model; PagedCache serves decoder-only models"
        )
    text = config.get_text_config(decoder=True)
    types, kwargs = _layer_types(text)
    # Layers of different windows become KV-cache groups (PagedCache.from_model): a chunked
    # layer's window is a ChunkedWindow, so it groups apart from a sliding one of that size.
    storing, windows = [], []
    for layer, (kind, extra) in enumerate(zip(types, kwargs)):
        if kind in _STORING_TYPES:
            storing.append(layer)
            window = int(extra["sliding_window"]) if _STORING_TYPES[kind] else None
            # transformers hands a chunked layer's attention_chunk_size over as its "sliding_window".
            windows.append(ChunkedWindow(window) if kind == "chunked_attention" else window)
        elif kind in _EMPTY_TYPES:
            windows.append(None)
        else:
            raise ConfigError(
                f"model layer {layer} is a {kind!r} layer; pagedkv stores only full, sliding and chunked "
                "attention layers (and skips shared-KV 'dummy' ones)"
            )
    num_q_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_q_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_q_heads)
    dtype = str(getattr(model, "dtype", "torch.float32")).removeprefix("torch.")
    page_dtype = dtype if dtype in _HALF_DTYPES else None
    if page_dtype is None and dtype not in [str(known) for known in FLOAT_DTYPES]:
        raise ConfigError(
            f"the model computes in {dtype}; pagedkv serves float32, float64, float16 and bfloat16 "
            "models: call model.float() first"
        )
    return ModelSpec(
        num_layers=len(types),
        storing_layers=tuple(storing),
        layer_types=tuple(types),
        windows=tuple(windows),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=_model_scale(model, head_dim),
        dtype=np.dtype(np.float32 if page_dtype else dtype),
        page_dtype=page_dtype,
    )


def attention_refusals(model: Any) -> list[str]:
    """What the model's attention needs that ``KVCacheManager.attend`` cannot compute; empty if nothing.

    Each entry names the feature and where it was found. Storage mode (transformers'
    own attention over pagedkv's pages) has no such limits.

    >>> attention_refusals(object())
    []
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return []
    text = config.get_text_config(decoder=True)
    found = []
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        found.append(f"logit softcapping (config.attn_logit_softcapping={softcap})")
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        found.append("attention bias (ALiBi)")
    if getattr(text, "is_causal", True) is False:
        found.append("non-causal attention (config.is_causal=False)")
    dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0)
    if dropout > 0 and getattr(model, "training", False):
        found.append(f"attention dropout {dropout} in training mode (call model.eval())")
    for name, module in model.named_modules():
        if not hasattr(module, "layer_idx"):
            continue
        if getattr(module, "sinks", None) is not None:
            found.append(f"learned sink logits ({name}.sinks)")
            break
        if getattr(module, "is_causal", True) is False:
            found.append(f"non-causal attention ({name}.is_causal=False)")
            break
    return found
