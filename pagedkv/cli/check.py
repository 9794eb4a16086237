"""``pagedkv check MODULE:FACTORY``: the parser and the run of the conformance check.

The factory is loaded by :mod:`pagedkv.testing.check`, then
:func:`pagedkv.testing.check_cache` drives the caches it builds beside the oracle. The
verdict goes to stdout: passed, with how many examples and calls; or the shrunk failing
program as runnable Python. Exit status: 0 when the cache passed, 1 when a failure was
found, 2 on bad usage (a spec without ``:``, a module that does not import, a missing or
uncallable attribute, a factory that takes no ``max_size``, no Hypothesis). Hypothesis
and the state machine load when the command runs, so ``pagedkv demo`` never pays for them.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from typing import Any

from pagedkv.cli.args import finite_float, int_range, output_file, positive_int
from pagedkv.testing.check import UsageError, check_token_size, load_factory, require_hypothesis

__all__ = ["add_check_parser", "configure", "main", "parse_max_sizes", "run_check"]

_HEADS = {
    "one": ("one-head",),
    "multi": ("multi-head",),
    "gqa": ("grouped-query",),
    "all": ("one-head", "multi-head", "grouped-query"),
}


#: The most examples: hours of checking already.
MAX_EXAMPLES = 1_000_000
#: The most window sizes one ``--max-size`` range may name.
MAX_RANGE_SIZES = 10_000


def parse_max_sizes(text: str) -> tuple[int | None, ...]:
    """Parse ``--max-size``: comma-separated ``none``, ints and ranges ``A-B``.

    Args:
        text: e.g. ``"none,1-6"`` or ``"4"``.

    Returns:
        The window sizes, ``None`` for unbounded.

    Raises:
        argparse.ArgumentTypeError: an item is not ``none``, a positive int or a range.

    >>> parse_max_sizes("none,1-3,8")
    (None, 1, 2, 3, 8)
    """
    sizes: list[int | None] = []
    for item in text.lower().split(","):
        item = item.strip()
        try:
            if item == "none":
                sizes.append(None)
            elif "-" in item:
                low, high = (int(part) for part in item.split("-", 1))
                if low < 1 or high < low or high - low >= MAX_RANGE_SIZES:
                    raise ValueError(item)
                sizes += range(low, high + 1)
            else:
                if int(item) < 1:
                    raise ValueError(item)
                sizes.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--max-size takes none, positive ints and ranges like 1-6 "
                f"(of at most {MAX_RANGE_SIZES:,} sizes), got {item!r}"
            ) from None
    return tuple(dict.fromkeys(sizes))


def _heads(text: str) -> tuple[str, ...]:
    layouts: list[str] = []
    for item in text.split(","):
        if item.strip() not in _HEADS:
            raise argparse.ArgumentTypeError(
                f"--heads takes {', '.join(_HEADS)} (comma-separated), got {item!r}"
            )
        layouts += [layout for layout in _HEADS[item.strip()] if layout not in layouts]
    return tuple(layouts)


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``check`` options to ``parser``.

    Args:
        parser: the ``check`` subparser (or a standalone parser).

    Returns:
        ``parser``.
    """
    parser.add_argument(
        "spec", metavar="MODULE:FACTORY", help="e.g. pagedkv:KVCache or mycache:make"
    )
    parser.add_argument(
        "--max-examples", type=int_range(1, MAX_EXAMPLES), default=100,
        help=f"examples to try, at most {MAX_EXAMPLES:,} (default 100)"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a new one)")
    parser.add_argument(
        "--steps", type=positive_int, default=30, help="most steps per example (default 30)"
    )
    parser.add_argument(
        "--max-size", type=parse_max_sizes, default=(None, *range(1, 7)), metavar="SIZES",
        help="windows to draw: none, ints, ranges, e.g. none,1-6 (the default)",
    )
    parser.add_argument(
        "--heads", type=_heads, default=("one-head",), metavar="LAYOUTS",
        help="one (vectors [d], the default), multi, gqa, all; comma-separated",
    )
    parser.add_argument(
        "--head-dim", type=positive_int, default=4, help="largest head_dim (default 4)"
    )
    parser.add_argument(
        "--max-heads", type=positive_int, default=4, help="most query heads (default 4)"
    )
    parser.add_argument("--arrays", action="store_true", help="feed numpy arrays, not lists")
    parser.add_argument(
        "--precision", choices=("float64", "float32"), default="float64",
        help="what the cache computes in; sets the tolerance (default float64)",
    )
    parser.add_argument(
        "--scale", type=finite_float, default=1.0, help="the cache's score scale (default 1)"
    )
    parser.add_argument(
        "--caches", type=positive_int, default=2, help="most caches per example (default 2)"
    )
    parser.add_argument(
        "--no-close", action="store_true", help="do not call close() on the caches afterwards"
    )
    parser.add_argument(
        "-o", "--output", type=output_file, default=None, metavar="FILE",
        help="also write a failing program to FILE",
    )
    parser.set_defaults(run=run_check)
    return parser


