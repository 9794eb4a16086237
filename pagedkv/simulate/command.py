"""``pagedkv simulate`` and ``pagedkv viz``: turn parsed options into a workload and a config, run, print.

The parsers themselves live in :mod:`pagedkv.cli`; this module is imported
only when a command runs. ``viz`` prints text page maps
(:mod:`pagedkv.simulate.pagemap`) or, with the ``plot`` extra, writes PNGs
(:mod:`pagedkv.simulate.plots`); ``pagedkv viz --all --out docs/images``
regenerates the tutorial's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError, PoolTooLargeError
from pagedkv.simulate.cluster import format_cluster, run_cluster
from pagedkv.simulate.config import Budget, BudgetError, SimConfig
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.figures import tutorial_figures
from pagedkv.simulate.hybrid import ALLOCATIONS, HYBRID_PRESETS, HYBRID_RATES, format_hybrid, hybrid_study
from pagedkv.simulate.kernel import KernelCost
from pagedkv.simulate.options import (
    build_config,
    build_kernel_cost,
    build_workload,
    parse_choices,
    parse_list,
    parse_policies,
    parse_rates,
    parse_routers,
)
from pagedkv.simulate.pagemap import capture_page_maps, page_map_text
from pagedkv.simulate.plots import (
    MissingExtraError,
    plot_occupancy,
    plot_page_map,
    pyplot,
)
from pagedkv.simulate.plots_hybrid import hybrid_figure
from pagedkv.simulate.plots_serving import serving_figures
from pagedkv.simulate.plots_sweep import plot_sweep
from pagedkv.simulate.plots_tiers import tiers_figure
from pagedkv.simulate.progress import Progress, wants_progress
from pagedkv.simulate.ratesweep import format_rate_sweep, rate_sweep, sustained_rates
from pagedkv.simulate.report import (
    ProgressFactory,
    describe_config,
    format_report,
    format_sweep,
    no_progress,
    run_policy,
    simulate,
    stderr_progress,
    sweep,
)
from pagedkv.simulate.sweep_kernel import format_kernel_side, sweep_as_dicts
from pagedkv.simulate.synthetic import DATASETS, synthetic
from pagedkv.simulate.tierstudy import DEFAULT_HOST_TIER_SIZES, format_tier_study, tier_study
from pagedkv.simulate.workload import Workload, WorkloadError

__all__ = [
    "SWEEP_BLOCK_SIZES",
    "build_config",
    "build_workload",
    "parse_choices",
    "parse_list",
    "run_simulate",
    "run_viz",
]

#: The block sizes ``--sweep`` (and ``viz --png sweep``) tries by default.
SWEEP_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: What ``viz --png`` can draw.
PICTURES = ("pagemap", "occupancy", "sweep", "latency", "schedulers", "routers", "hybrid", "tiers")
#: The pictures of the serving study (fixed settings: pagedkv.simulate.plots_serving).
SERVING_PICTURES = ("latency", "schedulers", "routers")


def stdout_closed() -> int:
    """The reader of stdout went away (``pagedkv ... | head``): stop quietly, status 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush does not fail again
    return 0


def _budget_flag(args: argparse.Namespace) -> str:
    """The flag that set the memory budget, with its value, for an error message."""
    if args.blocks is not None:
        return f"--blocks {args.blocks}"
    if args.memory is not None:
        return f"--memory {shlex.quote(args.memory)}"
    return f"--blocks {args.fallback_blocks} (the default)"


