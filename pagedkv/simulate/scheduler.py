"""Schedulers as choices: named presets of the paged engine's admission and preemption knobs.

Owns :func:`with_scheduler` and :func:`parse_system`: ``greedy``, ``watermark``, ``swap``,
``vllm-v1`` and ``reserve-growth``, each a set of :class:`SimConfig` knobs over the same real
manager. Counterpart: vLLM's scheduler settings (v0's watermark and swap preemption, v1's
token budget and chunked prefill). The presets and an example: docs/simulate.md,
"Schedulers"; how they compare: docs/study.md, section 3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.baseline import RESERVE_RULES
from pagedkv.simulate.config import DEFAULT_SWAP_SPACE_BYTES, SimConfig

__all__ = ["DEFAULT_SWAP_SPACE_BYTES", "SCHEDULERS", "parse_system", "with_scheduler"]


#: ``name -> SimConfig fields`` it sets (swap's host pool is sized by :func:`with_scheduler`).
SCHEDULERS: dict[str, dict[str, Any]] = {
    "greedy": {"watermark": 0.01},
    "watermark": {"watermark": 0.10},
    "swap": {"watermark": 0.01, "preempt_mode": "swap"},
    "vllm-v1": {
        "watermark": 0.0,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "chunked_prefill": True,
    },
    "reserve-growth": {"watermark": 0.01, "growth_reserve_steps": 64},
}

_RESET: dict[str, Any] = {
    "max_num_seqs": None,
    "watermark": 0.01,
    "preempt_mode": "recompute",
    "num_host_blocks": 0,
    "max_num_batched_tokens": None,
    "chunked_prefill": False,
    "growth_reserve_steps": 0,
}


def with_scheduler(
    config: SimConfig, name: str, *, swap_space_bytes: int | None = None, **overrides: Any
) -> SimConfig:
    """``config`` with the knobs of scheduler ``name`` (then the caller's) set.

    The caller's knobs are remembered on the result: ``overrides`` given here,
    the ones an earlier call was given, and a fresh config's own
    ``max_num_seqs``. So applying a second preset (``--policies paged:NAME``
    after ``--scheduler``) resets only what the presets set.

    Args:
        config: the rest of the settings (budget, block size, cost model...).
        name: a key of :data:`SCHEDULERS`.
        swap_space_bytes: host memory for ``swap``, in the cost model's KV
            bytes (default: the earlier call's, else 4 GiB).
        overrides: SimConfig fields to set after the preset (``watermark=0.05``).

    Raises:
        ConfigError: an unknown name, or knobs that do not go together.

    >>> from pagedkv.simulate import Budget
    >>> base = SimConfig(Budget(4096), block_size=16)
    >>> twice = with_scheduler(with_scheduler(base, "vllm-v1", watermark=0.05), "greedy")
    >>> twice.max_num_seqs, twice.watermark
    (None, 0.05)
    """
    if name not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler {name!r}; expected one of {', '.join(SCHEDULERS)}")
    if config.scheduler_overrides is None:  # a fresh config: its own max_num_seqs is the caller's
        kept = {} if config.max_num_seqs is None else {"max_num_seqs": config.max_num_seqs}
    else:
        kept = dict(config.scheduler_overrides)
    kept.update(overrides)
    space = config.swap_space_bytes if swap_space_bytes is None else swap_space_bytes
    fields = dict(_RESET)
    fields.update(SCHEDULERS[name])
    if fields.get("preempt_mode") == "swap":
        block_bytes = config.block_size * config.cost.shape.bytes_per_token
        fields["num_host_blocks"] = max(1, space // block_bytes)
    fields.update(kept)
    return dataclasses.replace(
        config, scheduler=name, scheduler_overrides=tuple(sorted(kept.items())), swap_space_bytes=space,
        **fields,
    )


def parse_system(name: str) -> tuple[str, str | None]:
    """``"paged:vllm-v1"`` -> ``("paged", "vllm-v1")``; ``"contiguous"`` -> ``("contiguous", None)``.

    Raises:
        ConfigError: an unknown policy or scheduler.

    >>> parse_system("paged:swap"), parse_system("paged")
    (('paged', 'swap'), ('paged', None))
    """
    policy, _, scheduler = name.partition(":")
    if policy == "paged":
        if scheduler and scheduler not in SCHEDULERS:
            raise ConfigError(
                f"unknown scheduler {scheduler!r} in {name!r}; expected one of {', '.join(SCHEDULERS)}"
            )
        return policy, scheduler or None
    if policy in RESERVE_RULES and not scheduler:
        return policy, None
    raise ConfigError(
        f"unknown policy {name!r}; expected paged, paged:SCHEDULER ({', '.join(SCHEDULERS)}) "
        f"or {', '.join(RESERVE_RULES)}"
    )
