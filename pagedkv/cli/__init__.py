"""The ``pagedkv`` command line: ``demo``, ``simulate``, ``viz``, ``check``.

A tool on top of the library; nothing in the core imports it. ``args`` holds the
argparse types every subcommand shares, ``check`` the ``pagedkv check`` parser.
vLLM's counterpart is the ``vllm`` command (``vllm/entrypoints/cli/``).
"""

from pagedkv.cli.args import (
    finite_float,
    fraction,
    int_range,
    non_negative_float,
    non_negative_int,
    output_file,
    output_folder,
    positive_float,
    positive_int,
)
from pagedkv.cli.main import build_parser, main

__all__ = [
    "build_parser",
    "finite_float",
    "fraction",
    "int_range",
    "main",
    "non_negative_float",
    "non_negative_int",
    "output_file",
    "output_folder",
    "positive_float",
    "positive_int",
]