def _run(name: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command: bad input or a missing extra exits 2 with one line on stderr."""
    try:
        try:
            return command(args)
        except (BudgetError, PoolTooLargeError) as error:
            print(f"pagedkv {name}: error: {_budget_flag(args)}: {error}", file=sys.stderr)
            return 2
        except (WorkloadError, ConfigError, MissingExtraError) as error:
            print(f"pagedkv {name}: error: {error}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        return stdout_closed()


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``pagedkv simulate``; return the exit status (2 on bad input)."""
    return _run("simulate", _simulate, args)


def _simulate(args: argparse.Namespace) -> int:
    flags = (
        ("--block-sizes", args.block_sizes),
        ("--windows", args.windows),
        ("--kernel-cost", args.kernel_cost),
    )
    for flag, value in flags:
        if value is not None and not args.sweep:
            raise ConfigError(f"{flag} is for --sweep; add --sweep, or leave {flag} out")
    block_sizes = list(SWEEP_BLOCK_SIZES)
    if args.block_sizes is not None:
        block_sizes = parse_list(args.block_sizes, name="--block-sizes")
    windows = [None] if args.windows is None else parse_list(args.windows, allow_none=True, name="--windows")
    policies = parse_policies(args.policies)
    if args.hybrid_model is not None:
        return _hybrid(args)
    if args.kv_allocation != "both":
        raise ConfigError("--kv-allocation is for --hybrid-model; add --hybrid-model, or leave it out")
    if args.host_tier_sweep is not None:
        return _tier_sweep(args)
    if args.rates is not None:
        return _rate_sweep(args, policies)
    if args.replicas > 1:
        return _cluster(args)
    workload = build_workload(args)
    config, model = build_config(args)
    baseline = next((p for p in policies if p != "paged"), None)
    num_runs = len(windows) * (len(block_sizes) + (baseline is not None)) if args.sweep else len(policies)
    progress: ProgressFactory = no_progress
    if _wants_progress(args):
        progress = stderr_progress(num_runs=num_runs, what="run" if args.sweep else "policy")
    if args.sweep:
        kernel = build_kernel_cost(args)  # checked before any run: a bad file costs nothing
        rows = sweep(workload, config, block_sizes, windows, baseline=baseline, progress=progress)
        if args.json:
            data = {
                "workload": workload.stats(),
                "config": {
                    "budget_tokens": config.budget.num_tokens,
                    "budget_bytes": config.budget.num_bytes,
                    "cost": config.cost.describe(),
                },
                "kernel_cost": None if kernel is None else kernel.describe(),
                "sweep": sweep_as_dicts(rows, kernel),
                "timing": [row.result.timing() for row in rows],
            }
            print(json.dumps(data, indent=2))
        else:
            stats = workload.stats()
            print(
                f"sweep: {stats['source']}, seed {stats['seed']}; the same memory, "
                f"{config.budget.num_tokens:,} token slots, at every point; cost model {config.cost.name}\n"
            )
            print(format_sweep(rows) if kernel is None else format_kernel_side(rows, kernel))
        return 0
    report = simulate(workload, config, policies, model=model, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def _cluster(args: argparse.Namespace) -> int:
    if args.sweep:
        raise ConfigError("--replicas and --sweep are two studies; give one")
    routers = parse_routers(args.routers)
    workload = build_workload(args)
    config, model = build_config(args)
    bar = Progress("routers", len(routers), unit="routers") if _wants_progress(args) else None
    results = []
    for name in routers:
        results.append(run_cluster(workload, config, args.replicas, name))
        if bar is not None:
            bar.update(len(results), name)
    if bar is not None:
        bar.close(len(results))
    if args.json:
        data = {
            "workload": workload.stats(),
            "config": describe_config(config, model),
            "num_replicas": args.replicas,
            "routers": [result.as_dict() for result in results],
        }
        print(json.dumps(data, indent=2))
        return 0
    stats = workload.stats()
    print(
        f"cluster: {args.replicas} replicas, each {config.num_blocks:,} blocks of {config.block_size}, "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}, scheduler {config.scheduler}; "
        f"{stats['source']}: {stats['num_requests']:,} requests\n"
    )
    print(format_cluster(results))
    return 0


def _hybrid(args: argparse.Namespace) -> int:
    if args.hybrid_model not in HYBRID_PRESETS:
        raise ConfigError(
            f"--hybrid-model: unknown preset {args.hybrid_model!r}; expected {', '.join(HYBRID_PRESETS)}"
        )
    for flag, clash in (("--sweep", args.sweep), ("--replicas", args.replicas > 1)):
        if clash:
            raise ConfigError(f"--hybrid-model and {flag} are two studies; give one")
    if args.workload not in DATASETS:
        raise ConfigError(f"--hybrid-model needs a synthetic workload ({', '.join(sorted(DATASETS))})")
    if args.request_rate is not None or args.arrival_rate is not None:
        raise ConfigError("--hybrid-model sweeps --rates itself; leave out --request-rate and --arrival-rate")
    shape_flags = ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes")
    given = [f"--{name.replace('_', '-')}" for name in shape_flags if getattr(args, name) is not None]
    if given:
        raise ConfigError(f"--hybrid-model sets the model's shape itself; leave out {', '.join(given)}")
    model = HYBRID_PRESETS[args.hybrid_model]
    rates = list(HYBRID_RATES[model.name])
    if args.rates is not None and args.rates.strip() != "default":
        rates = parse_rates(args.rates, args.workload)
    allocations = ALLOCATIONS if args.kv_allocation == "both" else (args.kv_allocation,)
    config, _ = build_config(args)
    if config.budget.num_bytes is None:
        raise ConfigError("--hybrid-model needs the memory in bytes: give --memory, not --blocks")
    config = dataclasses.replace(config, budget=Budget.from_bytes(config.budget.num_bytes, model.shape))
    options = _workload_options(args)
    num_runs = len(rates) * len(allocations)
    bar = Progress("hybrid study", num_runs, unit="runs") if _wants_progress(args) else None
    try:
        study = hybrid_study(
            model, config, rates, allocations=allocations,
            workload=(args.workload, args.num_requests, options), slo=args.slo, progress=bar,
        )  # fmt: skip
    except WorkloadError as error:  # the lengths do not fit: name the flags that set them
        flags = f"--workload {args.workload} --max-model-len {args.max_model_len}"
        raise WorkloadError(f"{error} ({flags})") from None
    print(json.dumps(study.as_dict(), indent=2) if args.json else format_hybrid(study))
    return 0


def _tier_sweep(args: argparse.Namespace) -> int:
    for flag, clash in (("--sweep", args.sweep), ("--replicas", args.replicas > 1), ("--rates", args.rates)):
        if clash:
            raise ConfigError(f"--host-tier-sweep and {flag} are two studies; give one")
    if args.host_tier_blocks:
        raise ConfigError("--host-tier-sweep sets the host tier's size itself; leave out --host-tier-blocks")
    if not args.prefix_caching:
        raise ConfigError("--host-tier-sweep keeps prefix-cached blocks: add --prefix-caching")
    text = args.host_tier_sweep.strip().lower()
    sizes = list(DEFAULT_HOST_TIER_SIZES)
    if text != "default":
        sizes = parse_list(text, name="--host-tier-sweep", minimum=0)
    workload = build_workload(args)
    config, _ = build_config(args)
    bar = Progress("host-tier study", len(sizes), unit="runs") if _wants_progress(args) else None
    study = tier_study(workload, config, sizes, progress=bar)
    print(json.dumps(study.as_dict(), indent=2) if args.json else format_tier_study(study))
    return 0


def _wants_progress(args: argparse.Namespace) -> bool:
    return not args.quiet and wants_progress(args.progress)


def _rate_sweep(args: argparse.Namespace, policies: list[str]) -> int:
    if args.sweep:
        raise ConfigError("--rates and --sweep are two studies; give one")
    if args.workload not in DATASETS:
        raise ConfigError(f"--rates needs a synthetic workload ({' or '.join(sorted(DATASETS))})")
    if args.request_rate is not None or args.arrival_rate is not None:
        raise ConfigError("--rates sets the request rate itself; leave out --request-rate and --arrival-rate")
    rates = parse_rates(args.rates, args.workload)
    config, model = build_config(args)
    options = _workload_options(args)
    bar = Progress("rate sweep", len(rates) * len(policies), unit="runs") if _wants_progress(args) else None
    points = rate_sweep(
        args.workload, args.num_requests, config, rates, policies,
        seed=args.seed, workload_options=options, progress=bar,
    )  # fmt: skip
    if args.json:
        data = {
            "workload": synthetic(args.workload, args.num_requests, seed=args.seed, **options).stats(),
            "config": describe_config(config, model),
            "slo": args.slo,
            "rate_sweep": [point.as_dict() for point in points],
            "sustained_rates": sustained_rates(points, args.slo),
            "timing": [point.result.timing() for point in points],
        }
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"rate sweep: {args.workload} x {args.num_requests:,} requests per run, seed {args.seed}, Poisson "
        f"arrivals; {config.budget.num_tokens:,} token slots of KV memory; cost model {config.cost.name}; "
        f"paged scheduler {config.scheduler}\n"
    )
    print(format_rate_sweep(points, args.slo))
    return 0


