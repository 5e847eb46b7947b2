"""The `pipetorch` command: parses the command line and hands over to one subcommand module."""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from importlib import metadata

__all__ = ["build_parser", "main"]

# Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
# parser and sets the defaults `command` (a function Namespace -> exit code) and `parser`.
# A new subcommand is one more line here.
_SUBCOMMAND_MODULES = (
    "pipetorch.cli.run",
    "pipetorch.cli.devices",
    "pipetorch.cli.report",
    "pipetorch.cli.plan",
)


def _version() -> str:
    # importlib.metadata instead of `import torch`: --version should answer instantly.
    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    return f"pipetorch {installed('pipetorch')} (torch {installed('torch')})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of `pipetorch`, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="pipetorch",
        description="PopTorch's programming model on CPUs and GPUs.")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipetorch` console script and of `python -m pipetorch`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "command"):
        parser.print_help()
        return 2
    return args.command(args)
