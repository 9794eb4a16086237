"""One storing layer of a ``PagedCache``, as transformers' per-layer cache API sees it.

transformers asks a cache's ``layers`` whether each is sliding, initialized,
compileable or croppable, and for its lengths; the data stays in the pool, so a
view only forwards to its cache. Non-storing layers are transformers' own
``DummyLayer``.
"""

from __future__ import annotations

from typing import Any, Protocol

from pagedkv.integrations.hf.extra import optional_class
from pagedkv.integrations.hf.spec import ModelSpec
from pagedkv.integrations.hf.tensors import Tensor

__all__ = ["LayerView", "LayeredCache"]


class LayeredCache(Protocol):
    """What a :class:`LayerView` asks of its cache (``PagedCache`` has it).

    NOTE: a protocol, not an import of ``PagedCache``: the cache builds its views,
    so importing it here would close an import circle.
    """

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def num_rows(self) -> int: ...

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]: ...

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

_CacheLayerMixin: Any = optional_class("transformers.cache_utils", "CacheLayerMixin")


class LayerView(_CacheLayerMixin):  # type: ignore[misc]
    """One storing layer of a ``PagedCache`` as transformers' per-layer API sees it."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: LayeredCache, layer_idx: int) -> None:
        self.keys = self.values = None
        self._cache = cache
        self.layer_idx = layer_idx
        self.is_sliding = cache.spec.windows[layer_idx] is not None

    @property
    def is_initialized(self) -> bool:
        return self._cache.num_rows > 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to do: the pool exists from the start."""

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        window = self._cache.spec.windows[self.layer_idx]
        return -1 if window is None else window
