"""What the control loop needs from the policy engine and from the collectors.

The controller depends on these narrow Protocols only, so the real policy
(``policies/``) and the real collectors (``collectors/``) plug in through small
adapters built where the service is wired (``controller.service.build_service``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from collectors.observations import RequestObservation, WindowObservation
from controller.contexts import Context
from controller.gateway.table import Route
from controller.store.records import Alternative, WindowStatRecord

__all__ = [
    "ArmChoice",
    "ArmEstimate",
    "Collected",
    "ControlPolicy",
    "DriftEvent",
    "ObservationSource",
    "Route",
    "Routed",
]


@dataclass(frozen=True, slots=True)
class ArmChoice:
    """What the policy wants a context to run, and why."""

    arm: str
    """``"<proposer>:<γ>"`` or ``"off"``."""
    reason: str
    """A word of the vocabulary (``policies.reasons.Reason``)."""
    predicted_speedup: float | None = None
    """Expected tokens/s relative to no speculation (> 1 is faster)."""
    detail: str = ""
    """The reason's circumstances, for a person."""
    alternatives: tuple[Alternative, ...] = ()
    """What the policy predicts for every arm the context may run (empty before it has a
    plan for the context's bucket)."""

    def prediction(self, arm: str) -> Alternative | None:
        """The policy's prediction for ``arm`` here, if it has one."""
        return next((a for a in self.alternatives if a.arm == arm), None)


@dataclass(frozen=True, slots=True)
class ArmEstimate:
    """The policy's current belief about one arm in one context, with uncertainty
    (an interval the policy considers likely, e.g. 90 %)."""

    arm: str
    first_position_acceptance: float | None
    """The policy's model of position-0 acceptance per decode step (drafted or not): not
    vLLM's acceptance, which the loop measures itself (``controller.acceptance``)."""
    first_position_acceptance_interval: tuple[float, float] | None
    speedup: float | None
    speedup_interval: tuple[float, float] | None
    observations: int


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """The policy's change detector found a class × proposer's acceptance moved."""

    at: float
    model: str
    workload_class: str
    proposer: str
    before: float
    """vLLM's position-0 acceptance per drafted step before (the detector's baseline),
    in [0, 1]; steps that drafted nothing are not in it."""
    after: float


@dataclass(frozen=True, slots=True)
class Routed:
    """One request a gateway worker routed by the table: its context, the arm it went to
    and why (the route's reason, or the exploration's), and when (wall clock)."""

    context: Context
    arm: str
    reason: str
    at: float


class ControlPolicy(Protocol):
    def observe(self, observation: RequestObservation) -> None:
        """Learn from one finished request."""
        ...

    def observe_window(self, window: WindowObservation) -> None:
        """Learn from one worker's ``/metrics`` window (a scraped fleet's evidence)."""
        ...

    def drift(self) -> Sequence[DriftEvent]:
        """Acceptance changes detected since the last call (each once)."""
        ...

    def route(self, context: Context) -> Route:
        """Where the gateway should send ``context``'s requests until the next iteration
        (routing mode): the committed arm and the shares it explores."""
        ...

    def routed(self, request: Routed) -> None:
        """A request the gateway routed by the last :meth:`route` (before its
        observation arrives): what choosing it per request would have counted."""
        ...

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        """The arm this context should run now, among ``allowed_arms``; ``current`` runs now."""
        ...

    def set_pins(self, pins: Mapping[Context, str]) -> None:
        """Contexts an operator pinned, and to which arm: the policy does not choose there
        (and should not count on exploring there) until the pin is gone."""
        ...

    def estimates(self, context: Context) -> Sequence[ArmEstimate]:
        """What the policy believes about each arm of this context (may be empty)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The learned state as plain JSON values, for snapshots."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a snapshot made by ``state_dict``."""
        ...


@dataclass(frozen=True, slots=True)
class InstanceSeen:
    """One scrape of one instance: the shape its page showed."""

    pool: str
    instance: str
    positions: int
    """Per-position series on the page; 0 when it has no spec-decode series (off)."""
    restarted: bool
    """Its counters went back since the previous scrape (the process restarted)."""
    at: float


@dataclass(frozen=True, slots=True)
class Collected:
    """What the collectors saw since the previous call."""

    observations: Sequence[RequestObservation] = ()
    windows: Sequence[WindowStatRecord] = field(default_factory=tuple)
    """Every instance's window as stored and shown (usable or not, with why)."""
    window_observations: Sequence[WindowObservation] = field(default_factory=tuple)
    """The usable windows as the policy's evidence."""
    routed: Sequence[Routed] = ()
    """Routing mode: the requests the gateway routed since, in order (their
    observations follow as they finish)."""
    instances: Sequence[InstanceSeen] = ()
    """The shape (γ, or off) each scraped instance's page showed."""


class ObservationSource(Protocol):
    """Where the loop's observations come from.

    A source may set ``exclusive = True`` when what it collects only this replica sees
    (its own gateway's requests): a follower replica then collects it too and hands it
    to the leader through the store (``ControlLoop._hand_over``). Sources every replica
    sees alike (scraping the fleet) leave it unset; only the leader reads them.
    """

    async def collect(self) -> Collected:
        """Everything new since the last call (per-request observations, window stats)."""
        ...

    async def aclose(self) -> None: ...
