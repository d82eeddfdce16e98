"""The `specpilot` command line.

Each feature owns its sub-commands: a module exposes ``register(subparsers)`` that
adds its parser and sets ``func`` (returning the process exit code). This file only
lists those modules, so adding a command never means editing another feature's code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute sub-commands, in the order `--help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "controller.commands",
    "controller.gateway.cli",
    "controller.demo",
    "collectors.cli",
    "policies.classifier_cli",
    "simulator.cli",
    "bench.cli",
    "testbed.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specpilot",
        description="Closed-loop controller for speculative decoding in vLLM fleets.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code: int = func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
