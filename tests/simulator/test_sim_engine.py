from __future__ import annotations

import numpy as np
import pytest

from policies.arms import OFF, Arm
from policies.baselines import StaticPolicy
from policies.fleet import CostParams
from policies.speedup import counterfactual_expected_tokens
from simulator.engine import Engine, SimRequest, Traffic, plan_request
from simulator.run import simulate
from simulator.scenario import Scenario, parse_scenario


def _scenario(**extra: object) -> Scenario:
    data: dict[str, object] = {
        "seed": 3,
        "duration_s": 120,
        "proposers": {"eagle3": {"draft_cost": 0.03, "gammas": [2, 4]}},
        "classes": {
            "code": {"share": 0.5, "output_tokens": 100, "acceptance": {"eagle3": 0.8}},
            "chat": {"share": 0.5, "output_tokens": 60, "acceptance": {"eagle3": 0.5}},
        },
        "phases": [{"at_s": 0, "concurrency": 3}],
    }
    data.update(extra)
    return parse_scenario(data)


def test_traffic_is_the_same_for_every_policy() -> None:
    scenario = _scenario()
    a, b = Traffic(scenario), Traffic(scenario)
    for stream, index in [(0, 0), (2, 7), (1, 3)]:
        ra, rb = a.request(stream, index, 0.0), b.request(stream, index, 50.0)
        assert ra.workload_class == rb.workload_class
        assert ra.output_tokens == rb.output_tokens
        assert np.array_equal(ra.uniforms, rb.uniforms)
        assert ra.alpha == rb.alpha


def test_drift_lowers_acceptance_of_the_same_request() -> None:
    drift = [{"at_s": 10, "class": "code", "proposer": "eagle3", "acceptance": 0.3}]
    traffic = Traffic(_scenario(drift=drift))
    for index in range(20):
        before, after = traffic.request(0, index, 0.0), traffic.request(0, index, 20.0)
        if before.workload_class == "code":
            assert after.alpha["eagle3"] < before.alpha["eagle3"]


def test_plan_is_a_prefix_model_consistent_with_the_counterfactual() -> None:
    rng = np.random.default_rng(0)
    request = SimRequest(1, 0, "code", 400, {"p": 0.7}, rng.random(400))
    long, short = plan_request(request, Arm("p", 5), 1.0), plan_request(request, Arm("p", 2), 1.0)
    assert long.cumulative()[-1] == 400 and short.cumulative()[-1] == 400
    assert long.steps < short.steps < plan_request(request, OFF, 1.0).steps == 400
    # The same draws run at γ = 5 predict γ = 2's tokens per step.
    expected = counterfactual_expected_tokens(long.accepted_per_position, long.steps)
    assert expected[2] == pytest.approx(400 / short.steps, rel=0.1)


def test_batch_shares_one_step_time() -> None:
    cost = CostParams(step_s=0.01, knee_tokens=8, draft_cost={"p": 0.1})
    engine = Engine(cost, "m", 1.0)
    rng = np.random.default_rng(1)
    for i in range(4):
        engine.add(SimRequest(i, i, "c", 50, {"p": 0.5}, rng.random(50)), Arm("p", 3))
    # 4 sequences × 4 positions = 16 verified tokens: twice the knee; 3 draft positions.
    assert engine.step_time() == pytest.approx(0.01 * 2 + 0.1 * 0.01 * 3)
    done = engine.advance(until=100.0)
    assert done and all(c.observation.finished_at == engine.now for c in done)
    obs = done[0].observation
    assert obs.spec is not None and obs.spec.num_draft_tokens == obs.spec.num_drafts * 3
    assert obs.concurrency in {1, 2, 3, 4}


def test_simulation_is_deterministic_and_speculation_helps_at_low_load() -> None:
    scenario = _scenario()
    off_a = simulate(scenario, lambda clock: StaticPolicy(OFF))
    off_b = simulate(scenario, lambda clock: StaticPolicy(OFF))
    assert off_a.tokens == off_b.tokens and off_a.tpots == off_b.tpots
    spec = simulate(scenario, lambda clock: StaticPolicy(Arm("eagle3", 4)))
    assert spec.goodput > 1.5 * off_a.goodput
    assert spec.mean_tpot_s < off_a.mean_tpot_s


def test_closed_loop_follows_phases() -> None:
    scenario = _scenario(
        phases=[{"at_s": 0, "concurrency": 1}, {"at_s": 60, "concurrency": 8}], duration_s=120
    )
    result = simulate(scenario, lambda clock: StaticPolicy(OFF))
    early = [a for a in result.admissions if a.at_s < 60]
    late = [a for a in result.admissions if a.at_s >= 60]
    assert len(late) > 4 * len(early)
    assert result.phase_goodput(1) > 4 * result.phase_goodput(0)
