"""From parsed command-line options to the objects a study runs on: workload, cost model, config, names.

``pagedkv simulate`` and ``pagedkv viz`` (:mod:`pagedkv.simulate.command`)
share these; each raises a typed error naming the flag at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.simulate.config import Budget, BudgetError, ModelShape, SimConfig, parse_bytes
from pagedkv.simulate.conversations import conversations
from pagedkv.simulate.cost import COST_PRESETS, CostModel
from pagedkv.simulate.kernel import KernelCost, load_kernel_cost
from pagedkv.simulate.ratesweep import DEFAULT_RATES
from pagedkv.simulate.report import POLICIES
from pagedkv.simulate.router import ROUTERS
from pagedkv.simulate.scheduler import SCHEDULERS, parse_system, with_scheduler
from pagedkv.simulate.synthetic import DATASETS, synthetic
from pagedkv.simulate.workload import Workload, WorkloadError, load_jsonl

__all__ = [
    "build_config",
    "build_cost",
    "build_kernel_cost",
    "build_workload",
    "parse_choices",
    "parse_list",
    "parse_policies",
    "parse_rates",
    "parse_routers",
]


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the options name: a synthetic dataset or a JSONL file.

    Raises:
        WorkloadError: an unknown name, a bad file or line, a bad parameter.
    """
    name = args.workload
    if name == "chat":
        return conversations(
            args.num_requests,
            num_turns=getattr(args, "turns", 4),
            num_system_prompts=max(1, args.prefix_groups),
            system_prompt_len=args.prefix_len if args.prefix_len else 200,
            rate=args.request_rate if args.request_rate is not None else 1.0,
            think_s=getattr(args, "think_time", 20.0),
            seed=args.seed,
            max_model_len=args.max_model_len,
        )
    if name in DATASETS:
        try:
            return synthetic(
                name,
                args.num_requests,
                seed=args.seed,
                n=args.n,
                sampling=args.sampling,
                num_prefix_groups=args.prefix_groups,
                prefix_len=args.prefix_len,
                arrival_rate=args.arrival_rate,
                request_rate=args.request_rate,
                max_model_len=args.max_model_len,
            )
        except WorkloadError as error:  # the lengths do not fit: name the flags that set them
            flags = f"--workload {name} --max-model-len {args.max_model_len} --prefix-len {args.prefix_len}"
            raise WorkloadError(f"{error} ({flags})") from None
    if name.endswith(".jsonl") or "/" in name:
        return load_jsonl(name, seed=args.seed, max_model_len=args.max_model_len)
    raise WorkloadError(
        f"--workload: unknown workload {name!r}; give {', '.join(sorted(DATASETS))}, chat or a .jsonl file"
    )


def build_cost(args: argparse.Namespace) -> CostModel:
    """The cost model the options name: a preset, with any parameter given on the command line.

    Raises:
        ConfigError: an unknown preset or a parameter out of range.
    """
    if args.cost_model not in COST_PRESETS:
        raise ConfigError(
            f"--cost-model: unknown preset {args.cost_model!r}; expected {', '.join(COST_PRESETS)}"
        )
    preset = COST_PRESETS[args.cost_model]
    shape_fields = {
        name: value
        for name, value in (
            ("num_layers", args.num_layers),
            ("num_kv_heads", args.num_kv_heads),
            ("head_dim", args.head_dim),
            ("dtype_bytes", args.dtype_bytes),
        )
        if value is not None
    }
    cost_fields: dict[str, Any] = {
        name: value
        for name, value in (
            ("num_params", args.num_params),
            ("memory_bandwidth", args.memory_bandwidth),
            ("peak_flops", args.peak_flops),
            ("step_overhead_s", args.step_overhead),
            ("host_bandwidth", args.host_bandwidth),
        )
        if value is not None
    }
    if shape_fields:
        cost_fields["shape"] = dataclasses.replace(preset.shape, **shape_fields)
    if cost_fields:
        cost_fields["name"] = f"{preset.name} (changed)"
        return dataclasses.replace(preset, **cost_fields)
    return preset


def build_kernel_cost(args: argparse.Namespace) -> KernelCost | None:
    """The measured kernel cost ``--kernel-cost`` names (``none``: None; not given: the default file).

    Raises:
        KernelCostError: the file is missing, not JSON, or not of the schema.
    """
    path = getattr(args, "kernel_cost", None)
    if path is not None and path.strip().lower() == "none":
        return None
    return load_kernel_cost(path)


