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
    parser.add_argument(
        "--server",
        choices=("native", "uvicorn"),
        default="native",
        help="the HTTP front end: the gateway's own (default, cheaper per streamed event) "
        "or uvicorn over the ASGI interface",
    )
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
    out = args.observations.open("a") if args.observations else None
    try:
        gateway = build_gateway(args, out)
        if args.server == "native":
            from controller.gateway.server import run as serve

            # The gateway's own HTTP/1.1 front end on uvloop: it relays each streamed event
            # with one write (see controller/gateway/server.py). Like the uvicorn settings
            # below, it adds no Date or Server header and forwards X-Forwarded-* untouched.
            serve(gateway, args.host, args.port)
        else:
            _run_uvicorn(gateway, args.host, args.port)
    finally:
        if out is not None:
            out.close()
    return 0


def _run_uvicorn(gateway: Gateway, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        gateway,
        host=host,
        port=port,
        access_log=False,
        # The upstream's own Date and Server headers are forwarded; uvicorn's would double them.
        server_header=False,
        date_header=False,
        log_level="warning",
        # Clients keep connections to a gateway open between requests, as to vLLM.
        timeout_keep_alive=75,
        # The gateway is the proxy: it forwards X-Forwarded-* untouched.
        proxy_headers=False,
    )
