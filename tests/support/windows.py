"""Which earlier tokens a token sees: the rule every output check is computed from.

The token at logical index ``p`` in a layer with window ``W`` and ``S`` sink
tokens sees the sinks, then the newest ``W`` tokens, itself included::

    S = 2, W = 3, p = 9:   [0 1] 2 3 4 5 6 [7 8 9]
"""

from __future__ import annotations


def visible(position: int, num_sink_tokens: int, window: int | None) -> list[int]:
    """Logical indices the token at ``position`` attends to: the sinks, then the window.

    >>> visible(9, 2, 3)
    [0, 1, 7, 8, 9]
    >>> visible(1, 2, 3), visible(4, 0, None)
    ([0, 1], [0, 1, 2, 3, 4])
    """
    sinks = list(range(min(num_sink_tokens, position + 1)))
    start = num_sink_tokens if window is None else max(num_sink_tokens, position - window + 1)
    return sinks + list(range(start, position + 1))
