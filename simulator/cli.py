"""``specpilot simulate …``: the simulated fleet (server mode) and its load generator.

``simulate serve --scenario FILE [--pools SPEC] [--speed X]`` starts one simulated vLLM
per instance on free loopback ports, prints one line per instance (name, pool, config,
URL) and serves until interrupted (or for ``--seconds``). ``simulate load --scenario
FILE --url URL`` drives the scenario's closed-loop streams against a URL and prints a
JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
from typing import Any

from simulator.instance import ConfigError
from simulator.load import LoadOptions, run_load
from simulator.scenario import ScenarioError, load_scenario
from simulator.server import FleetThread, default_pools, describe, parse_pools


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="run a simulated vLLM fleet or drive load against one"
    )
    commands = parser.add_subparsers(dest="simulate_command", metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve a simulated vLLM fleet on loopback ports")
    serve.add_argument("--scenario", required=True, help="scenario YAML file")
    serve.add_argument(
        "--pools",
        help="NAME=CONFIG[*COUNT] ..., CONFIG 'off', 'ngram:4' or "
        "'eagle3:5@1-8=5,9-1024=0' (default: 'off' plus each proposer at its middle γ)",
    )
    serve.add_argument("--speed", type=float, default=1.0, help="simulated s per wall s")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--seconds", type=float, help="stop after this many wall seconds")
    serve.add_argument("--json", action="store_true", help="print the instances as JSON")
    serve.set_defaults(func=_serve)

    load = commands.add_parser("load", help="closed-loop load from a scenario against a URL")
    load.add_argument("--scenario", required=True, help="scenario YAML file")
    load.add_argument("--url", required=True, help="base URL (gateway or instance)")
    load.add_argument("--speed", type=float, default=1.0, help="simulated s per wall s")
    load.add_argument("--max-requests", type=int, default=1000)
    load.add_argument("--max-seconds", type=float, default=60.0, help="wall seconds")
    load.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    load.add_argument("--stream", action="store_true", help="stream (with usage chunk)")
    load.add_argument("--undeclared", action="store_true", help="do not declare the workload class")
    load.add_argument("--seed", type=int, help="default: the scenario's seed")
    load.set_defaults(func=_load)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)


def _serve(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        pools = parse_pools(args.pools) if args.pools else default_pools(scenario)
        fleet = FleetThread(scenario, pools, speed=args.speed, host=args.host)
    except (ScenarioError, ConfigError, OSError) as exc:
        print(f"specpilot simulate serve: {exc}", file=sys.stderr)
        return 2
    with fleet:
        instances = describe(fleet.fleet)
        if args.json:
            print(json.dumps({"speed": args.speed, "instances": instances}), flush=True)
        else:
            for i in instances:
                print(f"{i['name']:<16} pool={i['pool']:<12} config={i['config']:<24} {i['url']}",
                      flush=True)  # fmt: skip
        stop = threading.Event()
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait(args.seconds)
    return 0


def _load(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
    except (ScenarioError, OSError) as exc:
        print(f"specpilot simulate load: {exc}", file=sys.stderr)
        return 2
    options = LoadOptions(
        speed=args.speed,
        max_requests=args.max_requests,
        max_duration_s=args.max_seconds,
        chat=args.chat,
        stream=args.stream,
        declare_class=not args.undeclared,
    )
    seed = scenario.seed if args.seed is None else args.seed
    report = asyncio.run(run_load(args.url, scenario, options, rng=random.Random(seed)))
    print(json.dumps(report.summary(), indent=2))
    return 0 if report.completed else 1
