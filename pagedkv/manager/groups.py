"""KV-cache groups: which model layers share a block table, and how one pool's pages hold them.

A hybrid model mixes attention types (Gemma 3: five sliding-window layers to
one full layer). Each type's layers are split into groups of equal size, and
every block of the one pool holds one group's layers, so each group has a
block table of its own per sequence and frees what its attention no longer
sees (vLLM: ``KVCacheGroupSpec`` and ``get_kv_cache_config``'s page-size
unification). docs/groups.md draws the layout and compares it with one pool
per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.counts import ChunkedWindow, ceil_div, check_count, check_max_size
from pagedkv.errors import ConfigError, InputTypeError

__all__ = ["GroupLayout", "KVCacheGroup"]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Model layers that share one block table per sequence: one attention type.

    Attributes:
        layers: the model layers, in pool-slot order (``layers[i]`` lives in
            pool layer ``i`` of this group's blocks).
        window: the sliding window ``W`` of every layer (None: full attention;
            a :class:`~pagedkv.counts.ChunkedWindow`: chunked local attention).
        num_sink_tokens: leading tokens kept and attended by every token.
    """

    layers: tuple[int, ...]
    window: int | None
    num_sink_tokens: int = 0

    @property
    def kind(self) -> str:
        """``"full"``, ``"sliding"`` or ``"chunked"``."""
        if self.window is None:
            return "full"
        return "chunked" if self.window.__class__ is ChunkedWindow else "sliding"


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Every model layer's group and slot, and the layers one pool block holds.

    Invariants (checked when built):
        * every model layer ``0 .. num_layers - 1`` is in exactly one group;
        * every group has at most ``layers_per_group`` layers (fewer: padding
          slots its blocks leave unused); full-attention groups come first.

    >>> layout = GroupLayout.from_layer_windows([4, 4, None, 4, 4, None])
    >>> layout.layers_per_group, [(g.kind, g.layers) for g in layout.groups]
    (2, [('full', (2, 5)), ('sliding', (0, 1)), ('sliding', (3, 4))])
    >>> layout.locate(3)
    (2, 0)
    """

    groups: tuple[KVCacheGroup, ...]
    layers_per_group: int

    def __post_init__(self) -> None:
        seen = sorted(layer for group in self.groups for layer in group.layers)
        if seen != list(range(len(seen))) or not seen:
            raise ConfigError(f"groups must cover layers 0 .. n-1 once each, got layers {seen}")
        for group in self.groups:
            if not 1 <= len(group.layers) <= self.layers_per_group:
                raise ConfigError(
                    f"a group has {len(group.layers)} layers; each needs 1 .. {self.layers_per_group}"
                )

    @classmethod
    def from_layer_windows(
        cls, windows: Sequence[int | None], *, num_sink_tokens: int = 0, max_padding: float = 0.1
    ) -> GroupLayout:
        """Group layers by window (None: full attention; a ``ChunkedWindow``: chunked local), each
        type split into groups of one size.

        The size is the largest whose padding (slots no layer fills) is at
        most ``max_padding`` of the layers, else the one with the least
        padding: fewer, larger groups mean fewer block tables per sequence::

            Gemma 3 270M: 15 sliding + 3 full layers -> size 3: 5 sliding groups + 1 full, no padding

        Raises:
            InputTypeError, ConfigError: a window is not None or an int >= 1,
                or no layer is given.
        """
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence):
            raise InputTypeError(
                f"windows must be a list of windows (int or None), one per layer, got {windows!r}"
            )
        checked = [check_max_size(window, "layer window") for window in windows]
        if not checked:
            raise ConfigError("a layout needs at least one layer")
        sinks = check_count("num_sink_tokens", num_sink_tokens, minimum=0)
        # A chunk of C and a window of C are equal ints but different attention: keyed apart.
        by_kind: dict[tuple[bool, int | None], tuple[int | None, list[int]]] = {}
        for layer, window in enumerate(checked):
            key = (window.__class__ is ChunkedWindow, window)
            by_kind.setdefault(key, (window, []))[1].append(layer)
        # Full attention first (group 0 bounds every prefix hit), then the others by layer order.
        types = sorted(by_kind.values(), key=lambda item: (item[0] is not None, item[1][0]))
        counts = [len(layers) for _, layers in types]
        size = _group_size(counts, len(checked), max_padding)
        groups = [
            KVCacheGroup(
                tuple(layers[start : start + size]),
                window,
                0 if window is None or window.__class__ is ChunkedWindow else sinks,
            )
            for window, layers in types
            for start in range(0, len(layers), size)
        ]
        return cls(tuple(groups), size)

    @property
    def num_layers(self) -> int:
        """Model layers."""
        return sum(len(group.layers) for group in self.groups)

    @property
    def num_padding_slots(self) -> int:
        """Pool layer slots no model layer uses, summed over groups."""
        return sum(self.layers_per_group - len(group.layers) for group in self.groups)

    def locate(self, layer: int) -> tuple[int, int]:
        """``(group index, pool layer)`` of model layer ``layer``.

        Raises:
            ConfigError: no group holds ``layer``.
        """
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise ConfigError(f"layer {layer!r} is in no group (layers 0 .. {self.num_layers - 1})")


def _group_size(counts: list[int], num_layers: int, max_padding: float) -> int:
    """The group size for types of ``counts`` layers (see ``GroupLayout.from_layer_windows``)."""

    def padding(size: int) -> int:
        return sum(ceil_div(count, size) * size - count for count in counts)

    candidates = range(1, min(counts) + 1) if len(counts) > 1 else range(counts[0], counts[0] + 1)
    good = [size for size in candidates if padding(size) <= max_padding * num_layers]
    if good:
        return max(good)
    return min(candidates, key=lambda size: (padding(size), -size))
