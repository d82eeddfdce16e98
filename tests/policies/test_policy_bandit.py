"""Deterministic behaviour of specpilot's bandit on small simulated fleets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from policy_sim import run_specpilot, scenario

from policies.arms import OFF, Arm, Context
from policies.bandit import SpecPilotPolicy
from policies.baselines import StaticPolicy
from simulator.run import simulate


def test_converges_to_the_right_proposer_per_class() -> None:
    scn = scenario()
    policy, _ = run_specpilot(scn)
    code = policy.decide(Context("sim-model", "code", "2-3"))
    chat = policy.decide(Context("sim-model", "chat", "2-3"))
    assert code.arm.proposer == "ngram"
    assert chat.arm.proposer == "eagle3"
    assert chat.arm.gamma >= 3  # α = 0.8 on a quiet GPU pays for a long draft
    assert code.predicted_speedup is not None and code.predicted_speedup > 1.5
    assert code.interval is not None and code.interval[0] <= code.predicted_speedup
    assert policy.explore_fraction <= 0.1


def test_turns_speculation_off_under_saturation() -> None:
    scn = scenario(
        phases=[{"at_s": 0, "concurrency": 2}, {"at_s": 200, "concurrency": 64}],
        model={"step_ms": 20, "knee_tokens": 32},
    )
    policy, result = run_specpilot(scn)
    for cls in ("code", "chat"):
        assert policy.decide(Context("sim-model", cls, "32+")).arm == OFF
    off = simulate(scn, lambda clock: StaticPolicy(OFF))
    assert result.phase_goodput(1) >= 0.97 * off.phase_goodput(1)
    # …while it did speculate when the GPU was quiet.
    assert policy.decide(Context("sim-model", "chat", "2-3")).arm != OFF


def test_detects_drift_and_recovers() -> None:
    scn = scenario(
        duration_s=900,
        classes={
            "code": {
                "share": 1.0,
                "output_tokens": 120,
                "acceptance": {"eagle3": 0.85, "ngram": 0.6},
            }
        },
        drift=[{"at_s": 400, "class": "code", "proposer": "eagle3", "acceptance": 0.15}],
    )
    policy, result = run_specpilot(scn)
    events = policy.change_events
    assert len(events) == 1
    event = events[0]
    assert (event.workload_class, event.proposer) == ("code", "eagle3")
    assert 400 <= event.at_s < 460
    assert event.recent < event.baseline
    before = [a.arm for a in result.admissions if 300 <= a.at_s < 400 and not a.explored]
    after = [a.arm for a in result.admissions if a.at_s >= 700 and not a.explored]
    assert all(arm.proposer == "eagle3" for arm in before)
    assert after and all(arm.proposer == "ngram" for arm in after)


def test_no_alarm_without_drift() -> None:
    policy, _ = run_specpilot(scenario(duration_s=900, phases=[{"at_s": 0, "concurrency": 8}]))
    assert policy.change_events == []


def test_overrides_always_win() -> None:
    scn = scenario(duration_s=200)
    policy, _ = run_specpilot(scn)
    chat = Context("sim-model", "chat", "2-3")
    assert policy.context("sim-model", "chat", 3) == chat
    policy.set_override(Arm("ngram", 2), workload_class="chat")
    policy.set_override(Arm("eagle3", 1), workload_class="chat", bucket="32+")
    for _ in range(50):
        assert policy.select(chat) == Arm("ngram", 2)
    decision = policy.decide(Context("sim-model", "chat", "32+"))
    assert (decision.arm, decision.reason) == (Arm("eagle3", 1), "override")
    assert policy.decide(Context("other-model", "chat", "1")).arm == Arm("ngram", 2)
    assert policy.clear_override(workload_class="chat")
    assert policy.decide(chat).reason != "override"
    with pytest.raises(ValueError):
        policy.set_override(Arm("medusa", 3))


def test_estimates_and_state_are_json() -> None:
    scn = scenario(duration_s=300)
    policy, _ = run_specpilot(scn)
    estimates = json.loads(json.dumps(policy.estimates()))
    assert {e["proposer"] for e in estimates["acceptance"]} == {"eagle3", "ngram"}
    cost = estimates["cost"][0]
    assert cost["step_s"] == pytest.approx(0.02, rel=0.15)
    assert cost["draft_cost"]["eagle3"] == pytest.approx(0.04, abs=0.02)
    chat_eagle = next(
        e
        for e in estimates["acceptance"]
        if (e["workload_class"], e["proposer"]) == ("chat", "eagle3")
    )
    assert chat_eagle["first_position_acceptance"] == pytest.approx(0.8, abs=0.06)

    state = json.loads(json.dumps(policy.state_dict()))
    clone = SpecPilotPolicy(scn.arms, clock=policy.clock, rng=np.random.default_rng(1))
    clone.load_state_dict(state)
    assert clone.state_dict() == state
    for context in (Context("sim-model", "chat", "2-3"), Context("sim-model", "code", "2-3")):
        assert clone.decide(context) == policy.decide(context)
