"""The ``pagedkv`` command line: ``pagedkv demo`` and friends.

Exit status: 0 on success, 1 when a check found a failure, 2 on bad usage,
130 when interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedkv.cli.args import (
    fraction,
    int_range,
    non_negative_float,
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
)
from pagedkv.cli.check import add_check_parser

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from pagedkv.cli.demo import run_demo

    return 1 if run_demo(args.tokens, seed=args.seed) else 0


# ---- pagedkv simulate / pagedkv viz (the study tools; modules imported only when run) ----


def _simulate(args: argparse.Namespace) -> int:
    from pagedkv.simulate.command import run_simulate

    return run_simulate(args)


def _viz(args: argparse.Namespace) -> int:
    from pagedkv.simulate.command import run_viz

    return run_viz(args)


# ---- limits of the demo's and the study's options ----

#: The most demo tokens: about 3 minutes at the demo's ~5,000 tokens a second.
MAX_DEMO_TOKENS = 1_000_000
#: The most synthetic requests: hours of simulation already, and every request is held in memory.
MAX_NUM_REQUESTS = 10_000_000
#: The most samples per request: the admission forks every sample, every time it tries.
MAX_SAMPLES = 10_000
#: numpy draws prefix groups as int64.
MAX_INT64 = 2**63 - 1


def _add_study_options(parser: argparse.ArgumentParser, defaults: dict[str, object]) -> None:
    """Workload, memory and model options shared by ``simulate`` and ``viz``."""
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        default=defaults["workload"],
        help="sharegpt (mean 161 prompt / 338 output tokens), alpaca (19 / 58), chat (multi-turn "
        "conversations under --prefix-groups system prompts of --prefix-len tokens), or a .jsonl file "
        "of requests (schema: pagedkv.simulate.workload) (default %(default)s)",
    )
    work.add_argument(
        "--num-requests", type=int_range(1, MAX_NUM_REQUESTS), default=defaults["num_requests"],
        help=f"synthetic requests, at most {MAX_NUM_REQUESTS:,} (default %(default)s)",
    )
    work.add_argument(
        "--seed", type=non_negative_int, default=0,
        help="seed of lengths, tokens and events, >= 0 (default 0)",
    )
    work.add_argument(
        "--n", type=int_range(1, MAX_SAMPLES), default=defaults.get("n", 1),
        help=f"samples per request, forked after prefill, at most {MAX_SAMPLES:,} (default %(default)s)",
    )
    work.add_argument(
        "--sampling", choices=("parallel", "beam"), default="parallel",
        help="parallel samples, or beam-like: beams pruned and re-forked as they decode (default parallel)",
    )
    work.add_argument(
        "--prefix-groups", type=int_range(0, MAX_INT64), default=defaults.get("prefix_groups", 0),
        help="requests share one of this many system prompts (default %(default)s)",
    )
    work.add_argument(
        "--prefix-len", type=non_negative_int, default=defaults.get("prefix_len", 0),
        help="tokens of each shared system prompt (default %(default)s)",
    )
    work.add_argument(
        "--arrival-rate", type=positive_float, default=None,
        help="requests arriving per step, Poisson (default: all at step 0)",
    )
    work.add_argument(
        "--request-rate", type=positive_float, default=None,
        help="requests arriving per model second, Poisson, timed by the cost model (default: none)",
    )
    work.add_argument(
        "--max-model-len", type=positive_int, default=defaults.get("max_model_len", 2048),
        help="longest sequence; the contiguous baseline reserves up to it (default %(default)s)",
    )
    memory = parser.add_argument_group("memory and scheduler")
    budget = memory.add_mutually_exclusive_group()
    budget.add_argument(
        "--memory", default=defaults.get("memory", "12GiB"),
        help="KV memory in bytes: 12GiB, 800MB, ... (default %(default)s)",
    )
    budget.add_argument(
        "--blocks", type=positive_int, default=None,
        help="KV memory as a number of blocks instead" + (
            f" (default {defaults['blocks']})" if defaults.get("blocks") else ""
        ),
    )
    parser.set_defaults(fallback_blocks=defaults.get("blocks"))
    memory.add_argument(
        "--block-size", type=positive_int, default=defaults.get("block_size", 16),
        help="token slots per block (default %(default)s)",
    )
    memory.add_argument("--window", type=positive_int, default=None, help="sliding window per sequence")
    memory.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction,
        default=defaults.get("prefix_caching", False),
        help="share cached full blocks of prompts (default %(default)s)",
    )
    memory.add_argument(
        "--max-num-seqs", type=positive_int, default=None, help="at most this many running sequences"
    )
    memory.add_argument(
        "--scheduler", default="greedy",
        help="the paged policy's scheduler: greedy, watermark, swap, vllm-v1, reserve-growth "
        "(pagedkv.simulate.scheduler; default greedy)",
    )
    memory.add_argument(
        "--watermark", type=fraction, default=None,
        help="share of blocks admission keeps free, as vLLM v0 (default: the scheduler's, 0.01 for greedy)",
    )
    memory.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=None,
        help="a token budget per step (default: the scheduler's; vllm-v1 2048)",
    )
    memory.add_argument(
        "--swap-space", default="4GiB", help="host memory for swap preemption (default 4GiB)"
    )
    memory.add_argument(
        "--host-tier-blocks", type=non_negative_int, default=0,
        help="a host tier of this many blocks below the device prefix cache: evicted blocks go there and "
        "load back at --host-bandwidth instead of being recomputed (needs --prefix-caching; default 0: none)",
    )
    memory.add_argument(
        "--host-tier-policy", choices=("lru", "s3fifo"), default="lru",
        help="the host tier's eviction (default lru)",
    )
    model = parser.add_argument_group(
        "modeled model (bytes per token = layers x kv heads x head_dim x 2 x bytes) and its step-time "
        "cost (docs/tutorial.md, pagedkv.simulate.cost)"
    )
    model.add_argument(
        "--cost-model", default="opt-13b-a100",
        help="preset: opt-13b-a100 (OPT-13B on one A100 40GB), llama-3-8b-h100 (default %(default)s)",
    )
    model.add_argument("--num-layers", type=positive_int, default=None, help="default: the preset's (40)")
    model.add_argument("--num-kv-heads", type=positive_int, default=None, help="default: the preset's (40)")
    model.add_argument("--head-dim", type=positive_int, default=None, help="default: the preset's (128)")
    model.add_argument("--dtype-bytes", type=positive_int, default=None, help="default: the preset's (2)")
    model.add_argument("--num-params", type=positive_float, default=None, help="model parameters")
    model.add_argument(
        "--memory-bandwidth", type=positive_float, default=None, help="device memory, bytes per second"
    )
    model.add_argument("--peak-flops", type=positive_float, default=None, help="FLOP per second")
    model.add_argument(
        "--step-overhead", type=non_negative_float, default=None, help="fixed seconds per step"
    )
    model.add_argument(
        "--host-bandwidth", type=positive_float, default=None,
        help="device <-> host copies (swap, host-tier loads), bytes per second "
        "(default: the preset's PCIe figure)",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--sample-every", type=positive_int, default=10,
        help="measure memory every this many steps (default 10)",
    )
    run.add_argument(
        "--check-invariants", action="store_true",
        help="check the manager's invariants and the simulator's bookkeeping after every step (slow)",
    )
    run.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar (same as --no-progress)")


def _add_study_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="simulate serving on the real manager: paged vs contiguous",
        description="A step-by-step continuous-batching simulation that drives the real KVCacheManager\n"
        "under a memory budget, next to the contiguous up-front reservation of earlier systems.",
        epilog="JSONL requests, one object per line (only output_len and prompt_len or prompt required):\n"
        '  {"prompt_len": 120, "output_len": 300, "prompt": [1, 2, ...], "n": 1, "sampling": "parallel",\n'
        '   "prefix_group": "sys-a", "prefix_len": 64, "max_output_len": 512, "arrival_step": 0}\n'
        "A guided study: docs/tutorial.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_study_options(simulate, {"workload": "sharegpt", "num_requests": 1000})
    out = simulate.add_argument_group("output")
    out.add_argument(
        "--policies", default="paged,contiguous",
        help="comma-separated: paged, paged:SCHEDULER (e.g. paged:vllm-v1), contiguous (reserve max "
        "length), contiguous-pow2, contiguous-oracle; all (the four policies), schedulers (paged under "
        "every scheduler) (default %(default)s)",
    )
    out.add_argument(
        "--rates", default=None,
        help="sweep request rates (requests per model second, e.g. 0.5,1,2 or 'default') for every "
        "policy; print normalised latency against rate (synthetic workloads)",
    )
    out.add_argument(
        "--slo", type=positive_float, default=0.1,
        help="with --rates: the normalised latency (s per output token) a sustained rate stays within "
        "(default 0.1)",
    )
    out.add_argument(
        "--replicas", type=positive_int, default=1,
        help="serve on this many replicas (each its own manager) behind each of --routers (default 1)",
    )
    out.add_argument(
        "--routers", default="round-robin,least-loaded,prefix-aware",
        help="with --replicas: round-robin, least-loaded, prefix-aware (by KV events) (default %(default)s)",
    )
    out.add_argument(
        "--turns", type=positive_int, default=4, help="--workload chat: turns per conversation (default 4)"
    )
    out.add_argument(
        "--think-time", type=non_negative_float, default=20.0,
        help="--workload chat: model seconds between a conversation's turns (default 20)",
    )
    out.add_argument("--sweep", action="store_true", help="sweep block sizes and windows; print a table")
    out.add_argument(
        "--block-sizes", default=None, help="for --sweep (default 1,2,4,8,16,32,64,128,256)"
    )
    out.add_argument("--windows", default=None, help="for --sweep, e.g. none,256,512 (default none)")
    out.add_argument(
        "--kernel-cost", default=None, metavar="PATH",
        help="for --sweep: the measured attention time per block size (JSON of "
        "benchmarks/bench_views.py, schema: pagedkv.simulate.kernel), or none to leave it out "
        "(default: the checkout's benchmarks/results/kernel_block_size.json, else the packaged copy)",
    )
    out.add_argument(
        "--hybrid-model", default=None, metavar="PRESET",
        help="serve a hybrid model (gemma3-27b-like, gpt-oss-like: sliding-window and full layers) with "
        "and without KV-cache groups: memory per request, latency against --rates (docs/study.md)",
    )
    out.add_argument(
        "--kv-allocation", choices=("grouped", "uniform", "both"), default="both",
        help="with --hybrid-model: one block table per KV-cache group (grouped), every layer keeps every "
        "token (uniform), or both side by side (default both)",
    )
    out.add_argument(
        "--host-tier-sweep", default=None, metavar="SIZES",
        help="serve the workload with a host tier of each size in blocks (e.g. 0,1000,4000 or "
        "'default'); print hit rates (device, host, total) and TTFT against size (docs/study.md)",
    )
    out.add_argument("--json", action="store_true", help="print JSON (wall-clock fields under 'timing')")
    simulate.set_defaults(run=_simulate)

    viz = commands.add_parser(
        "viz",
        help="pictures of the pool: text page maps, PNGs (plot extra)",
        description="Text page maps of the pool at chosen steps of a short simulation (who owns each block, "
        "shared blocks, cached free blocks, free blocks); with the plot extra (matplotlib), PNGs.",
    )
    _add_study_options(
        viz,
        {
            "workload": "alpaca",
            "num_requests": 16,
            "blocks": 128,
            "memory": None,
            "block_size": 4,
            "n": 2,
            "prefix_groups": 2,
            "prefix_len": 12,
            "prefix_caching": True,
            "max_model_len": 256,
        },
    )
    pics = viz.add_argument_group("pictures")
    pics.add_argument("--steps", default=None, help="steps to draw, e.g. 5,20,40 (default: four moments)")
    pics.add_argument("--width", type=positive_int, default=64, help="blocks per text row (default 64)")
    pics.add_argument(
        "--png", default=None,
        help="write PNGs instead: pagemap, occupancy, sweep, latency (against request rate), schedulers, "
        "routers, hybrid, tiers (comma-separated) or all; the last five use fixed settings; "
        "needs pagedkv[plot]",
    )
    pics.add_argument(
        "--out", type=output_folder, default=".", help="folder for PNGs (default: the current one)"
    )
    pics.add_argument(
        "--kernel-cost", default=None, metavar="PATH",
        help="for the sweep picture: measured attention time per block size (as simulate --kernel-cost)",
    )
    pics.add_argument(
        "--all", action="store_true",
        help="write the tutorial's figures (fixed settings) into --out, e.g. --out docs/images",
    )
    viz.set_defaults(run=_viz)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The argument parser, and each subcommand's own parser by name."""
    from pagedkv import __version__

    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="A paged key/value cache for transformer attention.",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="stream tokens through windowed caches; verify every output"
    )
    demo.add_argument(
        "--tokens", type=int_range(1, MAX_DEMO_TOKENS), default=300,
        help=f"tokens to stream, at most {MAX_DEMO_TOKENS:,} (default 300)",
    )
    demo.add_argument("--seed", type=non_negative_int, default=0, help="random seed, >= 0 (default 0)")
    demo.set_defaults(run=_demo)
    _add_study_parsers(commands)
    add_check_parser(commands)
    return parser, dict(commands.choices)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (130 after Ctrl-C, with one line on stderr)."""
    parser, commands = _build_parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # NOTE: argparse reports a subcommand's unknown flags from the top-level parser, with
        # "usage: pagedkv [-h] COMMAND ..."; the subcommand's own usage says which flags it takes.
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        # A progress bar may have left its line open on a terminal: end it first.
        start = "\n" if sys.stderr.isatty() else ""
        print(f"{start}pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
