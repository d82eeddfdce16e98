"""``specpilot gateway``: run the proxy in front of vLLM pools.

Example::

    specpilot gateway --port 8000 \\
        --pool ngram=http://127.0.0.1:8001 --arm ngram=ngram:4 \\
        --pool off=http://127.0.0.1:8002,http://127.0.0.1:8003 --observations obs.jsonl

Without a control loop the routing table sends everything to the default pool (the first
one named); ``--observations`` appends every observation as one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import IO, Any

from collectors.observations import RequestObservation
from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("gateway", help="run the OpenAI-compatible gateway")
    parser.add_argument(
        "--pool",
        action="append",
        required=True,
        metavar="NAME=URL[,URL...]",
        help="a pool and its vLLM base URLs; repeat per pool; the first is the default",
    )
    parser.add_argument(
        "--arm", action="append", default=[], metavar="NAME=ARM", help="the config a pool runs"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--observations", type=Path, help="append observations here (JSONL)")
    parser.set_defaults(func=run)


def parse_pools(pool_args: list[str], arm_args: list[str]) -> list[Pool]:
    """``NAME=URL,URL`` and ``NAME=ARM`` strings → pools (arm defaults to the name)."""
    arms = dict(_pair(a, "--arm") for a in arm_args)
    pools = []
    for item in pool_args:
        name, urls = _pair(item, "--pool")
        pools.append(Pool(name, arms.get(name, name), [u for u in urls.split(",") if u]))
    return pools


def _pair(text: str, flag: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise SystemExit(f"{flag} wants NAME=VALUE, got {text!r}")
    return name, value


def build_gateway(args: argparse.Namespace, out: IO[str] | None) -> Gateway:
    fleet = Fleet(parse_pools(args.pool, args.arm), clock=time.monotonic)

    def write(observation: RequestObservation) -> None:
        assert out is not None
        out.write(json.dumps(dataclasses.asdict(observation)) + "\n")
        out.flush()

    return Gateway(fleet, sink=write if out is not None else None)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    out = args.observations.open("a") if args.observations else None
    try:
        app = build_gateway(args, out)
        # The upstream's own Date and Server headers are forwarded; uvicorn's would double them.
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            access_log=False,
            server_header=False,
            date_header=False,
            log_level="warning",
            # Clients keep connections to a gateway open between requests, as to vLLM.
            timeout_keep_alive=75,
            # The gateway is the proxy: it forwards X-Forwarded-* untouched.
            proxy_headers=False,
        )
    finally:
        if out is not None:
            out.close()
    return 0
