"""What ``serve`` runs when the settings wire no collector, and the policy factories.

The default policy is specpilot's bandit (``controller.wiring.bandit_policy``).
``HoldPolicy`` keeps every context on the config its pools run (operators can still
override): name ``controller.builtin:hold_policy`` in ``settings.wiring.policy`` to run
the service as a pure observer. ``NoObservations`` collects nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from collectors.observations import RequestObservation, WindowObservation
from controller.contexts import Context
from controller.ports import (
    ArmChoice,
    ArmEstimate,
    Collected,
    ControlPolicy,
    DriftEvent,
    ObservationSource,
    Route,
    Routed,
)
from controller.settings import Settings
from controller.sources import Placement
from policies.reasons import Reason


class HoldPolicy:
    def observe(self, observation: RequestObservation) -> None:
        pass

    def observe_window(self, window: WindowObservation) -> None:
        pass

    def drift(self) -> Sequence[DriftEvent]:
        return ()

    def route(self, context: Context) -> Route:
        return Route("off", "hold: no policy wired")

    def routed(self, request: Routed) -> None:
        pass

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        return ArmChoice(current, Reason.HOLD, detail="no policy wired")

    def set_pins(self, pins: Mapping[Context, str]) -> None:
        pass

    def estimates(self, context: Context) -> Sequence[ArmEstimate]:
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        pass


class NoObservations:
    async def collect(self) -> Collected:
        return Collected()

    async def aclose(self) -> None:
        pass


def load_factory(path: str) -> Any:
    """``"package.module:name"`` → the object (already validated in the settings)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def policy_from(settings: Settings) -> ControlPolicy:
    """The policy the settings name; by default specpilot's bandit, modelling one engine
    per arm in routing mode (a pool per config) and one per model otherwise."""
    if settings.wiring.policy is None:
        from controller.wiring import bandit_policy

        routing = settings.actuators.mode == "routing"
        return bandit_policy(settings, topology="per_arm" if routing else "shared")
    policy: ControlPolicy = load_factory(settings.wiring.policy)(settings)
    return policy


def source_from(
    settings: Settings,
    placements: Callable[[], Sequence[Placement]],
    gateway: ObservationSource | None = None,
) -> ObservationSource:
    """The observation sources ``collect`` names (``controller.sources``), plus the
    factory ``wiring.collector`` names if any. ``gateway``: the queue the served
    gateway feeds, when ``collect`` lists it."""
    from controller.sources import CombinedSource, PrometheusSource, ScrapeSource

    sources: list[ObservationSource] = []
    for name in settings.sources:
        if name == "gateway":
            if gateway is None:
                raise ValueError("collect: gateway, but no gateway is served")
            sources.append(gateway)
        elif name == "scrape":
            sources.append(ScrapeSource(settings, placements))
        elif name == "prometheus":
            sources.append(PrometheusSource(settings, placements))
    if settings.wiring.collector is not None:
        sources.append(load_factory(settings.wiring.collector)(settings))
    if not sources:
        return NoObservations()
    return sources[0] if len(sources) == 1 else CombinedSource(tuple(sources))


def hold_policy(settings: Settings) -> HoldPolicy:
    return HoldPolicy()
