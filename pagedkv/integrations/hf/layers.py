"""One storing layer of a ``PagedCache``, as transformers' per-layer cache API sees it.

transformers asks a cache's ``layers`` whether each is sliding, initialized,
compileable or croppable, and for its lengths; the data stays in the pool, so a
view only forwards to its cache. Non-storing layers are transformers' own
``DummyLayer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.integrations.hf.extra import optional_class
from pagedkv.integrations.hf.tensors import Tensor

if TYPE_CHECKING:
    from pagedkv.integrations.hf.cache import PagedCache

__all__ = ["LayerView"]

_CacheLayerMixin: Any = optional_class("transformers.cache_utils", "CacheLayerMixin")


class LayerView(_CacheLayerMixin):  # type: ignore[misc]
    """One storing layer of a :class:`PagedCache` as transformers' per-layer API sees it."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
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
