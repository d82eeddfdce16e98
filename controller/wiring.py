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

from collectors.observations import RequestObservation
from controller.contexts import Context
from controller.ports import ArmChoice, ArmEstimate, Collected
from controller.settings import Settings
from policies.arms import Arm, ConcurrencyBuckets
from policies.bandit import BanditConfig, SpecPilotPolicy
from policies.fleet import Topology


def fleet_arms(settings: Settings) -> tuple[Arm, ...]:
    """Every arm some pool can run: its proposers over their γ ranges, and what it runs now."""
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
    known = {f.name for f in dataclasses.fields(BanditConfig)} - {"buckets", "dwell_s", "topology"}
    unknown = sorted(set(settings.policy.params) - known)
    if unknown:
        raise ValueError(f"policy.params: unknown {unknown} (known: {sorted(known)})")
    return BanditConfig(
        buckets=ConcurrencyBuckets(tuple(settings.buckets)),
        dwell_s=settings.policy.min_dwell_s,
        topology=topology,
        **settings.policy.params,
    )


class BanditControlPolicy:
    """``SpecPilotPolicy`` behind the loop's ``ControlPolicy`` port."""

    def __init__(self, policy: SpecPilotPolicy) -> None:
        self.policy = policy

    def observe(self, observation: RequestObservation) -> None:
        self.policy.observe(observation)

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        decision = self.policy.decide(context)
        arm = str(decision.arm)
        if arm not in allowed_arms:
            return ArmChoice(current, f"policy prefers {arm}, which no pool here can run")
        return ArmChoice(arm, decision.reason, decision.predicted_speedup)

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
        believed = self.policy.estimates()
        committed = next(
            (
                c
                for c in believed["contexts"]
                if (c["model"], c["workload_class"], c["bucket"])
                == (context.model, context.workload_class, context.bucket)
            ),
            None,
        )
        acceptance = {
            a["proposer"]: a
            for a in believed["acceptance"]
            if (a["model"], a["workload_class"]) == (context.model, context.workload_class)
        }
        estimates = []
        for arm in self.policy.arms:
            seen = acceptance.get(arm.proposer) if arm.proposer else None
            is_committed = committed is not None and committed["arm"] == str(arm)
            interval = committed["interval"] if is_committed and committed else None
            estimates.append(
                ArmEstimate(
                    arm=str(arm),
                    acceptance=seen["first_position_acceptance"] if seen else None,
                    acceptance_interval=None,
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
    """Observations handed over in-process (by the gateway), drained by the loop.

    Bounded: past ``limit`` the oldest are dropped and counted, so a stalled loop costs
    memory up to the bound, never more.
    """

    exclusive = True
    """Only this replica sees these requests: a follower hands them to the leader."""

    def __init__(self, limit: int = 100_000) -> None:
        self._queue: deque[RequestObservation] = deque(maxlen=limit)
        self.dropped = 0

    def put(self, observation: RequestObservation) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(observation)

    async def collect(self) -> Collected:
        drained = tuple(self._queue)
        self._queue.clear()
        return Collected(observations=drained)

    async def aclose(self) -> None:
        self._queue.clear()
