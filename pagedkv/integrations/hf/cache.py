"""``PagedCache``: a transformers ``Cache`` whose keys and values live in a pagedkv pool.

Each batch row is one sequence of a :class:`~pagedkv.KVCacheManager` (a
:class:`~pagedkv.HybridKVCacheManager` for models with several windows); layer
``update`` calls drive the manager's step (transformers' ``DynamicCache`` is the
counterpart). Storage mode returns each row's visible keys as ``DynamicCache`` would;
attention mode hands attention to ``KVCacheManager.attend``. docs/integrations.md
("How the integration is built") draws the step and the two modes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError, InputTypeError, SequenceStateError, ShapeError
from pagedkv.integrations.hf.extra import optional_class, require
from pagedkv.integrations.hf.layers import LayerView
from pagedkv.integrations.hf.read_cache import LayerBuffer, read_rows
from pagedkv.integrations.hf.rows import RowSequences
from pagedkv.integrations.hf.spec import ModelSpec, read_spec
from pagedkv.integrations.hf.tensors import (
    Tensor,
    check_states,
    from_tokens,
    padding_layout,
    to_tokens,
    torch_dtype,
)
from pagedkv.manager.groups import GroupLayout
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.manager.manager import KVCacheManager
from pagedkv.memory.pool import KVPool

__all__ = ["ATTENTION_NAME", "PagedCache", "take_pending"]

# transformers' base classes; without the hf extra, stand-ins that raise ImportError when built.
_Cache: Any = optional_class("transformers.cache_utils", "Cache")

#: The name pagedkv attention is registered under (``model.config._attn_implementation``).
ATTENTION_NAME = "pagedkv"

# The cache whose attention-mode ``update`` ran last in this thread, its layer and
# the key tensor it returned: the attention function that follows finds its cache here.
_PENDING = threading.local()


def take_pending(key: object) -> tuple[PagedCache, int] | None:
    """The cache and layer whose attention-mode ``update`` returned ``key`` in this thread, once."""
    entry = getattr(_PENDING, "entry", None)
    _PENDING.entry = None
    if entry is None or entry[2] is not key:
        return None
    return entry[0], entry[1]


@dataclass
class _Step:
    """One forward step: its reservation, the stored token positions, the pool layers written."""

    batch: Any  # Batch (GroupBatch for a hybrid manager); None when every new position is padding
    select: Tensor | None  # flat (row, position) indices stored; None: all of them
    written: set[int] = field(default_factory=set)


class PagedCache(_Cache):  # type: ignore[misc]
    """A transformers ``Cache`` on a pagedkv pool: rows are sequences, beams share pages.

    Invariants:
        * the rows' invariants hold (:class:`~pagedkv.integrations.hf.rows.RowSequences`);
        * between steps, every storing layer has seen the same number of columns;
        * between steps, each row holds ``columns - pads`` tokens (pads are 0 in storage mode).

    Args:
        manager: the manager whose pool stores the keys (one pool layer per storing model layer).
        spec: the model's attention shape (:func:`~pagedkv.integrations.hf.spec.read_spec`).
        config: the model's config; pagedkv attention is on when its
            ``_attn_implementation`` is ``"pagedkv"``. None: storage mode always.
        read_cache: storage mode keeps each layer's visible keys and values in a
            growing contiguous buffer too (about twice their memory; faster
            reads). False, or pages that do not hold the model's values
            exactly (int8, fp8, or 16 bits other than the model's): gather
            them from the pages each call.

    Raises:
        ConfigError: the manager's pool or heads do not fit ``spec``.
    """

    def __init__(
        self,
        manager: KVCacheManager | HybridKVCacheManager,
        spec: ModelSpec,
        *,
        config: Any = None,
        read_cache: bool = True,
    ) -> None:
        pool = manager.pool
        shape = (manager.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, manager.num_q_heads)
        wanted = (len(spec.storing_layers), spec.num_kv_heads, spec.head_dim, spec.dtype, spec.num_q_heads)
        if shape != wanted:
            raise ConfigError(
                f"the manager holds (layers, kv heads, head_dim, dtype, q heads) = {shape}; "
                f"the model needs {wanted}"
            )
        self.manager = manager
        self.spec = spec
        self._config = config
        self._rows = RowSequences(manager)
        self._num_columns = [0] * spec.num_layers
        self._step: _Step | None = None
        self._mode = "storage"
        self._read_cache = read_cache and _pages_exact(pool, spec)
        self._buffers = [LayerBuffer() for _ in range(spec.num_layers)]
        storing = set(spec.storing_layers)
        dummy = require("transformers.cache_utils").DummyLayer
        views = [LayerView(self, i) if i in storing else dummy() for i in range(spec.num_layers)]
        super().__init__(layers=views)

    @classmethod
    def from_model(
        cls,
        model: Any,
        num_blocks: int,
        *,
        block_size: int = 16,
        trusted_inputs: bool = True,
        read_cache: bool = True,
    ) -> PagedCache:
        """A cache with its own pool, shaped from ``model``'s config.

        Args:
            model: a decoder-only transformers model in float32, float64, or
                float16 / bfloat16 (pages stored in that dtype, computed in float32).
            num_blocks: the pool's memory, in blocks of ``block_size`` tokens of every
                storing layer. A model whose layers have different windows
                (Gemma 2/3, gpt-oss, Mistral's ``layer_types``) gets one KV-cache
                group per window (:class:`~pagedkv.HybridKVCacheManager`), each
                freeing what its window no longer sees; its blocks hold one
                group's layers, so the same memory makes proportionally more.
            block_size: token slots per block.
            trusted_inputs: skip scanning the values the model writes (keys are
                still scanned); see ``KVCacheManager(trusted_inputs=...)``.
            read_cache: see the class.

        Raises:
            ConfigError: what :func:`~pagedkv.integrations.hf.spec.read_spec` refuses, or no storing layer.
        """
        spec = read_spec(model)
        if not spec.storing_layers:
            raise ConfigError("the model has no layer that stores keys; it needs no KV cache")
        # Layers of different windows: one KV-cache group each (docs/groups.md); the pool's
        # blocks hold one group's layers, so the same bytes make more blocks.
        windows = spec.pool_windows
        kinds = {(window.__class__, window) for window in windows}  # a chunk of C is not a window of C
        layout = GroupLayout.from_layer_windows(windows) if len(kinds) > 1 else None
        num_pool_layers = len(windows) if layout is None else layout.layers_per_group
        pool = KVPool(
            num_blocks * len(windows) // num_pool_layers,
            block_size=block_size,
            num_layers=num_pool_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            key_dtype=spec.page_dtype,
            value_dtype=spec.page_dtype,
        )
        manager: KVCacheManager | HybridKVCacheManager
        if layout is None:
            manager = KVCacheManager(
                pool,
                layer_max_sizes=spec.pool_windows,
                num_q_heads=spec.num_q_heads,
                scale=spec.scale,
                trusted_inputs=trusted_inputs,
            )
        else:
            manager = HybridKVCacheManager(
                pool, layout, num_q_heads=spec.num_q_heads, scale=spec.scale, trusted_inputs=trusted_inputs
            )
        return cls(manager, spec, config=model.config, read_cache=read_cache)

    # ---------------------------------------------------------------- queries

    @property
    def num_rows(self) -> int:
        """Batch rows (sequences) held; 0 before the first forward and after ``reset``."""
        return self._rows.num_rows

    @property
    def seq_ids(self) -> list[Any]:
        """The manager's sequence id of each row."""
        return list(self._rows.seq_ids)

    @property
    def mode(self) -> str:
        """``"storage"`` or ``"attention"``: fixed when rows start."""
        return self._mode

    def block_ids(self, row: int) -> list[int]:
        """The blocks ``row``'s sequence holds (a copy): its block table, or every group's in turn."""
        manager, seq_id = self.manager, self._rows.seq_ids[row]
        if isinstance(manager, HybridKVCacheManager):
            return [
                block_id
                for group in range(len(manager.groups))
                for block_id in manager.block_table(seq_id, group).block_ids
            ]
        return list(manager.block_table(seq_id).block_ids)

    @property
    def num_held_bytes(self) -> int:
        """Bytes of the blocks the rows hold, every layer's keys and values (a shared block counted once).

        The figure to set beside ``DynamicCache``'s tensors (``pagedkv.integrations.hf.models.kv_bytes``);
        the read cache's buffers, if any, are not counted.
        """
        held = {block_id for row in range(self.num_rows) for block_id in self.block_ids(row)}
        return len(held) * self.manager.pool.bytes_per_block

    def page_map(self) -> str:
        """One character per block of the pool: ``.`` free, ``a``/``b``/... held by row 0/1/..., ``*`` shared.

        A block held outside this cache's rows (another user of the pool) shows as ``#``.
        """
        owners: dict[int, set[int]] = {}
        for row in range(self.num_rows):
            for block_id in self.block_ids(row):
                owners.setdefault(block_id, set()).add(row)
        allocator = self.manager.pool.allocator
        marks = []
        for block_id in range(allocator.num_blocks):
            rows = owners.get(block_id, set())
            if len(rows) > 1:
                marks.append("*")
            elif rows:
                marks.append(chr(ord("a") + min(rows) % 26))
            else:
                marks.append("#" if allocator.ref_count(block_id) else ".")
        return "".join(marks)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns (tokens, padding included) model layer ``layer_idx`` has seen."""
        if not 0 <= layer_idx < self.spec.num_layers:
            return 0
        if layer_idx not in self.spec.storing_layers:
            layer_idx = self.spec.storing_layers[0]
        return self._num_columns[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys ``update`` returns for ``query_length`` new columns."""
        past = self.get_seq_length(layer_idx)
        window = self.spec.windows[layer_idx] if 0 <= layer_idx < self.spec.num_layers else None
        offset = 0 if window is None else max(0, past - window + 1)
        return past + query_length - offset, offset

    # --------------------------------------------------------------- commands

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Store one layer's new keys and values ``(batch, kv_heads, seq, head_dim)``.

        Returns:
            Storage mode: every row's visible keys and values (from the mask's
            ``kv_offset`` on): tensors never written again (views of the read
            cache, or new ones). Attention mode: the states as given.

        Raises:
            ConfigError: the layer stores no keys, or the attention mode changed mid-generation.
            ShapeError: a wrong shape, dtype, device or row count.
            SequenceStateError: some storing layer wrote nothing in the last step.
            PoolExhaustedError: the pool is full; nothing changes.
        """
        spec = self.spec
        pool_layer = spec.pool_layer(layer_idx)
        check_states("key_states", key_states, spec.num_kv_heads, spec.head_dim, spec.model_dtype)
        check_states("value_states", value_states, spec.num_kv_heads, spec.head_dim, spec.model_dtype)
        if key_states.shape != value_states.shape:
            raise ShapeError(
                f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)}"
            )
        num_rows, _, num_new, _ = key_states.shape
        step = self._step  # NOTE: the mode (a slow config lookup) is checked only when a step begins
        new_step = step is None or pool_layer in step.written or num_rows != self.num_rows
        started = new_step and self._start_rows(num_rows)
        if self._mode == "attention":
            self._num_columns[layer_idx] += num_new
            _PENDING.entry = (self, layer_idx, key_states)
            return key_states, value_states
        try:
            if self._is_new_step(pool_layer):
                self._begin_step({seq_id: num_new for seq_id in self._rows.seq_ids}, None)
        except Exception:
            if started:
                self._rows.clear()
            raise
        step = self._step
        assert step is not None and step.batch is not None  # a storage step stores every position
        compute = spec.dtype if spec.page_dtype else None
        keys_new, values_new = to_tokens(key_states, None, compute), to_tokens(value_states, None, compute)
        self.manager.write(pool_layer, step.batch, keys_new, values_new)
        step.written.add(pool_layer)
        past = self._num_columns[layer_idx]
        self._num_columns[layer_idx] = end = past + num_new
        window = spec.windows[layer_idx]
        keep_from = 0 if window is None else max(0, past - window + 1)
        if not self._read_cache:
            keys, values = read_rows(self.manager, self._rows.seq_ids, pool_layer, keep_from, end)
            return self._model_tensor(keys), self._model_tensor(values)
        buffer = self._buffers[layer_idx]
        if buffer.is_empty:  # the first step, or after crop: the pool has the history
            keys, values = read_rows(self.manager, self._rows.seq_ids, pool_layer, keep_from, past)
            buffer.fill(self._model_tensor(keys), self._model_tensor(values), start=keep_from)
        return buffer.append(key_states, value_states, keep_from)

    def attend(
        self,
        layer_idx: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        padding: Tensor | None,
        scale: float,
    ) -> Tensor:
        """Attention mode: store one layer's real new tokens and attend them, ``(batch, seq, q_heads, d)``.

        Args:
            layer_idx: the model layer.
            query: ``(batch, q_heads, seq, head_dim)``.
            key, value: ``(batch, kv_heads, seq, head_dim)``, as ``update`` returned them.
            padding: ``(batch, seq)`` booleans, False for a padding position; None: none.
            scale: the score scale of this call.

        Returns:
            A new tensor in the model's dtype (computed in float32 for a 16-bit
            model, then rounded); padding positions hold zeros.

        Raises:
            ShapeError: bad shapes, or padding after a real token (only left padding is served).
            SequenceStateError, PoolExhaustedError: as ``update``.
        """
        spec = self.spec
        pool_layer = spec.pool_layer(layer_idx)
        check_states("query", query, spec.num_q_heads, spec.head_dim, spec.model_dtype)
        num_rows, _, num_new, _ = query.shape
        if num_rows != self.num_rows or key.shape[2] != num_new:
            raise ShapeError(
                f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match the cache's "
                f"{self.num_rows} rows"
            )
        if self._is_new_step(pool_layer):
            held = [self._rows.num_tokens(row) for row in range(num_rows)] if padding is not None else []
            counts, select, pads = padding_layout(padding, num_new, held, self._rows.num_pads)
            requests = {seq_id: count for seq_id, count in zip(self._rows.seq_ids, counts) if count}
            self._begin_step(requests, select)
            self._rows.num_pads = pads
        step = self._step
        assert step is not None
        step.written.add(pool_layer)
        if step.batch is None:
            return query.new_zeros((num_rows, num_new, spec.num_q_heads, spec.head_dim))
        select = step.select
        compute = spec.dtype if spec.page_dtype else None
        self.manager.write(
            pool_layer, step.batch, to_tokens(key, select, compute), to_tokens(value, select, compute)
        )
        outputs = self.manager.attend(pool_layer, step.batch, to_tokens(query, select, compute), scale=scale)
        return from_tokens(outputs, num_rows, num_new, select, spec.page_dtype)

    def reset(self) -> None:
        """Free every row's sequence; the pool stays, ready for the next ``generate``."""
        self._rows.clear()
        self._num_columns = [0] * self.spec.num_layers
        self._step = None
        self._clear_buffers()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]`` (a fork: the pages are shared)."""
        self._select([int(i) for i in beam_idx.tolist()], "reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, in place (forks share the pages)."""
        self._select([row for row in range(self.num_rows) for _ in range(repeats)], "batch_repeat_interleave")

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep only the rows ``indices``, in that order."""
        self._select([int(i) for i in require("torch").as_tensor(indices).tolist()], "batch_select_indices")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns of every row (assisted decoding's rollback).

        Raises:
            InputTypeError: not an int.
            ConfigError: a positive count (transformers' legacy "final size"), or more columns than held.
            SequenceStateError: mid-step, or a window already evicted tokens the next step needs.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise InputTypeError(f"tokens_to_remove must be an int <= 0, got {tokens_to_remove!r}")
        if tokens_to_remove > 0:
            raise ConfigError(
                f"crop takes minus the number of columns to remove, got {tokens_to_remove}; "
                "pass a negative int"
            )
        columns = self.get_seq_length()
        num_removed = -tokens_to_remove
        if num_removed > columns:
            raise ConfigError(f"cannot remove {num_removed} columns; the cache holds {columns}")
        if not num_removed or not self.num_rows:
            return
        self._check_settled("crop")
        kept = columns - num_removed
        pads = self._rows.num_pads
        self._rows.truncate([max(0, kept - num_pads) for num_pads in pads])
        self._rows.num_pads = [min(num_pads, kept) for num_pads in pads]
        for layer in self.spec.storing_layers:
            self._num_columns[layer] = kept
        self._step = None
        self._clear_buffers()  # the next columns rewrite positions the buffers handed out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if an invariant in the class docstring is broken."""
        self._rows.check_invariants()
        self.manager.check_invariants()
        for buffer in self._buffers:
            buffer.check_invariants()
        step = self._step
        if step is not None and len(step.written) < len(self.spec.storing_layers):
            return  # mid-step: layers legitimately differ
        columns = {self._num_columns[layer] for layer in self.spec.storing_layers}
        if len(columns) > 1:
            raise AssertionError(f"storing layers saw different columns: {self._num_columns}")
        for row in range(self.num_rows):
            expected = self.get_seq_length() - self._rows.num_pads[row]
            if self._rows.num_tokens(row) != expected:
                raise AssertionError(f"row {row} holds {self._rows.num_tokens(row)} tokens, not {expected}")

    # ---------------------------------------------------------------- private

    def _start_rows(self, num_rows: int) -> bool:
        """Start ``num_rows`` sequences if none run (fixing the mode); whether it did."""
        mode = (
            "attention"
            if getattr(self._config, "_attn_implementation", None) == ATTENTION_NAME
            else "storage"
        )
        if self._rows.num_rows:
            if mode != self._mode:
                raise ConfigError(
                    f"the model's attention changed to {mode} mode while the cache holds {self.num_rows} "
                    f"rows in {self._mode} mode; reset() the cache first"
                )
            if num_rows != self.num_rows:
                raise ShapeError(
                    f"the states have {num_rows} rows; the cache holds {self.num_rows} "
                    "(reorder, select or reset it first)"
                )
            return False
        self._mode = mode
        self._rows.start(num_rows)
        self._num_columns = [0] * self.spec.num_layers
        self._step = None
        self._clear_buffers()
        return True

    def _model_tensor(self, array: Any) -> Tensor:
        """A tensor of the pool's ``array`` in the model's dtype (exact when the pages hold its values)."""
        tensor = require("torch").from_numpy(array)
        if self.spec.page_dtype is None:
            return tensor
        return tensor.to(torch_dtype(self.spec.page_dtype))

    def _is_new_step(self, pool_layer: int) -> bool:
        return self._step is None or pool_layer in self._step.written

    def _check_settled(self, what: str) -> None:
        step = self._step
        if step is not None and len(step.written) < len(self.spec.storing_layers):
            missing = [layer for i, layer in enumerate(self.spec.storing_layers) if i not in step.written]
            raise SequenceStateError(
                f"model layers {missing} stored nothing in the last step, so {what} cannot run; the step "
                "was abandoned half-way (or those layers never store: check the config's layer_types); "
                "reset() the cache"
            )

    def _begin_step(self, requests: dict[Any, int], select: Tensor | None) -> None:
        self._check_settled("a new step")
        batch = self.manager.reserve(requests) if requests else None
        self._step = _Step(batch, select)

    def _select(self, sources: list[int], what: str) -> None:
        if not self.num_rows:
            return
        self._check_settled(what)
        self._rows.select(sources)
        self._step = None
        for buffer in self._buffers:
            buffer.select(sources)

    def _clear_buffers(self) -> None:
        for buffer in self._buffers:
            buffer.clear()


def _pages_exact(pool: KVPool, spec: ModelSpec) -> bool:
    """Whether ``pool``'s pages hold exactly the keys and values ``spec``'s model writes.

    Float pages of the compute dtype hold any model's values (a 16-bit value widens
    exactly); 16-bit pages hold a model's of their own dtype; int8 and fp8 round.
    """
    if not pool.quantized:
        return True
    return spec.page_dtype is not None and pool.key_dtype == pool.value_dtype == spec.page_dtype
