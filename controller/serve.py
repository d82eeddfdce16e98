"""``specpilot serve``: the control loop and the REST API in one process under uvicorn.

uvicorn turns SIGTERM and SIGINT into a graceful shutdown; the app's lifespan then
stops the loop, which saves the learned state and flushes buffered writes.

When the settings serve the gateway (routing mode, or ``gateway.enabled``), it runs in
the same event loop as the API, on its own front end (``controller.gateway.server``, as
``specpilot gateway`` runs it) at ``gateway.host:gateway.port``: every request it
relays becomes an observation the loop drains (``QueuedObservations``). A signal then
stops the gateway and the API together, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from controller.actuators.configured import actuators_from
from controller.api import create_app
from controller.builtin import policy_from, source_from
from controller.gateway.server import GatewayServer
from controller.service import Service, build_service
from controller.settings import Settings, actuator_names
from controller.store.db import StoreUnavailable, redact

log = logging.getLogger(__name__)

GATEWAY_GRACE_S = 30.0
"""On shutdown, streams in progress through the gateway get this long to finish."""


def serve(settings: Settings) -> int:
    """Run until a signal stops it: 0 after a clean shutdown, 1 if the store is unreachable."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.serves_gateway:
        return asyncio.run(_serve_with_gateway(settings))
    try:
        service = build_service(settings, policy_from(settings), source_from(settings))
    except StoreUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _log_start(settings)
    app = create_app(settings, service)
    config = uvicorn.Config(
        app, host=settings.api.host, port=settings.api.port, log_level="info", lifespan="on"
    )
    try:
        uvicorn.Server(config).run()
    finally:
        service.close()
    return 0


def _log_start(settings: Settings) -> None:
    log.info(
        "specpilot serving on http://%s:%d (store %s); decisions reach the fleet by %s",
        settings.api.host,
        settings.api.port,
        redact(settings.store_url),
        ", ".join(actuator_names(settings)) or "nothing (no actuator)",
    )
    if settings.actuators.managed is not None and not settings.serves_gateway:
        log.warning(
            "managed pools without the gateway: clients reach their instances only at the "
            "URLs logged at each start (set gateway.enabled: true to route to them)"
        )


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket, so that a port in use is a one-line error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """A server whose signals the caller handles (two servers share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_with_gateway(settings: Settings) -> int:
    from controller.frontdoor import gateway_from, switch_traffic
    from controller.wiring import QueuedObservations

    sockets: list[socket.socket] = []
    for key, host, port in (
        ("api", settings.api.host, settings.api.port),
        ("gateway", settings.gateway.host, settings.gateway.port),
    ):
        try:
            sockets.append(_listen(host, port))
        except OSError as exc:
            print(f"error: {key}: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
            for sock in sockets:
                sock.close()
            return 1
    api_socket, gateway_socket = sockets
    policy = policy_from(settings)
    observations = QueuedObservations()
    gateway = gateway_from(settings, policy, observations.put)
    actuators = actuators_from(settings, on_switch=switch_traffic(settings, gateway))
    try:
        service: Service = build_service(settings, policy, observations, actuators=actuators)
    except StoreUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        gateway.aclose()
        for sock in sockets:
            sock.close()
        return 1
    _log_start(settings)
    log.info("gateway on http://%s:%d", settings.gateway.host, settings.gateway.port)
    api = _Server(
        uvicorn.Config(
            create_app(settings, service),
            host=settings.api.host,
            port=settings.api.port,
            log_level="info",
            lifespan="on",
        )
    )
    loop = asyncio.get_running_loop()

    def stop() -> None:
        api.should_exit = True

    def on_signal() -> None:
        if api.should_exit:
            # A second signal: stop waiting for open requests (the loop still saves).
            api.force_exit = True
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    front: GatewayServer | None = None
    try:
        # The gateway's own front end, as `specpilot gateway` runs it; the API under
        # uvicorn. The API ending (a signal, or failing to start) ends both.
        front = await GatewayServer.start(gateway, sock=gateway_socket)
        api_task = asyncio.create_task(api.serve(sockets=[api_socket]))
        await asyncio.gather(api_task, return_exceptions=True)
        failed = api_task.exception() is not None or not api.started
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if front is not None:
            await front.close(grace_s=GATEWAY_GRACE_S)  # closes upstream connections too
        else:
            gateway.aclose()
        service.close()
    return 1 if failed else 0