def add_check_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to the ``pagedkv`` command line.

    Args:
        commands: the ``add_subparsers()`` object of the main parser.

    Returns:
        The new subparser.
    """
    parser: argparse.ArgumentParser = commands.add_parser(
        "check",
        help="run the conformance state machine against a cache factory",
        description="Drive the caches MODULE:FACTORY builds (factory(max_size=None) or "
        "factory(max_size=W), each with attend(q, k, v)) beside the naive oracle, and print "
        "a verdict: passed, or the shrunk failing program as runnable Python. Exit status "
        "0 on pass, 1 on a failure found, 2 on bad usage.",
    )
    return configure(parser)


def _rerun(args: argparse.Namespace, seed: int) -> str:
    parts = ["pagedkv", "check", args.spec, "--seed", str(seed)]
    defaults = configure(argparse.ArgumentParser()).parse_args([args.spec])
    for name in ("max_examples", "steps", "head_dim", "max_heads", "precision", "scale", "caches"):
        if getattr(args, name) != getattr(defaults, name):
            parts += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.max_size != defaults.max_size:
        parts += ["--max-size", ",".join("none" if s is None else str(s) for s in args.max_size)]
    if args.heads != defaults.heads:
        names = {layouts[0]: short for short, layouts in _HEADS.items() if len(layouts) == 1}
        parts += ["--heads", ",".join(names[layout] for layout in args.heads)]
    parts += ["--arrays"] * args.arrays + ["--no-close"] * args.no_close
    return " ".join(parts)


def run_check(args: argparse.Namespace) -> int:
    """Run ``pagedkv check`` with parsed arguments; print the verdict.

    Args:
        args: from the ``check`` parser.

    Returns:
        The exit status: 0 passed, 1 failure found, 2 bad usage.
    """
    try:
        check_token_size(args.heads, args.head_dim, args.max_heads)
        factory = load_factory(args.spec)
        require_hypothesis()
        from hypothesis import strategies as st

        from pagedkv.testing.stateful import check_cache
        from pagedkv.testing.strategies import shapes
    except UsageError as error:
        print(f"pagedkv check: error: {error}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    windows = ", ".join("None" if s is None else str(s) for s in args.max_size)
    print(
        f"Checking {args.spec}: {'/'.join(args.heads)}, head_dim <= {args.head_dim}, "
        f"max_size in [{windows}], {'arrays' if args.arrays else 'lists'}, {args.precision}; "
        f"{args.max_examples} examples of up to {args.steps} steps, seed {seed}.",
        flush=True,
    )
    verdict = check_cache(
        factory,
        max_examples=args.max_examples,
        seed=seed,
        steps=args.steps,
        feed="arrays" if args.arrays else "lists",
        shapes=shapes(layouts=args.heads, max_head_dim=args.head_dim, max_heads=args.max_heads),
        max_sizes=st.sampled_from(args.max_size),
        scale=args.scale,
        precision=args.precision,
        max_caches=args.caches,
        close=not args.no_close,
        factory_code=args.spec,
    )
    print(verdict.report(rerun=None if verdict.passed else _rerun(args, seed)), end="")
    if not verdict.passed and args.output and verdict.reproducer is not None:
        try:
            with open(args.output, "w", encoding="utf-8") as file:
                file.write(verdict.reproducer)
        except OSError as error:  # checked at parse time; the folder may still refuse it
            message = f"--output: cannot write {args.output!r}: {error.strerror}"
            print(f"pagedkv check: error: {message}", file=sys.stderr)
            return 2
        print(f"Wrote the failing program to {args.output}.")
    elif not verdict.passed and args.output:
        print(f"Wrote nothing to {args.output}: no program fails alone, see above.")
    return 0 if verdict.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``pagedkv check`` on its own: parse ``argv`` (without the word ``check``) and run.

    Args:
        argv: the arguments; default ``sys.argv[1:]``.

    Returns:
        The exit status.
    """
    parser = configure(argparse.ArgumentParser(prog="pagedkv check"))
    return run_check(parser.parse_args(argv))
