"""The one assembly of the service: settings → policy, observation sources, gateway,
actuators, store and loop, wired the same way for every way of running it.

``assemble`` builds; ``Runtime`` holds the parts (``serve`` then serves the API and,
when the settings serve it, the gateway's worker processes). The order matters and
lives here only: the gateway exists before the actuators (a managed pool's traffic
follows its new instance through it), the sources before the loop, and the loop's
table of each context's arm is handed to the sources once the loop exists (the config a
pool was told to run is what its windows are attributed to); the loop publishes the
routing table the gateway's workers route by, and probes the instances the placements
list (``controller.instances``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import uvicorn
from prometheus_client import CollectorRegistry

from collectors.observations import RequestObservation
from controller.actuators.base import Actuator, wrapped
from controller.actuators.configured import actuators_from
from controller.actuators.managed import ManagedActuator
from controller.api import create_app
from controller.builtin import policy_from, source_from
from controller.fleet import Fleet
from controller.frontdoor import GATEWAY_GRACE_S, FrontDoor
from controller.instances import InstanceHealth
from controller.ports import ControlPolicy
from controller.service import Service, build_service
from controller.settings import Settings
from controller.sources import FleetPlacements
from controller.store.db import Store
from controller.tracing import Tracing

__all__ = ["GATEWAY_GRACE_S", "ApiServer", "Runtime", "assemble"]


class ApiServer(uvicorn.Server):
    """uvicorn serving the API, whose signals the caller handles (the API, the loop and
    the gateway's workers stop together)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Runtime:
    service: Service
    gateway: FrontDoor | None
    """The gateway ``serve`` runs in front of the pools, where the settings serve it."""
    placements: FleetPlacements
    tracing: Tracing | None = None
    """specpilot's own traces (``OTEL_*``), flushed by ``close``; None: off."""
    api: ApiServer | None = None
    _api_task: asyncio.Task[None] | None = None
    _loop_task: asyncio.Task[None] | None = None
    _stop_loop: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(
        self,
        api_socket: socket.socket,
        gateway_socket: socket.socket | None = None,
        *,
        log_level: str = "info",
    ) -> None:
        """Serve: the control loop (restored from the store), the gateway's workers (the
        clients' data path; already serving when ``serve`` started them before the
        store was reached), then the API. Returns once both listen; raises
        ``RuntimeError`` if the API or a gateway worker failed to start (everything
        started is stopped again)."""
        settings = self.service.settings
        await self.service.loop.start()
        self._stop_loop = asyncio.Event()
        self._loop_task = asyncio.create_task(self.service.loop.run(self._stop_loop))
        if self.gateway is not None and not self.gateway.workers.started:
            if gateway_socket is None:
                raise ValueError("the settings serve the gateway: give it a socket")
            try:
                await self.gateway.workers.start(gateway_socket)
            except RuntimeError:
                await self.stop()
                raise
        self.api = ApiServer(
            uvicorn.Config(
                create_app(settings, self.service, run_loop=False),
                host=settings.api.host,
                port=settings.api.port,
                log_level=log_level,
                lifespan="on",
            )
        )
        self._api_task = asyncio.create_task(self.api.serve(sockets=[api_socket]))
        while not self.api.started:
            if self._api_task.done():
                await self.stop()
                raise RuntimeError("the API server failed to start")
            await asyncio.sleep(0.01)

    async def wait(self) -> bool:
        """Until the API stops (``stop_serving``, a signal); True if it ended cleanly."""
        if self._api_task is None:
            return False
        await asyncio.gather(self._api_task, return_exceptions=True)
        return self._api_task.exception() is None

    def stop_serving(self, *, force: bool = False) -> None:
        """Ask the API to stop (``force``: without waiting for open requests); the
        loop then saves its state and the gateway closes (``stop``)."""
        if self.api is not None:
            self.api.should_exit = True
            self.api.force_exit = self.api.force_exit or force

    async def stop(self, grace_s: float = GATEWAY_GRACE_S) -> None:
        """Stop in the reverse order: the API, the gateway (streams in progress get
        ``grace_s`` to finish), then the loop, which saves what it learned, flushes
        buffered writes and closes the actuators (a managed one stops its vLLMs, which
        is why the gateway goes first)."""
        self.stop_serving()
        if self._api_task is not None:
            await asyncio.gather(self._api_task, return_exceptions=True)
        if self.gateway is not None:
            await self.gateway.workers.stop(grace_s=grace_s)
        if self._loop_task is not None:
            self._stop_loop.set()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    @property
    def gateway_port(self) -> int | None:
        return self.gateway.port if self.gateway is not None else None

    def close(self) -> None:
        self.service.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # exports the spans still buffered
            self.tracing = None


def assemble(
    settings: Settings,
    *,
    policy: ControlPolicy | None = None,
    actuators: Sequence[Actuator] | None = None,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.time,
    observe: Callable[[RequestObservation], None] | None = None,
    tracing: Tracing | Literal["env"] | None = "env",
    front: FrontDoor | None = None,
) -> Runtime:
    """Everything ``serve`` runs, unstarted. Raises ``StoreUnavailable`` when the store
    cannot be reached (nothing of its own is left open then). ``observe`` also hears
    every request the gateway relays (a benchmark's tally), before the loop learns from
    it. ``tracing``: ``"env"`` builds it from the ``OTEL_*`` variables
    (``controller.tracing``; off when they ask for none). ``front``: the gateway, when
    the caller built (and maybe started) it already."""
    if tracing == "env":
        tracing = Tracing.from_env()
    tracer = tracing.tracer if tracing is not None else None
    try:
        store = Store.open(settings.store_url)  # the per-pod actuator takes leases in it
    except Exception:
        if tracing is not None:
            tracing.shutdown()
        raise
    registry = registry if registry is not None else CollectorRegistry()
    try:
        policy = policy if policy is not None else policy_from(settings)
        placements = FleetPlacements(settings, Fleet(settings))
        switch = None
        if settings.serves_gateway:
            from controller.frontdoor import switch_traffic

            if front is None:
                front = FrontDoor(settings, observe)
            elif observe is not None:
                front.observe = observe
            front.workers.count_on(registry)  # their metrics on the API's /metrics
            switch = switch_traffic(settings, front)
        else:
            front = None
        if actuators is None:
            actuators = actuators_from(settings, on_switch=switch, leases=store)
        placements.managed = next(
            (m for a in actuators if (m := wrapped(a, ManagedActuator)) is not None), None
        )
        source = source_from(settings, placements, front.queue if front is not None else None)
        service = build_service(
            settings,
            policy,
            source,
            actuators=actuators,
            registry=registry,
            clock=clock,
            placements=placements,
            store=store,
        )
    except Exception:
        if front is not None:
            with contextlib.suppress(KeyError):  # not counted yet if it failed before
                registry.unregister(front.workers.metrics)
        store.close()
        if tracing is not None:
            tracing.shutdown()
        raise
    service.loop.tracer = tracer
    # Probed wherever the loop collects: at start (retried while nothing answers) and
    # every iteration after, whatever ``collect`` reads.
    service.instances = service.loop.instances = InstanceHealth(
        settings, placements, service.metrics, clock=clock
    )
    if front is not None and front.spec.routing == "table":
        service.loop.routes_to = front.publish
    return Runtime(service, front, placements, tracing)
