"""What ``serve`` runs when the settings wire no collector, and the policy factories.

The default policy is specpilot's bandit (``controller.wiring.bandit_policy``).
``HoldPolicy`` keeps every context on the config its pools run (operators can still
override): name ``controller.builtin:hold_policy`` in ``settings.wiring.policy`` to run
the service as a pure observer. ``NoObservations`` collects nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from collectors.observations import RequestObservation
from controller.contexts import Context
from controller.ports import ArmChoice, ArmEstimate, Collected, ControlPolicy, ObservationSource
from controller.settings import Settings


class HoldPolicy:
    def observe(self, observation: RequestObservation) -> None:
        pass

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        return ArmChoice(current, "hold: no policy wired")

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


def source_from(settings: Settings) -> ObservationSource:
    """The collector the settings name; none by default. When ``serve`` runs the gateway
    it is the source instead (``controller.wiring.QueuedObservations``)."""
    if settings.wiring.collector is None:
        return NoObservations()
    source: ObservationSource = load_factory(settings.wiring.collector)(settings)
    return source


def hold_policy(settings: Settings) -> HoldPolicy:
    return HoldPolicy()
