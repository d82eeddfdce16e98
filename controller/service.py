"""The seam where the service is assembled: settings + a policy + a collector → Service.

``build_service`` is what ``specpilot serve`` and ``specpilot demo`` (with the
simulator's fleet) both call; ``controller.api.create_app`` then serves it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from controller.actuators.base import Actuator, wrapped
from controller.actuators.configured import actuators_from
from controller.actuators.rolling import RollingRestarts as Pod
from controller.fleet import Fleet
from controller.instances import InstanceHealth
from controller.loop import ControlLoop
from controller.ports import ControlPolicy, ObservationSource
from controller.settings import Settings
from controller.sources import FleetPlacements, Placement
from controller.store.buffer import BufferedWriter
from controller.store.db import Store
from controller.store.journal import Journal
from controller.store.leader import Leadership, leadership_for
from controller.telemetry import ServiceMetrics


@dataclass
class Service:
    settings: Settings
    fleet: Fleet
    store: Store
    policy: ControlPolicy
    loop: ControlLoop
    metrics: ServiceMetrics
    registry: CollectorRegistry
    clock: Callable[[], float]
    placements: Callable[[], Sequence[Placement]]
    """Where each pool runs now and with which config (``/v1/fleet`` lists these)."""
    pod: Pod | None = None
    """Per-pod topology: this replica's pod (its vLLM's readiness, for ``/readyz``)."""
    instances: InstanceHealth | None = None
    """Whether each pool instance answers with its model (``/readyz``); None: not probed."""

    def close(self) -> None:
        self.store.close()


def build_service(
    settings: Settings,
    policy: ControlPolicy,
    source: ObservationSource,
    *,
    actuators: Sequence[Actuator] | None = None,
    registry: CollectorRegistry | None = None,
    leadership: Leadership | None = None,
    clock: Callable[[], float] = time.time,
    placements: FleetPlacements | None = None,
    store: Store | None = None,
) -> Service:
    """Open the store (migrating it; ``StoreUnavailable`` if it cannot be reached), unless
    it is given open, and wire the loop. Actuators default to what
    ``settings.actuators`` configures."""
    store = store if store is not None else Store.open(settings.store_url)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = ServiceMetrics(registry)
    writer = BufferedWriter(
        store, settings.store.write_buffer_max, on_drop=metrics.store_dropped.inc
    )
    fleet = Fleet(settings)
    loop = ControlLoop(
        settings=settings,
        fleet=fleet,
        policy=policy,
        source=source,
        store=store,
        writer=writer,
        leadership=leadership if leadership is not None else leadership_for(settings.store_url),
        actuators=actuators if actuators is not None else actuators_from(settings, leases=store),
        metrics=metrics,
        journal=Journal(settings.data_dir / "journal.jsonl"),
        clock=clock,
    )
    if placements is None:
        placements = FleetPlacements(settings, fleet)
    placements.running = loop.running
    if placements.managed is not None:
        for name, pool in fleet.pools.items():
            if not pool.instances:  # the managed actuator starts it: it knows the config
                loop.running.read_back[name] = functools.partial(placements.managed.config, name)
    pod = next((p for a in loop.actuators if (p := wrapped(a, Pod)) is not None), None)
    if pod is not None:
        pod.target = loop.pool_target  # a replica waiting for its turn takes the newest wish
    return Service(settings, fleet, store, policy, loop, metrics, registry, clock, placements, pod)
