"""A manager's configuration: windows, sinks, heads, scale and prefix caching, validated once.

``KVCacheManager(pool, max_size=..., ...)`` builds one :class:`ManagerConfig`
from its arguments and the pool; everything after reads the frozen result.

Windows: ``max_size`` gives every layer the same window; ``layer_max_sizes``
one per layer (``None`` = unbounded), as Mistral allows. Blocks are freed by
the largest window (``window``), or never when some layer is unbounded::

    layer_max_sizes (4, 8, None) -> window None   (a full-attention layer keeps every block)
    layer_max_sizes (4, 8, 8)    -> window 8
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.counts import check_count, check_max_size
from pagedkv.errors import ConfigError, InputTypeError
from pagedkv.inputs import check_scale
from pagedkv.memory.pool import KVPool
from pagedkv.prefix.cache import check_hash_algorithm
from pagedkv.prefix.events import DEFAULT_MAX_EVENTS

__all__ = ["ManagerArguments", "ManagerConfig", "configure"]


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """What a manager was configured with, validated (see ``KVCacheManager`` for each field).

    Attributes:
        layer_max_sizes: the window of each layer (None: unbounded).
        window: the window that frees blocks: the largest layer window, None if any is unbounded.
        num_sink_tokens: leading tokens every token attends to, never evicted.
        num_q_heads: query heads, a multiple of the pool's ``num_kv_heads``.
        scale: multiplies every score.
        enable_prefix_caching: whether full blocks are keyed and shared.
        hash_algorithm: the block hash's name.
        trusted_inputs: the engine vouches for the k, v and q values it
            passes, so ``write`` and ``attend`` scan no values (NaN,
            infinity, magnitude) and ``attend`` skips the score bound.
        kv_events: the bound of the KV event buffer; 0 when events are off.
        num_layers: the pool layers the manager uses (the first ones): all of
            them, or a KV-cache group's layers on a pool padded for a larger group.
    """

    layer_max_sizes: tuple[int | None, ...]
    window: int | None
    num_sink_tokens: int
    num_q_heads: int
    scale: float
    enable_prefix_caching: bool
    hash_algorithm: str
    trusted_inputs: bool = False
    kv_events: int = 0
    num_layers: int = 1


@dataclass(frozen=True, slots=True)
class ManagerArguments:
    """A manager's arguments as given (``KVCacheManager``'s keywords and defaults), for ``configure``."""

    max_size: int | None = None
    layer_max_sizes: Sequence[int | None] | None = None
    num_sink_tokens: int = 0
    num_q_heads: int | None = None
    scale: float = 1.0
    enable_prefix_caching: bool = False
    hash_algorithm: str = "sha256"
    trusted_inputs: bool = False
    kv_events: bool | int = False
    num_layers: int | None = None


def configure(pool: KVPool, arguments: ManagerArguments) -> ManagerConfig:
    """Validate a manager's arguments against ``pool``; return the configuration.

    Raises:
        InputTypeError: ``pool`` is not a KVPool, or an argument has the wrong type.
        ConfigError: a value is out of range or disagrees with the pool.
        ImportError: ``hash_algorithm="xxh3_128"`` without the ``xxhash`` extra.
    """
    max_size, layer_max_sizes = arguments.max_size, arguments.layer_max_sizes
    num_layers = arguments.num_layers
    num_q_heads, kv_events = arguments.num_q_heads, arguments.kv_events
    enable_prefix_caching, trusted_inputs = arguments.enable_prefix_caching, arguments.trusted_inputs
    if not isinstance(pool, KVPool):
        raise InputTypeError(f"pool must be a KVPool, got {type(pool).__name__}")
    if pool.growable:
        raise ConfigError("a manager needs a fixed pool; create KVPool(..., growable=False)")
    window = check_max_size(max_size)
    if num_layers is None:
        num_layers = pool.num_layers
    else:
        num_layers = check_count("num_layers", num_layers)
        if num_layers > pool.num_layers:
            raise ConfigError(f"num_layers={num_layers} but the pool has {pool.num_layers} layers")
    if layer_max_sizes is not None:
        if window is not None:
            raise ConfigError("give max_size or layer_max_sizes, not both")
        if isinstance(layer_max_sizes, (str, bytes)) or not isinstance(layer_max_sizes, Sequence):
            raise InputTypeError(
                f"layer_max_sizes must be a list of windows (int or None), one per layer, "
                f"got {layer_max_sizes!r}"
            )
        windows = [check_max_size(w, "layer_max_sizes entry") for w in layer_max_sizes]
        if len(windows) != num_layers:
            raise ConfigError(
                f"layer_max_sizes has {len(windows)} entries, the manager has {num_layers} layers"
            )
    else:
        windows = [window] * num_layers
    q_heads = pool.num_kv_heads if num_q_heads is None else check_count("num_q_heads", num_q_heads)
    if q_heads % pool.num_kv_heads:
        raise ConfigError(f"num_q_heads={q_heads} is not a multiple of num_kv_heads={pool.num_kv_heads}")
    if not isinstance(enable_prefix_caching, bool):
        raise InputTypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    check_hash_algorithm(arguments.hash_algorithm)  # even with prefix caching off: snapshots save it
    if not isinstance(trusted_inputs, bool):
        raise InputTypeError(f"trusted_inputs must be True or False, got {trusted_inputs!r}")
    if kv_events is True:
        max_events = DEFAULT_MAX_EVENTS
    elif kv_events is False:
        max_events = 0
    else:
        max_events = check_count("kv_events", kv_events)
    if max_events and not enable_prefix_caching:
        raise ConfigError("kv_events report prefix-cache keys: they need enable_prefix_caching=True")
    return ManagerConfig(
        layer_max_sizes=tuple(windows),
        window=None if any(w is None for w in windows) else max(w for w in windows if w is not None),
        num_sink_tokens=check_count("num_sink_tokens", arguments.num_sink_tokens, minimum=0),
        num_q_heads=q_heads,
        scale=check_scale(arguments.scale),
        enable_prefix_caching=enable_prefix_caching,
        hash_algorithm=arguments.hash_algorithm,
        trusted_inputs=trusted_inputs,
        kv_events=max_events,
        num_layers=num_layers,
    )
