"""Planning at and near the compute knee: the concurrency a bucket is planned for, the
knee the cost model assumes where the data cannot place it, knee trials, and never
doing worse than no speculation at saturation. Deterministic (fixed seeds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from policy_sim import run_specpilot, scenario

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm, Context
from policies.bandit import SpecPilotPolicy
from policies.baselines import OraclePolicy, StaticPolicy
from policies.estimators import KNEE_CELL, KNEE_GRID, StepCostModel
from policies.fleet import CostParams
from simulator.run import RunResult, simulate
from simulator.scenario import Scenario, load_scenario
from simulator.truth import ScenarioTruth


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(clock: ManualClock) -> SpecPilotPolicy:
    scn = scenario()
    return SpecPilotPolicy(scn.arms, clock=clock, rng=np.random.default_rng(0))


def test_a_burst_is_planned_for_the_concurrency_it_runs_at() -> None:
    """48 requests started at one instant run 48 together, though the policy serves
    them one by one (seeing 1, 2, …, 48 in flight)."""
    clock = ManualClock()
    policy = _policy(clock)
    context = Context("m", "code", "32+")
    for _ in range(48):
        policy.choose(context)
    clock.now = 1.0
    policy.choose(context)  # the next event reads what the burst ran at
    assert policy.learning.concurrency("m", "32+") == pytest.approx(48.0)


def test_a_concurrency_sample_stays_within_its_bucket() -> None:
    """The caller bucketed the request by its own count of what is in flight: a policy
    that sees fewer (e.g. some requests went elsewhere) does not plan below the bucket."""
    clock = ManualClock()
    policy = _policy(clock)
    policy.choose(Context("m", "code", "32+"))
    clock.now = 1.0
    policy.observe(
        RequestObservation(
            model="m",
            prompt_tokens=None,
            output_tokens=10,
            ttft_s=0.1,
            mean_itl_s=0.02,
            generation_time_s=0.2,
            spec=None,
            workload_class="code",
            arm=str(OFF),
            concurrency=1,
            finished_at=1.0,
        )
    )
    assert policy.learning.concurrency("m", "32+") == pytest.approx(32.0)


def _feed(model: StepCostModel, truth: CostParams, batches: list[int], steps: int = 60) -> None:
    for t in range(steps):
        verify = batches[t % len(batches)]
        model.update(model.features(verify, {}), truth.step_time(verify, {}), float(t))


def test_batches_of_one_size_are_taken_as_memory_bound() -> None:
    """All-off batches of 48 fit a knee of 8 with a 6 ms step as well as a knee above
    48 with the step seen: without evidence of a compute-bound batch, the knee is put
    at the edge of what was seen, not below it."""
    truth = CostParams(step_s=0.03, knee_tokens=96, draft_cost={})
    model = StepCostModel(["eagle3"])
    _feed(model, truth, [48])
    mean = model.mean_params()
    assert mean.knee_tokens >= 48
    assert mean.knee_tokens < 48 * KNEE_CELL
    assert mean.step_s == pytest.approx(0.03, rel=1e-3)
    assert model.largest_batch == pytest.approx(48.0)
    # The worst the data allows: the knee right at the largest batch seen.
    assert model.edge_params().knee_tokens == pytest.approx(48.0)
    # The next grid knee is just as consistent with the data.
    bolder = model.next_knee_params()
    assert bolder is not None
    assert bolder.knee_tokens == pytest.approx(KNEE_GRID[KNEE_GRID.index(mean.knee_tokens) + 1])


def test_no_bolder_knee_once_a_batch_went_past_it() -> None:
    truth = CostParams(step_s=0.03, knee_tokens=48, draft_cost={})
    model = StepCostModel(["eagle3"])
    _feed(model, truth, [16, 96])
    assert model.mean_params().knee_tokens == pytest.approx(48, rel=KNEE_CELL - 1)
    assert model.next_knee_params() is None
    assert model.edge_params() == model.mean_params()


def test_largest_batch_survives_a_state_round_trip() -> None:
    model = StepCostModel(["eagle3"])
    _feed(model, CostParams(step_s=0.03, knee_tokens=96, draft_cost={}), [40])
    restored = StepCostModel(["eagle3"])
    restored.load_state(model.to_state())
    assert restored.largest_batch == pytest.approx(40.0)


def _oracle(scn: Scenario) -> RunResult:
    return simulate(scn, lambda clock: OraclePolicy(scn.arms, ScenarioTruth(scn, clock)))


def test_saturated_from_the_start_costs_nothing() -> None:
    """A fleet that starts right at its knee: nothing is known yet, and any probe or
    exploration slows every sequence. specpilot keeps off's goodput there, and still
    learns to speculate once the load drops."""
    scn = scenario(
        duration_s=400,
        model={"step_ms": 25, "knee_tokens": 48},
        phases=[{"at_s": 0, "concurrency": 48}, {"at_s": 60, "concurrency": 2}],
    )
    policy, result = run_specpilot(scn)
    off = simulate(scn, lambda clock: StaticPolicy(OFF))
    assert result.phase_goodput(0) >= 0.98 * off.phase_goodput(0)
    assert result.phase_goodput(1) >= 1.3 * off.phase_goodput(1)
    assert policy.explore_fraction <= 0.1


def test_a_load_step_to_saturation_is_planned_for_the_new_load() -> None:
    """Speculating at 6 streams, then 48 at once, at a knee of 48: the bucket is
    planned for 48 streams from the burst on (not for the 1, 2, … in flight as the
    burst was served), so next to nothing explores or probes past the knee there."""
    scn = scenario(
        duration_s=500,
        model={"step_ms": 25, "knee_tokens": 48},
        phases=[{"at_s": 0, "concurrency": 6}, {"at_s": 420, "concurrency": 48}],
    )
    _, result = run_specpilot(scn)
    off = simulate(scn, lambda clock: StaticPolicy(OFF))
    oracle = _oracle(scn)
    # Requests started at 6 streams still run when the load steps up: even the oracle
    # loses a little to them.
    assert result.phase_goodput(1) >= oracle.phase_goodput(1) - 0.01 * off.phase_goodput(1)
    late = [a for a in result.admissions if a.at_s >= 420]
    assert sum(a.arm != OFF for a in late) <= 0.03 * len(late)


def test_knee_trials_lift_a_knee_estimate_stuck_at_the_edge() -> None:
    """At 16 streams from the start the first batches are small, so the knee estimate
    starts at their edge; planning on it alone would never run a larger batch. Knee
    trials show the knee is higher and the plan follows."""
    scn = scenario(
        duration_s=600,
        model={"step_ms": 25, "knee_tokens": 96},
        phases=[{"at_s": 0, "concurrency": 16}],
    )
    policy, result = run_specpilot(scn)
    assert ("sim-model", "16-31") in policy.exploration.next_trial  # trials ran
    knee = policy.learning.cost["sim-model"].mean_params().knee_tokens
    assert knee >= 64
    chat = policy.decide(Context("sim-model", "chat", "16-31")).arm
    assert chat.proposer == "eagle3" and chat.gamma >= 3
    assert result.goodput >= 0.9 * _oracle(scn).goodput
    assert policy.explore_fraction <= 0.1


def test_no_knee_trial_where_the_knee_may_already_bind() -> None:
    """All off at 48 streams, where no batch above 48 was ever seen: one knee cell
    bolder would put speculation on top of a batch that may already be compute-bound,
    which costs more than ``trial_max_loss``."""
    scn = scenario(
        duration_s=300,
        model={"step_ms": 25, "knee_tokens": 48},
        phases=[{"at_s": 0, "concurrency": 48}],
    )
    policy, _ = run_specpilot(scn)
    assert ("sim-model", "32+") not in policy.exploration.next_trial


def test_a_knee_trial_moves_fewer_classes_where_moving_all_could_cost_too_much() -> None:
    """Eight streams, two classes on n-gram γ=4 (40 verified positions, the largest
    batch seen), the knee really at 128: the plan one knee cell bolder moves both
    classes to γ 5 and 6, which would cost more than ``trial_max_loss`` were the knee
    right at 40. Moving one class at a time stays within it, and the knee estimate
    climbs until both run γ=6 (56 positions), as the oracle does."""
    path = Path(__file__).resolve().parents[2] / "bench/scenarios/holdout-stationary-505.yaml"
    scn = load_scenario(path).model_copy(update={"duration_s": 240.0})
    policy, _ = run_specpilot(scn)
    knee = policy.learning.cost["sim-model"].mean_params().knee_tokens
    assert knee >= 56
    for cls in ("chat", "code"):
        assert policy.decide(Context("sim-model", cls, "8-15")).arm == Arm("ngram", 6)
    assert policy.explore_fraction <= 0.1
