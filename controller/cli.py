"""The `specpilot` command line.

Each feature owns its sub-commands: a module exposes ``register(subparsers)`` that
adds its parser and sets ``func`` (returning the process exit code). This file only
maps command names to those modules, so adding a command never means editing another
feature's code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

# Which module registers each sub-command, in the order `--help` lists them. Running one
# command imports only its module (the others pull in scikit-learn, FastAPI, the
# simulator…: 1.6 s and 190 MB before `specpilot gateway` served a byte); `--help`
# imports them all.
COMMANDS: dict[str, str] = {
    "config": "controller.commands",
    "serve": "controller.commands",
    "gateway": "controller.gateway.cli",
    "demo": "controller.demo",
    "metrics": "collectors.cli",
    "classify": "policies.classifier_cli",
    "simulate": "simulator.cli",
    "bench": "bench.cli",
    "testbed": "testbed.cli",
}
COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(COMMANDS.values()))

BROKEN_PIPE_EXIT = 141
"""Exit code when stdout was closed before a command finished writing (``| head``): what
a shell reports for a program that SIGPIPE ended."""


def version_text() -> str:
    try:
        return f"specpilot {version('specpilot')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "specpilot (not installed)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for ``command`` alone when it is known, else for every command."""
    parser = argparse.ArgumentParser(
        prog="specpilot",
        description="Closed-loop controller for speculative decoding in vLLM fleets.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = (COMMANDS[command],) if command in COMMANDS else COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(arguments)
    except SystemExit:  # argparse's: --help, a usage error
        _flush_stdout()
        raise
    except BrokenPipeError:  # the reader left while the command was still writing
        _silence_stdout()
        return BROKEN_PIPE_EXIT
    _flush_stdout()
    return code


def _run(arguments: list[str]) -> int:
    # The first word that is not an option names the command (there are no top-level
    # options but --help and --version).
    command = next((word for word in arguments if not word.startswith("-")), None)
    if command is None and "--version" in arguments:
        print(version_text())  # without importing every command's module
        return 0
    parser = build_parser(command)
    args = parser.parse_args(arguments)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code: int = func(args)
    return code


def _flush_stdout() -> None:
    """Flush now, while a closed pipe (``specpilot ... | head -1``) can still be handled:
    at exit Python would print a traceback for it."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