# -------------------------------------------------------------------- viz


def _auto_steps(num_steps: int) -> list[int]:
    """Four moments: the first step, two in the middle, near the end."""
    return sorted({0, num_steps // 4, num_steps // 2, max(0, num_steps - 2)})


def run_viz(args: argparse.Namespace) -> int:
    """Run ``pagedkv viz``; return the exit status (2 on bad input or a missing extra)."""
    return _run("viz", _viz, args)


def _viz(args: argparse.Namespace) -> int:
    if args.all:
        kernel = build_kernel_cost(args)
        _write_pictures(
            args.out,
            lambda: (tutorial_figures(args.out, kernel=kernel), serving_figures(args.out, SERVING_PICTURES)),
        )
        return 0
    kinds = None if args.png is None else parse_choices(args.png, PICTURES, name="--png", what="picture")
    steps = parse_list(args.steps, name="--steps", minimum=0) if args.steps is not None else None
    workload = build_workload(args)
    config, _ = build_config(args)
    if kinds is not None:
        kernel = build_kernel_cost(args) if "sweep" in kinds else None
        return _png(kinds, args.out, workload, config, kernel)
    if steps is None:
        num_steps = PagedEngine(workload, config).run().num_steps
        steps = _auto_steps(num_steps)
    page_maps, result = capture_page_maps(workload, config, steps)
    stats = workload.stats()
    print(
        f"pagedkv viz: {stats['source']}, seed {stats['seed']}; {config.num_blocks} blocks x "
        f"{config.block_size} slots, prefix caching {'on' if config.enable_prefix_caching else 'off'}; "
        f"the run took {result.num_steps} steps\n"
    )
    for index, page_map in enumerate(page_maps):
        print(page_map_text(page_map, args.width, legend=index == len(page_maps) - 1))
        print()
    missing = sorted(set(steps) - {page_map.step for page_map in page_maps})
    if missing:
        print(f"(no step {', '.join(map(str, missing))}: the run ended after step {result.num_steps - 1})")
    return 0


def _write_pictures(out: str, write: Callable[[], object]) -> None:
    """Run ``write``; a folder that refuses the files is bad usage (``--out`` was checked when parsed)."""
    try:
        write()
    except OSError as error:
        raise ConfigError(f"--out: cannot write into {out!r}: {error.strerror or error}") from None


def _png(
    kinds: Sequence[str], out_dir: str, workload: Workload, config: SimConfig, kernel: KernelCost | None
) -> int:
    pyplot()
    _write_pictures(out_dir, lambda: _plot(kinds, Path(out_dir), workload, config, kernel))
    return 0


def _plot(
    kinds: Sequence[str], out: Path, workload: Workload, config: SimConfig, kernel: KernelCost | None
) -> None:
    for kind in kinds:
        if kind in SERVING_PICTURES:
            serving_figures(out, [kind])
            continue
        if kind == "hybrid":
            print(f"wrote {os.fspath(hybrid_figure(out))}")
            continue
        if kind == "tiers":
            print(f"wrote {os.fspath(tiers_figure(out))}")
            continue
        if kind == "pagemap":
            page_maps, _ = capture_page_maps(workload, config)
            path = plot_page_map(page_maps, out / "pagemap.png")
        elif kind == "occupancy":
            paged = run_policy("paged", workload, config)
            contiguous = run_policy("contiguous", workload, config)
            path = plot_occupancy(paged, contiguous, out / "occupancy.png")
        else:
            rows = sweep(workload, config, list(SWEEP_BLOCK_SIZES))
            path = plot_sweep(rows, out / "block_size_sweep.png", kernel=kernel)
        print(f"wrote {os.fspath(path)}")


def _workload_options(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic workload's options a rate sweep passes to every run (``synthetic(**options)``)."""
    return {
        "n": args.n,
        "sampling": args.sampling,
        "num_prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "max_model_len": args.max_model_len,
    }
