"""The real policy and observation sources, plugged into the control loop's ports.

``BanditControlPolicy`` adapts ``policies.bandit.SpecPilotPolicy`` (the structured
Thompson bandit) to ``controller.ports.ControlPolicy``; ``QueuedObservations`` is the
``ObservationSource`` the gateway feeds in-process. ``bandit_policy`` is what
``settings.wiring.policy`` names by default.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from collectors.observations import RequestObservation, WindowObservation
from controller.contexts import Context
from controller.fleet import pool_arms
from controller.ports import ArmChoice, ArmEstimate, Collected, DriftEvent, Route, Routed
from controller.settings import Settings
from policies.arms import OFF, Arm, ConcurrencyBuckets
from policies.bandit import DRAFT_COST_PRIOR, BanditConfig, SpecPilotPolicy
from policies.fleet import Topology


def fleet_arms(settings: Settings) -> tuple[Arm, ...]:
    """Every arm some pool can run: its proposers over their γ ranges, and what it runs now.

    In routing mode a pool runs its one config and nothing else: the arms are the ones
    the pools run, so that the policy never picks an arm the gateway cannot route to."""
    if settings.actuators.mode == "routing":
        running = {Arm.parse(arm) for arm in pool_arms(settings).values()}
        return tuple(sorted(running - {OFF}, key=str))
    arms: set[Arm] = set()
    for pool in settings.fleet.pools.values():
        for name, proposer in pool.proposers.items():
            low, high = proposer.gamma
            arms.update(Arm(name, gamma) for gamma in range(low, high + 1))
    return tuple(sorted(arms, key=str))


def bandit_config(settings: Settings, topology: Topology = "shared") -> BanditConfig:
    """Buckets and dwell from the settings; ``policy.params`` may set any other field.

    ``topology`` follows from how decisions reach the fleet, not from tuning: routing
    mode (a pool per config) is ``per_arm``; one engine per model is ``shared``.
    """
    fixed = {"buckets", "dwell_s", "topology", "moves_need_evidence"}
    known = {f.name for f in dataclasses.fields(BanditConfig)} - fixed
    unknown = sorted(set(settings.policy.params) - known)
    if unknown:
        raise ValueError(f"policy.params: unknown {unknown} (known: {sorted(known)})")
    params = dict(settings.policy.params)
    pushes = settings.actuators.mode == "push"
    if pushes:
        # One config per engine at a time: the data cannot split drafting from the step.
        params.setdefault("draft_cost_prior", DRAFT_COST_PRIOR)
    else:
        # A push restarts engines: nothing is pushed before there is evidence for it.
        params.setdefault("cold_proposer", model_free_proposer(settings))
    return BanditConfig(
        buckets=ConcurrencyBuckets(tuple(settings.buckets)),
        dwell_s=settings.policy.min_dwell_s,
        topology=topology,
        moves_need_evidence=pushes,
        **params,
    )


def model_free_proposer(settings: Settings) -> str | None:
    """The fleet's n-gram proposer (by name; the first, where several pools name
    one), which drafts by a lookup in the prompt: what ``BanditConfig.cold_proposer``
    serves a class with before it has a plan."""
    names = {
        name
        for pool in settings.fleet.pools.values()
        for name, proposer in pool.proposers.items()
        if proposer.method == "ngram"
    }
    return min(names) if names else None


EXPLORING = frozenset({"explore", "probe", "trial"})
"""The reasons of a request served by another arm than its context's committed one."""


