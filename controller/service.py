"""The seam where the service is assembled: settings + a policy + a collector → Service.

``build_service`` is what ``specpilot serve`` and ``specpilot demo`` (with the
simulator's fleet) both call; ``controller.api.create_app`` then serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from controller.actuators.base import Actuator
from controller.actuators.configured import actuators_from
from controller.fleet import Fleet
from controller.loop import ControlLoop
from controller.ports import ControlPolicy, ObservationSource
from controller.settings import Settings
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
) -> Service:
    """Open the store (migrating it; ``StoreUnavailable`` if it cannot be reached) and
    wire the loop. Actuators default to what ``settings.actuators`` configures."""
    store = Store.open(settings.store_url)
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
        actuators=actuators if actuators is not None else actuators_from(settings),
        metrics=metrics,
        journal=Journal(settings.data_dir / "journal.jsonl"),
        clock=clock,
    )
    return Service(settings, fleet, store, policy, loop, metrics, registry, clock)
