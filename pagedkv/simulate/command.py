"""``pagedkv simulate`` and ``pagedkv viz``: turn parsed options into a workload and a config, run, print.

The parsers themselves live in :mod:`pagedkv.cli`; this module is imported
only when a command runs. ``viz`` prints text page maps
(:mod:`pagedkv.simulate.pagemap`) or, with the ``plot`` extra, writes PNGs
(:mod:`pagedkv.simulate.plots`); ``pagedkv viz --all --out docs/images``
regenerates the tutorial's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError, PoolTooLargeError
from pagedkv.simulate.config import Budget, BudgetError, ModelShape, SimConfig, parse_bytes
from pagedkv.simulate.engine import PagedEngine
from pagedkv.simulate.pagemap import capture_page_maps, page_map_text
from pagedkv.simulate.plots import (
    MissingExtraError,
    plot_occupancy,
    plot_page_map,
    plot_sweep,
    pyplot,
    tutorial_figures,
)
from pagedkv.simulate.progress import wants_progress
from pagedkv.simulate.report import (
    POLICIES,
    format_report,
    format_sweep,
    no_progress,
    run_policy,
    simulate,
    stderr_progress,
    sweep,
)
from pagedkv.simulate.synthetic import DATASETS, synthetic
from pagedkv.simulate.workload import Workload, WorkloadError, load_jsonl

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
PICTURES = ("pagemap", "occupancy", "sweep")


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the options name: a synthetic dataset or a JSONL file.

    Raises:
        WorkloadError: an unknown name, a bad file or line, a bad parameter.
    """
    name = args.workload
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
                max_model_len=args.max_model_len,
            )
        except WorkloadError as error:  # the lengths do not fit: name the flags that set them
            flags = f"--workload {name} --max-model-len {args.max_model_len} --prefix-len {args.prefix_len}"
            raise WorkloadError(f"{error} ({flags})") from None
    if name.endswith(".jsonl") or "/" in name:
        return load_jsonl(name, seed=args.seed, max_model_len=args.max_model_len)
    raise WorkloadError(
        f"--workload: unknown workload {name!r}; give {' or '.join(sorted(DATASETS))}, or a .jsonl file"
    )


def build_config(args: argparse.Namespace) -> tuple[SimConfig, ModelShape]:
    """The simulation settings and the modeled model the options describe.

    Raises:
        BudgetError: a malformed size, or a budget smaller than one block.
        ConfigError: another setting out of range.
    """
    model = ModelShape(args.num_layers, args.num_kv_heads, args.head_dim, args.dtype_bytes)
    blocks = args.blocks
    if blocks is None and args.memory is None:
        blocks = getattr(args, "fallback_blocks", None)
    if blocks is not None:
        budget = Budget.from_blocks(blocks, args.block_size)
    else:
        budget = Budget.from_bytes(parse_bytes(args.memory), model)
    config = SimConfig(
        budget,
        block_size=args.block_size,
        max_size=args.window,
        enable_prefix_caching=args.prefix_caching,
        max_num_seqs=args.max_num_seqs,
        sample_every=args.sample_every,
        check_every_step=args.check_invariants,
        watermark=args.watermark,
        seed=args.seed,
    )
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
    """``"paged,contiguous"`` or ``"all"`` into policy names.

    Raises:
        ConfigError: an unknown policy, or none.
    """
    return parse_choices(text, POLICIES, name="--policies", what="policy")


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
    for flag, value in (("--block-sizes", args.block_sizes), ("--windows", args.windows)):
        if value is not None and not args.sweep:
            raise ConfigError(f"{flag} is for --sweep; add --sweep, or leave {flag} out")
    block_sizes = list(SWEEP_BLOCK_SIZES)
    if args.block_sizes is not None:
        block_sizes = parse_list(args.block_sizes, name="--block-sizes")
    windows = [None] if args.windows is None else parse_list(args.windows, allow_none=True, name="--windows")
    policies = parse_policies(args.policies)
    workload = build_workload(args)
    config, model = build_config(args)
    progress = stderr_progress() if wants_progress(args.progress) else no_progress
    if args.sweep:
        baseline = next((p for p in policies if p != "paged"), None)
        rows = sweep(workload, config, block_sizes, windows, baseline=baseline, progress=progress)
        if args.json:
            data = {
                "workload": workload.stats(),
                "config": {
                    "budget_tokens": config.budget.num_tokens,
                    "budget_bytes": config.budget.num_bytes,
                },
                "sweep": [row.as_dict() for row in rows],
                "timing": [row.result.timing() for row in rows],
            }
            print(json.dumps(data, indent=2))
        else:
            stats = workload.stats()
            print(
                f"sweep: {stats['source']}, seed {stats['seed']}; the same memory, "
                f"{config.budget.num_tokens:,} token slots, at every point\n"
            )
            print(format_sweep(rows))
        return 0
    report = simulate(workload, config, policies, model=model, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
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
        _write_pictures(args.out, lambda: tutorial_figures(args.out))
        return 0
    kinds = None if args.png is None else parse_choices(args.png, PICTURES, name="--png", what="picture")
    steps = parse_list(args.steps, name="--steps", minimum=0) if args.steps is not None else None
    workload = build_workload(args)
    config, _ = build_config(args)
    if kinds is not None:
        return _png(kinds, args.out, workload, config)
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


def _png(kinds: Sequence[str], out_dir: str, workload: Workload, config: SimConfig) -> int:
    pyplot()
    _write_pictures(out_dir, lambda: _plot(kinds, Path(out_dir), workload, config))
    return 0


def _plot(kinds: Sequence[str], out: Path, workload: Workload, config: SimConfig) -> None:
    for kind in kinds:
        if kind == "pagemap":
            page_maps, _ = capture_page_maps(workload, config)
            path = plot_page_map(page_maps, out / "pagemap.png")
        elif kind == "occupancy":
            paged = run_policy("paged", workload, config)
            contiguous = run_policy("contiguous", workload, config)
            path = plot_occupancy(paged, contiguous, out / "occupancy.png")
        else:
            rows = sweep(workload, config, list(SWEEP_BLOCK_SIZES))
            path = plot_sweep(rows, out / "block_size_sweep.png")
        print(f"wrote {os.fspath(path)}")
