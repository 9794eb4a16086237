"""The ``pagedkv`` command line: ``pagedkv demo`` and friends.

Exit status: 0 on success, 1 when a check found a failure, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from pagedkv.demo import run_demo

    return 1 if run_demo(args.tokens, seed=args.seed) else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="A paged key/value cache for transformer attention.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="stream tokens through windowed caches on a shared pool and verify every output"
    )
    demo.add_argument("--tokens", type=int, default=300, help="tokens to stream (default 300)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
