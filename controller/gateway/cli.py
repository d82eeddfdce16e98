"""``specpilot gateway``: run the proxy in front of vLLM pools.

Example::

    specpilot gateway --port 8000 \\
        --pool ngram=http://127.0.0.1:8001 --arm ngram=ngram:4 \\
        --pool off=http://127.0.0.1:8002,http://127.0.0.1:8003 --observations obs.jsonl

Without a control loop the routing table sends everything to the default pool (the first
one named); ``--observations`` appends every observation as one JSON line. The native
front end runs in ``--workers`` processes (``controller.gateway.workers``, default one per
core) sharing the port, as ``specpilot serve`` runs it; ``--server uvicorn`` runs in this
process.
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
from controller.tracing import Tracing


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
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="gateway worker processes (native front end; default: one per core)",
    )
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
        try:
            pools.append(Pool(name, arms.get(name, name), [u for u in urls.split(",") if u]))
        except ValueError as exc:
            raise SystemExit(f"--pool {name}: {exc}") from None
    return pools


def _pair(text: str, flag: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise SystemExit(f"{flag} wants NAME=VALUE, got {text!r}")
    return name, value


def build_gateway(
    args: argparse.Namespace, out: IO[str] | None, tracing: Tracing | None = None
) -> Gateway:
    fleet = Fleet(parse_pools(args.pool, args.arm), clock=time.monotonic)

    def write(observation: RequestObservation) -> None:
        assert out is not None
        out.write(json.dumps(dataclasses.asdict(observation)) + "\n")
        out.flush()

    tracer = tracing.tracer if tracing is not None else None
    return Gateway(fleet, sink=write if out is not None else None, tracer=tracer)


def run(args: argparse.Namespace) -> int:
    if args.server == "native":
        return _run_workers(args)
    out = args.observations.open("a") if args.observations else None
    tracing = Tracing.from_env()  # OTEL_* variables, as `serve`; None: no spans
    try:
        _run_uvicorn(build_gateway(args, out, tracing), args.host, args.port)
    finally:
        if out is not None:
            out.close()
        if tracing is not None:
            tracing.shutdown()
    return 0


def _run_workers(args: argparse.Namespace) -> int:
    """The native front end in worker processes; this one writes their observations."""
    import asyncio
    import signal
    import socket

    import uvloop

    from controller.gateway.workers import GatewayWorkers, WorkerSpec, default_workers

    pools = parse_pools(args.pool, args.arm)
    spec = WorkerSpec(
        tuple((p.name, p.arm, tuple(i.base_url for i in p.instances)) for p in pools),
        observe=args.observations is not None,
    )
    out = args.observations.open("a") if args.observations else None

    def write(observation: object) -> None:
        if out is not None and isinstance(observation, RequestObservation):
            out.write(json.dumps(dataclasses.asdict(observation)) + "\n")
            out.flush()

    async def main() -> None:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        workers = GatewayWorkers(spec, args.workers or default_workers(), write)
        await workers.start(sock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await workers.stop()

    try:
        uvloop.run(main())
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
