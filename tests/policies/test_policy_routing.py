"""The bandit in routing mode: each arm runs in its own pool (``topology="per_arm"``).

The world is the fast simulator with one engine per arm (``PerArmEngines``): a request's
steps are paced by its own pool only. One class of self-repeating code; a quiet phase,
a busy one and a quiet one again — the shape of ``specpilot bench loop`` on real vLLM.
"""

from __future__ import annotations

import numpy as np
from policy_sim import scenario

from policies.arms import OFF, Arm, Context
from policies.bandit import BanditConfig, SpecPilotPolicy
from policies.base import Clock
from policies.baselines import StaticPolicy
from policies.fleet import CostParams, Topology
from simulator.engine import Completion, Engine, SimRequest
from simulator.run import RunResult, simulate
from simulator.scenario import Scenario

NGRAM = Arm("ngram", 4)


class PerArmEngines:
    """One batch per arm, each stepping at the cost of its own composition."""

    def __init__(self, cost: CostParams, model_name: str, position_decay: float) -> None:
        self.cost = cost
        self.model_name = model_name
        self.position_decay = position_decay
        self.now = 0.0
        self.engines: dict[Arm, Engine] = {}

    @property
    def in_flight(self) -> int:
        return sum(engine.in_flight for engine in self.engines.values())

    def emitted_tokens(self) -> int:
        return sum(engine.emitted_tokens() for engine in self.engines.values())

    def add(self, request: SimRequest, arm: Arm, concurrency: int | None = None) -> None:
        engine = self.engines.get(arm)
        if engine is None:
            engine = self.engines[arm] = Engine(self.cost, self.model_name, self.position_decay)
        if not engine.in_flight:
            engine.now = max(engine.now, self.now)
        engine.add(request, arm, concurrency)

    def advance(self, until: float) -> list[Completion]:
        """Advance every busy engine to the first finish anywhere, or to ``until``."""
        busy = [engine for engine in self.engines.values() if engine.in_flight]
        target = min([until, *(engine.next_finish_at() for engine in busy)])
        finished: list[Completion] = []
        for engine in busy:
            if engine.now < target:
                finished.extend(engine.advance(target))
        ends = [c.observation.finished_at or target for c in finished]
        self.now = max([self.now, target, *ends])
        return finished


def routing_world() -> Scenario:
    return scenario(
        duration_s=900,
        model={"step_ms": 20, "knee_tokens": 16},
        proposers={"ngram": {"draft_cost": 0.02, "gammas": [4]}},
        classes={"code": {"share": 1.0, "output_tokens": 120, "acceptance": {"ngram": 0.8}}},
        phases=[
            {"at_s": 0, "concurrency": 1},
            {"at_s": 300, "concurrency": 32},
            {"at_s": 600, "concurrency": 1},
        ],
    )


def pools(scn: Scenario) -> PerArmEngines:
    return PerArmEngines(scn.cost, scn.model.name, scn.model.position_decay)


def static(scn: Scenario, arm: Arm) -> RunResult:
    return simulate(scn, lambda clock: StaticPolicy(arm), engine=pools(scn))


def bandit(scn: Scenario, topology: Topology) -> tuple[SpecPilotPolicy, RunResult]:
    made: list[SpecPilotPolicy] = []

    def make(clock: Clock) -> SpecPilotPolicy:
        config = BanditConfig(topology=topology)
        made.append(
            SpecPilotPolicy(scn.arms, clock=clock, rng=np.random.default_rng(3), config=config)
        )
        return made[0]

    result = simulate(scn, make, engine=pools(scn))
    return made[0], result


def test_each_pool_paces_only_its_own_requests() -> None:
    scn = routing_world()
    ngram, off = static(scn, NGRAM), static(scn, OFF)
    # The world itself: n-gram wins the quiet phases, off the busy one.
    assert ngram.phase_goodput(0) > 1.3 * off.phase_goodput(0)
    assert off.phase_goodput(1) > 1.3 * ngram.phase_goodput(1)


def test_routing_policy_follows_the_load_both_ways() -> None:
    scn = routing_world()
    policy, result = bandit(scn, "per_arm")
    assert policy.decide(Context("sim-model", "code", "1")).arm == NGRAM
    assert policy.decide(Context("sim-model", "code", "32+")).arm == OFF
    ngram, off = static(scn, NGRAM), static(scn, OFF)
    for phase, best in ((0, ngram), (1, off), (2, ngram)):
        assert result.phase_goodput(phase) >= 0.9 * best.phase_goodput(phase), phase
    assert result.goodput > max(ngram.goodput, off.goodput)
