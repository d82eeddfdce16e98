"""``specpilot serve``: the control loop and the REST API in one process and, where the
settings serve it, the gateway in worker processes of its own (assembled by
``controller.runtime``).

The gateway starts first, before the store is reached: when the database is down at
start, clients are served with the routing table the last run published while the
store is tried again every ``STORE_RETRY_S`` (the API and the loop start once it
answers). Meanwhile the API's port answers ``/healthz`` (alive: a liveness probe must not
restart the process that serves the data path) and ``/readyz`` 503 with the reason
(``controller.api.create_waiting_app``).

SIGTERM and SIGINT stop it gracefully: the API stops taking requests, streams through
the gateway get ``GATEWAY_GRACE_S`` to finish, then the loop saves the learned state and
flushes buffered writes; a second signal stops waiting for open API requests. Exit
codes: 0 after a clean shutdown, 1 when the store cannot be reached (and no gateway is
served), a port cannot be bound or the API or a gateway worker fails to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys

import uvicorn

from controller import actions
from controller.actions import LogFormat
from controller.api import create_waiting_app
from controller.frontdoor import FrontDoor
from controller.runtime import ApiServer, Runtime, assemble
from controller.settings import Settings, actuator_names
from controller.store.db import StoreUnavailable, redact

log = logging.getLogger(__name__)

STORE_RETRY_S = 5.0
"""With the gateway serving, how often an unreachable store is tried again at start."""


def serve(settings: Settings, *, log_format: LogFormat = "text", log_level: str = "info") -> int:
    """Run until a signal stops it; see the module docstring for the exit codes."""
    actions.configure(log_format, getattr(logging, log_level.upper()))
    return asyncio.run(_serve(settings))


def _log_start(settings: Settings) -> None:
    log.info(
        "specpilot serving on http://%s:%d (store %s); decisions reach the fleet by %s; "
        "evidence from %s",
        settings.api.host,
        settings.api.port,
        redact(settings.store_url),
        ", ".join(actuator_names(settings)) or "nothing (no actuator)",
        ", ".join(settings.sources),
    )
    managed = settings.actuators.managed
    # Per pod, clients reach the pod's vLLM through the pool's Service on its fixed port.
    if managed is not None and managed.pod is None and not settings.serves_gateway:
        log.warning(
            "managed pools without the gateway: clients reach their instances only at the "
            "URLs logged at each start (set gateway.enabled: true to route to them)"
        )


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket, so that a port in use is a one-line error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off only on the connections of
    # a socket that says TCP, and with it on each answer waited ~40 ms for an ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def _serve(settings: Settings) -> int:
    wanted = [("api", settings.api.host, settings.api.port)]
    if settings.serves_gateway:
        wanted.append(("gateway", settings.gateway.host, settings.gateway.port))
    sockets: list[socket.socket] = []
    for key, host, port in wanted:
        try:
            sockets.append(_listen(host, port))
        except OSError as exc:
            print(f"error: {key}: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
            for sock in sockets:
                sock.close()
            return 1
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    runtime: Runtime | None = None

    def on_signal() -> None:
        # A second signal: stop waiting for open requests (the loop still saves).
        if runtime is not None:
            runtime.stop_serving(force=stopping.is_set())
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    front = FrontDoor(settings) if settings.serves_gateway else None
    try:
        if front is not None:
            try:
                await front.workers.start(sockets[1])
            except RuntimeError as exc:
                print(f"error: gateway: {exc}", file=sys.stderr)
                return 1
            log.info("gateway on http://%s:%d", settings.gateway.host, settings.gateway.port)
        runtime = await _assemble(settings, front, stopping, sockets[0])
        if runtime is None:
            return 0 if front is not None else 1
        return await _run(runtime, settings, sockets[0], stopping)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if runtime is None and front is not None:
            await front.workers.stop()
        sockets[0].close()


async def _assemble(
    settings: Settings, front: FrontDoor | None, stopping: asyncio.Event, api_socket: socket.socket
) -> Runtime | None:
    """The service, once the store answers; None when it cannot be reached (and no
    gateway serves meanwhile) or a signal came first. While it waits with the gateway
    serving, the API's socket answers as :func:`create_waiting_app` says."""
    waiting: _WaitingApi | None = None
    try:
        while True:
            try:
                return assemble(settings, front=front)
            except StoreUnavailable as exc:
                if front is None:
                    print(f"error: {exc}", file=sys.stderr)
                    return None
                log.error(
                    "%s; the gateway serves with the routing table it has, the store is "
                    "tried again in %.0f s",
                    exc,
                    STORE_RETRY_S,
                )
                if waiting is None:
                    waiting = _WaitingApi(settings)
                    waiting.start(api_socket)
                waiting.reason = str(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), STORE_RETRY_S)
            if stopping.is_set():
                return None
    finally:
        if waiting is not None:
            await waiting.stop()


class _WaitingApi:
    """:func:`create_waiting_app` on a duplicate of the API's socket: stopping it closes
    the duplicate, and the socket keeps listening (connections that arrive meanwhile wait
    in its backlog) for the API that takes over."""

    def __init__(self, settings: Settings) -> None:
        self.reason = "not tried yet"
        self._server = ApiServer(
            uvicorn.Config(
                create_waiting_app(lambda: self.reason),
                host=settings.api.host,
                port=settings.api.port,
                log_level="info",
                lifespan="off",
            )
        )
        self._task: asyncio.Task[None] | None = None

    def start(self, api_socket: socket.socket) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[api_socket.dup()]))

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


async def _run(
    runtime: Runtime, settings: Settings, api_socket: socket.socket, stopping: asyncio.Event
) -> int:
    _log_start(settings)
    clean = False
    try:
        await runtime.start(api_socket)
        # What is built by now lives as long as the process: out of the collector's
        # full passes, which stop every thread, the API's too (0.2-0.8 s under load).
        gc.collect()
        gc.freeze()
        if stopping.is_set():  # a signal while it started
            runtime.stop_serving()
        clean = await runtime.wait()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
    finally:
        await runtime.stop()
        runtime.close()
    return 0 if clean else 1
