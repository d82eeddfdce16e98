"""``specpilot bench …``: the benchmark group.

Each benchmark is a module exposing ``register(subparsers)`` that adds its own
sub-command under ``bench`` (and sets ``func``). Adding a benchmark means adding its
module to :data:`BENCHMARKS`, nothing else.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCHMARKS: tuple[str, ...] = (
    "bench.policy",
    "bench.gateway",
    "bench.loop",
    "bench.sidecar",
    "bench.classifier",
    "bench.scale",
    "bench.api",
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="run a benchmark and print ratios measured side by side"
    )
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(name).register(benchmarks)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
