from __future__ import annotations

from typing import Any

import numpy as np

from policies.bandit import BanditConfig, SpecPilotPolicy
from policies.base import Clock
from simulator.run import RunResult, simulate
from simulator.scenario import Scenario, parse_scenario


def scenario(**overrides: Any) -> Scenario:
    data: dict[str, Any] = {
        "seed": 5,
        "duration_s": 600,
        "model": {"step_ms": 20, "knee_tokens": 64},
        "proposers": {
            "eagle3": {"draft_cost": 0.04, "gammas": [1, 2, 3, 4, 5]},
            "ngram": {"draft_cost": 0.005, "gammas": [2, 4, 6]},
        },
        "classes": {
            "code": {
                "share": 0.5,
                "output_tokens": 120,
                "acceptance": {"eagle3": 0.5, "ngram": 0.9},
            },
            "chat": {
                "share": 0.5,
                "output_tokens": 120,
                "acceptance": {"eagle3": 0.8, "ngram": 0.1},
            },
        },
        "phases": [{"at_s": 0, "concurrency": 2}],
    }
    data.update(overrides)
    return parse_scenario(data)


def run_specpilot(
    scn: Scenario, seed: int = 0, config: BanditConfig | None = None
) -> tuple[SpecPilotPolicy, RunResult]:
    made: list[SpecPilotPolicy] = []

    def make(clock: Clock) -> SpecPilotPolicy:
        policy = SpecPilotPolicy(
            scn.arms, clock=clock, rng=np.random.default_rng(seed), config=config
        )
        made.append(policy)
        return policy

    result = simulate(scn, make)
    return made[0], result