class BanditControlPolicy:
    """``SpecPilotPolicy`` behind the loop's ``ControlPolicy`` port."""

    def __init__(self, policy: SpecPilotPolicy) -> None:
        self.policy = policy
        self._drift_seen = 0

    def observe(self, observation: RequestObservation) -> None:
        self.policy.observe(observation)

    def observe_window(self, window: WindowObservation) -> None:
        self.policy.observe_window(window)

    def drift(self) -> Sequence[DriftEvent]:
        events = self.policy.change_events
        if self._drift_seen > len(events):  # a state was loaded since
            self._drift_seen = len(events)
        new = events[self._drift_seen :]
        self._drift_seen = len(events)
        return [
            DriftEvent(e.at_s, e.model, e.workload_class, e.proposer, e.baseline, e.recent)
            for e in new
        ]

    def route(self, context: Context) -> Route:
        """The bandit's route as a gateway worker samples from it: the Thompson arm's
        share is the share of the class's requests the exploration cap gives it in the
        long run (in process, ``select`` follows the cap's moving rate instead)."""
        policy = self.policy
        route = policy.route(context)
        explore_share = policy.exploration.explore_share(context.model, context.workload_class)
        explore = tuple(
            (str(arm), explore_share if why == "explore" else share, why)
            for arm, share, why in route.explore
        )
        return Route(str(route.arm), route.reason, explore)

    def routed(self, request: Routed) -> None:
        """Count a request the gateway routed as ``select`` counts those it serves."""
        try:
            arm = Arm.parse(request.arm)
        except ValueError:
            return
        self.policy.served(request.context, arm, request.reason in EXPLORING, request.at)

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        try:
            running: Arm | None = Arm.parse(current)
        except ValueError:
            running = None
        decision = self.policy.decide(context, running=running)
        arm = str(decision.arm)
        if arm not in allowed_arms:
            return ArmChoice(current, f"policy prefers {arm}, which no pool here can run")
        # An incumbent has no evidence yet: whatever the model predicts for it is a guess.
        speedup = None if decision.reason == "incumbent" else decision.predicted_speedup
        return ArmChoice(arm, decision.reason, speedup)

    def set_pins(self, pins: Mapping[Context, str]) -> None:
        for override in self.policy.overrides:
            self.policy.clear_override(
                model=override.model, workload_class=override.workload_class, bucket=override.bucket
            )
        for context, arm in pins.items():
            self.policy.set_override(
                Arm.parse(arm),
                model=context.model,
                workload_class=context.workload_class,
                bucket=context.bucket,
            )

    def estimates(self, context: Context) -> Sequence[ArmEstimate]:
        believed = self.policy.context_estimates(context)
        committed = believed["context"]
        acceptance = {a["proposer"]: a for a in believed["acceptance"]}
        estimates = []
        for arm in self.policy.arms:
            seen = acceptance.get(arm.proposer) if arm.proposer else None
            is_committed = committed is not None and committed["arm"] == str(arm)
            interval = committed["interval"] if is_committed and committed else None
            estimates.append(
                ArmEstimate(
                    arm=str(arm),
                    first_position_acceptance=seen["first_position_acceptance"] if seen else None,
                    first_position_acceptance_interval=None,
                    speedup=committed["predicted_speedup"] if is_committed and committed else None,
                    speedup_interval=tuple(interval) if interval else None,
                    observations=int(seen["requests"]) if seen else 0,
                )
            )
        return estimates

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state)
        self._drift_seen = len(self.policy.change_events)


def bandit_policy(
    settings: Settings,
    *,
    clock: Callable[[], float] = time.time,
    rng: np.random.Generator | None = None,
    topology: Topology = "shared",
) -> BanditControlPolicy:
    policy = SpecPilotPolicy(
        fleet_arms(settings),
        clock=clock,
        rng=rng if rng is not None else np.random.default_rng(),
        config=bandit_config(settings, topology),
    )
    return BanditControlPolicy(policy)


class QueuedObservations:
    """Observations handed over in-process (from the gateway's workers), drained by the
    loop, with the routed requests they follow (routing mode).

    Bounded: past ``limit`` the oldest are dropped and counted, so a stalled loop costs
    memory up to the bound, never more.
    """

    exclusive = True
    """Only this replica sees these requests: a follower hands them to the leader."""

    def __init__(self, limit: int = 100_000) -> None:
        self._queue: deque[RequestObservation] = deque(maxlen=limit)
        self._routed: deque[Routed] = deque(maxlen=limit)
        self.dropped = 0

    def put(self, observation: RequestObservation) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(observation)

    def put_routed(self, request: Routed) -> None:
        if len(self._routed) == self._routed.maxlen:
            self.dropped += 1
        self._routed.append(request)

    async def collect(self) -> Collected:
        drained, routed = tuple(self._queue), tuple(self._routed)
        self._queue.clear()
        self._routed.clear()
        return Collected(observations=drained, routed=routed)

    async def aclose(self) -> None:
        self._queue.clear()
        self._routed.clear()