def build_config(args: argparse.Namespace) -> tuple[SimConfig, ModelShape]:
    """The simulation settings and the modeled model the options describe.

    Raises:
        BudgetError: a malformed size, or a budget smaller than one block.
        ConfigError: another setting out of range, an unknown scheduler or cost preset.
    """
    cost = build_cost(args)
    model = cost.shape
    blocks = args.blocks
    if blocks is None and args.memory is None:
        blocks = getattr(args, "fallback_blocks", None)
    if blocks is not None:
        budget = Budget.from_blocks(blocks, args.block_size)
    else:
        budget = Budget.from_bytes(parse_bytes(args.memory), model)
    num_host_tier_blocks = getattr(args, "host_tier_blocks", 0)
    if num_host_tier_blocks and (not args.prefix_caching or args.window is not None):
        raise ConfigError(
            f"--host-tier-blocks {num_host_tier_blocks} keeps prefix-cached blocks under full attention: "
            "add --prefix-caching and leave out --window"
        )
    config = SimConfig(
        budget,
        block_size=args.block_size,
        num_host_tier_blocks=num_host_tier_blocks,
        host_tier_policy=getattr(args, "host_tier_policy", "lru"),
        max_size=args.window,
        enable_prefix_caching=args.prefix_caching,
        max_num_seqs=args.max_num_seqs,
        sample_every=args.sample_every,
        check_every_step=args.check_invariants,
        seed=args.seed,
        cost=cost,
    )
    overrides: dict[str, Any] = {}
    if args.watermark is not None:
        overrides["watermark"] = args.watermark
    if args.max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
    try:
        swap_space = parse_bytes(args.swap_space)
    except BudgetError as error:
        raise ConfigError(f"--swap-space: {error}") from None
    if args.scheduler not in SCHEDULERS:
        raise ConfigError(
            f"--scheduler: unknown scheduler {args.scheduler!r}; expected {', '.join(SCHEDULERS)}"
        )
    config = with_scheduler(config, args.scheduler, swap_space_bytes=swap_space, **overrides)
    return config, model


def parse_list(text: str, *, allow_none: bool = False, name: str = "list", minimum: int = 1) -> list[Any]:
    """Parse ``"1,2,4"`` (or ``"none,256"`` with ``allow_none``) into ints (and None), repeats dropped.

    Raises:
        ConfigError: an entry is not an int >= ``minimum`` (or ``none``).

    >>> parse_list("none,256,256", allow_none=True)
    [None, 256]
    """
    values: list[Any] = []
    for part in text.split(","):
        part = part.strip().lower()
        if allow_none and part in ("none", "off"):
            values.append(None)
            continue
        try:
            value = int(part) if part.isdecimal() else -1  # not "+4", "4_0", "²" or "nan"
        except ValueError:  # more than 4,300 digits
            value = -1
        if value < minimum:
            raise ConfigError(f"{name}: {part!r} is not an int >= {minimum}")
        values.append(value)
    return list(dict.fromkeys(values))


def parse_choices(text: str, choices: Sequence[str], *, name: str, what: str = "name") -> list[str]:
    """Parse comma-separated names among ``choices`` (``all`` for every one), repeats dropped.

    Args:
        text: what the user typed, e.g. ``"paged,contiguous"``.
        choices: the names known.
        name: the flag, for the message.
        what: what a name is, for the message (``"policy"``).

    Raises:
        ConfigError: an unknown (or empty) name.

    >>> parse_choices("sweep,all", ("pagemap", "sweep"), name="--png")
    ['sweep', 'pagemap']
    """
    names: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if part not in (*choices, "all"):
            raise ConfigError(f"{name}: unknown {what} {part!r}; expected {', '.join(choices)} or all")
        names += choices if part == "all" else [part]
    return list(dict.fromkeys(names))


def parse_policies(text: str) -> list[str]:
    """``"paged,paged:swap,contiguous"``, ``"all"`` or ``"schedulers"`` into policy names.

    Raises:
        ConfigError: an unknown policy or scheduler, or none.

    >>> parse_policies("paged:swap,contiguous")
    ['paged:swap', 'contiguous']
    """
    names: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "schedulers":
            names += [f"paged:{name}" for name in SCHEDULERS]
        elif part.startswith("paged:"):
            try:
                parse_system(part)
            except ConfigError as error:
                raise ConfigError(f"--policies: {error}") from None
            names.append(part)
        else:
            names += parse_choices(part, POLICIES, name="--policies", what="policy")
    return list(dict.fromkeys(names))


def parse_rates(text: str, dataset: str) -> list[float]:
    """``"0.5,1,2"`` (or ``"default"``: the dataset's) into request rates.

    Raises:
        ConfigError: an entry is not a finite number > 0.

    >>> parse_rates("0.5,2", "sharegpt"), len(parse_rates("default", "alpaca"))
    ([0.5, 2.0], 10)
    """
    if text.strip() == "default":
        return list(DEFAULT_RATES.get(dataset, DEFAULT_RATES["sharegpt"]))
    rates = []
    for part in text.split(","):  # also "nan", "inf", "-1": not rates
        try:
            rate = float(part)
        except ValueError:
            rate = -1.0
        if not 0 < rate < float("inf"):
            raise ConfigError(f"--rates: {part.strip()!r} is not a number of requests per second > 0")
        rates.append(rate)
    return list(dict.fromkeys(rates))


def parse_routers(text: str) -> list[str]:
    """``"round-robin,prefix-aware"`` into router names.

    Raises:
        ConfigError: an unknown router.
    """
    return parse_choices(text, ROUTERS, name="--routers", what="router")
