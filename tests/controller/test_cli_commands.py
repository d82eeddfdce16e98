"""The `specpilot` command map: each command's module registers exactly it, and running
a command imports only its own module."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from controller.cli import COMMAND_MODULES, COMMANDS


def registered_by(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    importlib.import_module(module).register(subparsers)
    return set(subparsers.choices)


def test_every_module_registers_the_commands_the_map_gives_it() -> None:
    for module in COMMAND_MODULES:
        expected = {command for command, owner in COMMANDS.items() if owner == module}
        assert registered_by(module) == expected, module


def test_one_command_loads_only_its_module() -> None:
    probe = (
        "import sys\n"
        "from controller.cli import build_parser\n"
        "build_parser('gateway').parse_args(['gateway', '--pool', 'p=http://127.0.0.1:9'])\n"
        "print(sorted(m for m in ('sklearn', 'fastapi', 'simulator.engine') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
