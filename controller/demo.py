"""`specpilot demo`: specpilot on its embedded default, no GPU and no setup.

Interim: the simulated fleet and the control loop land with the service (issue 5). Until
then the demo shows what exists: the collectors reading real vLLM 0.32 /metrics pages
recorded by the testbed, as the window between two scrapes of the same worker.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from collectors.cli import run as metrics_run

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run specpilot on its embedded default")
    parser.add_argument("--port", type=int, default=8077)
    parser.add_argument("--data-dir", type=Path, default=Path("specpilot-data"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("specpilot demo (interim): the simulated fleet and control loop are not built yet.")
    print("What exists: window statistics of real vLLM 0.32 pages the testbed recorded.\n")
    for name in ("ngram", "draft", "off"):
        print(f"== {name}: {FIXTURES.name}/metrics-{name}-start.txt → metrics-{name}-after.txt")
        window = argparse.Namespace(
            file=FIXTURES / f"metrics-{name}-start.txt",
            later_file=FIXTURES / f"metrics-{name}-after.txt",
            json=False,
        )
        code = metrics_run(window)
        if code:
            return code
        print()
    return 0
