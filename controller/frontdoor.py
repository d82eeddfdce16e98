"""The gateway as ``specpilot serve`` runs it beside the API (``settings.gateway``).

- Routing mode (``actuators.mode: routing``): each request goes to the pool running the
  arm the routing table gives its context (``controller.gateway.table``), which the
  control loop publishes every iteration from the policy (``ControlLoop.routes_to``):
  that is how its decisions take effect.
- Push mode with ``gateway.enabled``: each request goes to the pool serving its class
  (the loop pushes that pool's config), preferring the pool whose config that class sets;
  a managed pool's traffic follows the instance the managed actuator started
  (:func:`switch_traffic`).

Either way the gateway runs in worker processes of its own (:class:`FrontDoor`,
``controller.gateway.workers``), and every request they relay becomes an observation
for the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from collectors.observations import RequestObservation
from controller.actuators.configured import ConfigSwitch
from controller.actuators.managed import SpecConfig
from controller.contexts import Context
from controller.fleet import Fleet, pool_arms
from controller.gateway import Gateway, ObservationSink, RequestKeys
from controller.gateway.routing import RouteKey
from controller.gateway.table import SNAPSHOT_FILE, Route, SnapshotFile
from controller.gateway.workers import (
    GatewayWorkers,
    RoutedEvent,
    TablePublisher,
    WorkerSpec,
    build_gateway,
    default_workers,
    request_keys,
)
from controller.ports import Routed
from controller.settings import Settings, default_class
from controller.specconfig import OFF, SpecConfigError, resolve_on_pool
from controller.wiring import QueuedObservations

log = logging.getLogger(__name__)

GATEWAY_GRACE_S = 30.0
"""On shutdown, streams in progress through the gateway get this long to finish."""


def worker_spec(settings: Settings) -> WorkerSpec:
    """What each gateway worker builds its gateway from."""
    arms = pool_arms(settings)
    routing = settings.actuators.mode == "routing"
    names = list(settings.fleet.pools) if routing else sorted(settings.fleet.pools)
    pools = tuple((name, arms[name], tuple(settings.fleet.pools[name].instances)) for name in names)
    default = None if routing else next((n for n, _, urls in pools if urls), pools[0][0])
    gateway = settings.gateway
    return WorkerSpec(
        pools,
        pool_models=tuple((name, settings.fleet.pools[name].model) for name in names),
        routing="table" if routing else "classes",
        default_pool=default,
        class_routes=() if routing else _class_routes(settings, default or names[0]),
        classes=tuple(settings.classes),
        default_class=default_class(settings),
        models=tuple(settings.models),
        classifier=gateway.classifier,
        buckets=tuple(settings.buckets),
        limits=gateway.limits.limits(),
        timeouts=gateway.upstream_timeouts.timeouts(),
        table_path=str(settings.data_dir / SNAPSHOT_FILE),
        grace_s=GATEWAY_GRACE_S,
    )


def _class_routes(settings: Settings, default_pool: str) -> tuple[tuple[str, str, str], ...]:
    """Push mode: per model and class, a pool of the model serving the class, one whose
    config that class sets first (its primary class); else the default pool."""
    fleet = Fleet(settings)
    routes = []
    for model in settings.models:
        for cls in settings.classes:
            names = fleet.pools_for(model, cls)
            primary = [n for n in names if fleet.primary_class(fleet.pools[n]) == cls]
            pool = (primary or list(names) or [default_pool])[0]
            routes.append((model, cls, pool))
    return tuple(routes)


def classifier_from(settings: Settings) -> RequestKeys:
    """What ``gateway.classifier`` names, inside the request keys that hold every class
    to ``classes`` and every model to the pools' (:class:`RequestKeys`)."""
    return request_keys(worker_spec(settings))


def gateway_from(settings: Settings, sink: ObservationSink | None = None) -> Gateway:
    """The gateway one worker runs, built in this process (for tests and tools)."""
    return build_gateway(worker_spec(settings), sink)


class FrontDoor:
    """The gateway ``serve`` runs: its workers, the routing table they route by and the
    queue their observations reach the loop through.

    ``observe`` also hears every observation (a benchmark's tally) as it arrives, in
    the event loop; ``seen`` holds every context a request was routed in."""

    def __init__(
        self,
        settings: Settings,
        observe: Callable[[RequestObservation], None] | None = None,
    ) -> None:
        self.spec = worker_spec(settings)
        self.queue = QueuedObservations()
        self.observe = observe
        self.seen: set[Context] = set()
        self.publisher = TablePublisher(
            SnapshotFile(settings.data_dir / SNAPSHOT_FILE),
            self.spec.pools,
            table=self.spec.routing == "table",
        )
        count = settings.gateway.workers or default_workers()
        self.workers = GatewayWorkers(
            self.spec, count, self._deliver, dropped=lambda: self.queue.dropped
        )
        self._default_model = settings.models[0]

    @property
    def port(self) -> int | None:
        return self.workers.port

    def _deliver(self, event: RequestObservation | RoutedEvent) -> None:
        if isinstance(event, RequestObservation):
            if self.observe is not None:
                self.observe(event)
            self.queue.put(event)
            return
        model, cls, bucket, arm, reason, at = event
        context = Context(model or self._default_model, cls, bucket)
        self.seen.add(context)
        self.queue.put_routed(Routed(context, arm, reason, at))

    def publish(self, table: Mapping[Context, Route]) -> None:
        """Route by ``table`` from now on (``ControlLoop.routes_to``)."""
        self.publisher.publish(
            {RouteKey(c.model, c.workload_class, c.bucket): route for c, route in table.items()}
        )


def switch_traffic(settings: Settings, front: FrontDoor) -> ConfigSwitch:
    """The managed actuator's traffic switch: the gateway's pool gets the new instances
    and the arm their config runs (what its observations are tagged with). It returns
    once every worker routes by them (the old instance is drained and stopped next)."""

    async def switch(pool: str, urls: tuple[str, ...], config: SpecConfig) -> None:
        proposers = settings.fleet.pools[pool].proposer_list()
        try:
            arm = resolve_on_pool(config or {"method": OFF}, pool, proposers, pinnable=False)
        except SpecConfigError:
            arm = OFF if config is None else str(config.get("method"))
        version = front.publisher.set_pool(pool, urls, arm)
        if front.workers.started and not await front.workers.routing_by(version):
            log.warning("pool %s: a gateway worker did not take its new instances in time", pool)

    return switch
