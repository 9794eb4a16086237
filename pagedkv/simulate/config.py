"""What the simulator is told: the modeled model, the memory budget, the scheduler's knobs.

Owns :class:`SimConfig`, :class:`Budget` and :func:`parse_bytes`; the modeled model's
bytes per token turn a budget in bytes into token slots. Counterpart: vLLM's
``EngineArgs`` / ``CacheConfig`` (``gpu_memory_utilization`` -> ``num_gpu_blocks``).
The formula and an example: docs/simulate.md, "The modeled model and the budget".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.shape import ModelShape
from pagedkv.tiers.host import HOST_POLICIES

#: vLLM's default swap space: 4 GiB of host memory per device.
DEFAULT_SWAP_SPACE_BYTES = 4 * 2**30

__all__ = ["Budget", "BudgetError", "ModelShape", "SimConfig", "parse_bytes"]


class BudgetError(ConfigError):
    """A memory budget that cannot hold what the workload needs (or is not a size at all)."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"12GiB"``, ``"800MB"``, ``"1.5 GiB"`` or ``"4096"`` into bytes.

    Decimal units (kB, MB, GB, TB) are powers of 1000; binary ones (KiB,
    MiB, GiB, TiB) powers of 1024; a bare number is bytes.

    Raises:
        BudgetError: not a size.

    >>> parse_bytes("1KiB"), parse_bytes("1.5kB")
    (1024, 1500)
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise BudgetError(f"not a memory size: {text!r}; write e.g. 12GiB, 800MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class Budget:
    """KV memory as a number of token slots (the same for every policy and block size).

    Attributes:
        num_tokens: token slots the memory holds.
        num_bytes: the bytes it came from, when given in bytes.
    """

    num_tokens: int
    num_bytes: int | None = None

    @classmethod
    def from_bytes(cls, num_bytes: int, model: ModelShape) -> Budget:
        """The token slots ``num_bytes`` of memory hold for ``model``."""
        return cls(num_bytes // model.bytes_per_token, num_bytes)

    @classmethod
    def from_blocks(cls, num_blocks: int, block_size: int) -> Budget:
        """The token slots of ``num_blocks`` blocks of ``block_size``."""
        return cls(num_blocks * block_size)

    def num_blocks(self, block_size: int) -> int:
        """Whole blocks of ``block_size`` that fit (what the paged policy gets)."""
        return self.num_tokens // block_size


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How one simulation runs.

    Attributes:
        budget: the KV memory, in token slots.
        block_size: token slots per block (paged policy).
        max_size: a sliding window per sequence, or None.
        enable_prefix_caching: share cached full blocks of prompts (paged).
        max_num_seqs: at most this many sequences run at once (vLLM's
            ``max_num_seqs``), or None for no limit but memory.
        sample_every: take the manager's full metrics every this many steps
            (occupancy and fragmentation are averaged over these samples;
            cheap counts are taken every step).
        check_every_step: call ``check_invariants()`` and the simulator's own
            consistency checks after every step (slow; for tests).
        watermark: admit a request only if this share of the blocks stays
            free after its prefill (vLLM v0's ``watermark``, 0.01 there too),
            so running sequences have room to grow before anyone is preempted.
        beam_replace_prob: beam-like sampling: per decode step, the chance that
            each beam but the first is pruned and replaced by a fork of another.
        seed: seeds the engine's own draws (generated token ids, beam events).
        cost: the step-time model that turns each step's work into model
            seconds (:mod:`pagedkv.simulate.cost`).
        scheduler: the scheduler's name, for reports (the knobs below are
            what it means; :mod:`pagedkv.simulate.scheduler` has the presets).
        preempt_mode: ``"recompute"`` (blocks freed, tokens re-fed later) or
            ``"swap"`` (blocks copied to a host pool of ``num_host_blocks``).
        num_host_blocks: the host pool for swap; a request that does not fit
            there is preempted by recompute instead.
        max_num_batched_tokens: a token budget per step (decode tokens
            first, then prefill), or None for no budget but memory.
        chunked_prefill: with a token budget, split a prompt that does not
            fit the step's remaining budget over several steps.
        growth_reserve_steps: admission also keeps free the blocks every
            running sequence needs for its next this many tokens (a thrash
            bound; 0 for none).
        num_host_tier_blocks: a host tier below the device prefix cache
            (the real :class:`pagedkv.tiers.HostTier`): blocks the device
            evicts go there, and an admission loads the run it holds past
            the device hit at ``cost.host_bandwidth`` instead of computing
            it; 0 for none. Needs prefix caching and no window.
        host_tier_policy: the host tier's eviction, ``"lru"`` or ``"s3fifo"``.
    """

    budget: Budget
    block_size: int = 16
    max_size: int | None = None
    enable_prefix_caching: bool = False
    max_num_seqs: int | None = None
    sample_every: int = 10
    check_every_step: bool = False
    watermark: float = 0.01
    beam_replace_prob: float = 0.2
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    scheduler: str = "greedy"
    preempt_mode: str = "recompute"
    num_host_blocks: int = 0
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = False
    growth_reserve_steps: int = 0
    num_host_tier_blocks: int = 0
    host_tier_policy: str = "lru"
    #: What the caller chose on top of the scheduler preset (``with_scheduler``
    #: keeps it, so applying another preset later keeps the caller's knobs),
    #: and the host memory for swap; None until a preset was applied.
    scheduler_overrides: tuple[tuple[str, Any], ...] | None = field(default=None, repr=False)
    swap_space_bytes: int = field(default=DEFAULT_SWAP_SPACE_BYTES, repr=False)

    def __post_init__(self) -> None:
        for name, minimum in (("block_size", 1), ("sample_every", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name in ("num_host_blocks", "growth_reserve_steps", "num_host_tier_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.preempt_mode not in ("recompute", "swap"):
            raise ConfigError(f"preempt_mode must be 'recompute' or 'swap', got {self.preempt_mode!r}")
        if self.preempt_mode == "swap" and not self.num_host_blocks:
            raise ConfigError("preempt_mode 'swap' needs num_host_blocks >= 1 (a host pool to swap into)")
        if self.host_tier_policy not in HOST_POLICIES:
            raise ConfigError(
                f"host_tier_policy must be one of {HOST_POLICIES}, got {self.host_tier_policy!r}"
            )
        if self.num_host_tier_blocks and (not self.enable_prefix_caching or self.max_size is not None):
            raise ConfigError(
                f"a host tier of {self.num_host_tier_blocks} blocks keeps prefix-cached blocks under full "
                "attention: turn prefix caching on and leave out the window"
            )
        if self.chunked_prefill and self.max_num_batched_tokens is None:
            raise ConfigError("chunked_prefill needs a token budget: set max_num_batched_tokens")
        for name in ("max_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if not 0.0 <= self.beam_replace_prob <= 1.0:
            raise ConfigError(f"beam_replace_prob must be in [0, 1], got {self.beam_replace_prob!r}")
        if self.budget.num_tokens < self.block_size:
            held = f"{self.budget.num_bytes} bytes hold" if self.budget.num_bytes is not None else "it holds"
            raise BudgetError(
                f"the memory budget is smaller than one block: {held} {self.budget.num_tokens} "
                f"token slots, one block is {self.block_size}; give more memory or a smaller block size"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks in the paged policy's pool."""
        return self.budget.num_blocks(self.block_size)

    @property
    def num_watermark_blocks(self) -> int:
        """Blocks admission keeps free: ``int(watermark * num_blocks)``."""
        return int(self.watermark * self.num_blocks)
