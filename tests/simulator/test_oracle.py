"""The benchmark's upper bound: the exact batch model, the oracle, and the bound check."""

from __future__ import annotations

import numpy as np
import pytest

from bench.policy import PATH_NOISE, bound_check, bound_check_scenarios, drift_report
from policies.arms import OFF, Arm, Context
from policies.estimators import ChangeEvent
from simulator.generate import random_scenario
from simulator.oracle import BatchOracle, StationaryBatch, assignment_goodput, oracle_buckets
from simulator.run import Admission, RunResult, simulate
from simulator.scenario import Scenario, parse_scenario


class Fixed:
    """One arm per class, always."""

    name = "fixed"

    def __init__(self, assignment: dict[str, Arm]) -> None:
        self.assignment = assignment

    def select(self, context: Context) -> Arm:
        return self.assignment.get(context.workload_class or "", OFF)

    def best_guess(self, context: Context) -> Arm:
        return self.select(context)

    def observe(self, observation: object) -> None:
        pass


def _steady(seed: int, concurrency: int, duration_s: float) -> Scenario:
    data = random_scenario(seed, duration_s=duration_s, stationary=True)
    data["phases"] = [{"at_s": 0, "concurrency": concurrency}]
    return parse_scenario(data)


@pytest.mark.parametrize(
    ("seed", "concurrency", "duration_s", "runs"),
    [(3, 1, 4000.0, 6), (15, 4, 3000.0, 3), (20, 24, 2000.0, 1), (13, 48, 1500.0, 1)],
)
def test_exact_model_predicts_the_simulated_goodput(
    seed: int, concurrency: int, duration_s: float, runs: int
) -> None:
    """The oracle's objective is the simulator's long-run goodput, not an approximation
    of it: within 1 % of the mean over stationary runs with different traffic (enough
    of them that their noise, about ±2 % per run at one stream, averages out), for the
    best assignment and for an arbitrary one."""
    scenario = _steady(seed, concurrency, duration_s)
    batch = StationaryBatch(scenario, 0.0)
    best, _ = batch.best(concurrency)
    rng = np.random.default_rng(seed)
    other = {c: batch.arms[int(rng.integers(len(batch.arms)))] for c in batch.classes}
    for assignment in (best, other):
        predicted = assignment_goodput(batch, concurrency, assignment)
        simulated = [
            simulate(
                scenario.model_copy(update={"seed": 1000 + run}),
                lambda clock, a=assignment: Fixed(a),  # type: ignore[misc]
            ).goodput
            for run in range(runs)
        ]
        assert float(np.mean(simulated)) == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("seed", [2, 6, 13, 19])
def test_the_search_never_ends_below_one_arm_for_all(seed: int) -> None:
    scenario = parse_scenario(random_scenario(seed))
    batch = StationaryBatch(scenario, 0.0)
    for concurrency in (1, 6, 24, 64):
        _, value = batch.best(concurrency)
        uniform = np.repeat(np.arange(len(batch.arms))[:, None], len(batch.classes), axis=1)
        assert value >= batch.goodput(concurrency, uniform).max() * (1 - 1e-12)


def test_the_oracle_follows_drift_epochs_and_the_level_after_a_drain() -> None:
    scenario = parse_scenario(random_scenario(6))
    drift = min(scenario.drift, key=lambda d: d.at_s)
    cls = drift.workload_class
    now = [0.0]
    oracle = BatchOracle(scenario, lambda: now[0])
    buckets = oracle_buckets(scenario)
    level = scenario.phases[0].concurrency
    assert (
        oracle.select(Context("m", cls, buckets.bucket(level)))
        == (StationaryBatch(scenario, 0.0).best(level)[0][cls])
    )
    # From the drift on, requests are planned with the acceptance after it; and one
    # that starts above the phase's level (streams still retiring) for the level.
    now[0] = drift.at_s
    settled = scenario.concurrency_at(drift.at_s)
    after = StationaryBatch(scenario, drift.at_s)
    assert after.alphas[(cls, drift.proposer)] == drift.acceptance
    assert (
        oracle.select(Context("m", cls, buckets.bucket(settled + 7)))
        == (after.best(settled)[0][cls])
    )


def _admission(at_s: float, cls: str, arm: str, explored: bool = False) -> Admission:
    return Admission(at_s, cls, Arm.parse(arm), explored)


def test_drifts_are_split_by_whether_the_drifting_proposer_served_its_class() -> None:
    data = random_scenario(6)
    data["classes"] = {
        "code": {"share": 0.5, "acceptance": {"eagle3": 0.8, "ngram": 0.7}},
        "chat": {"share": 0.5, "acceptance": {"eagle3": 0.7, "ngram": 0.1}},
    }
    data["proposers"] = {"eagle3": {}, "ngram": {}}
    data["drift"] = [
        {"at_s": 100, "class": "code", "proposer": "eagle3", "acceptance": 0.3},
        {"at_s": 200, "class": "chat", "proposer": "ngram", "acceptance": 0.5},
        {"at_s": 300, "class": "chat", "proposer": "eagle3", "acceptance": 0.2},
    ]
    scenario = parse_scenario(data)
    admissions = [
        _admission(50, "code", "eagle3:4"),
        _admission(90, "code", "ngram:2", explored=True),  # a probe is not what serves
        _admission(150, "chat", "eagle3:3"),
        *[_admission(100 + i, "code", "eagle3:4") for i in range(1, 6)],
        *[_admission(300 + i, "chat", "eagle3:3") for i in range(1, 4)],
    ]
    result = RunResult("specpilot", 600.0, 0, [0], [600.0], admissions=admissions)
    events = [
        ChangeEvent(104.5, "m", "code", "eagle3", 0.8, 0.3),
        ChangeEvent(250.0, "m", "chat", "ngram", 0.1, 0.5),
        ChangeEvent(400.0, "m", "code", "ngram", 0.7, 0.7),
    ]
    report = drift_report(scenario, result, events)
    # code × eagle3 served code: 4 code requests from its drift to the firing; chat ×
    # eagle3 served chat too and was never found.
    assert report.delays == [4, None]
    # chat × ngram did not serve chat (eagle3 did): reported apart, found 50 s later.
    assert report.idle == [
        {
            "at_s": 200.0,
            "class": "chat",
            "proposer": "ngram",
            "acceptance": 0.5,
            "serving_arm": "eagle3:3",
            "detected": True,
            "delay_requests": 0,
        }
    ]
    assert report.false_alarms == 1


def test_stationary_random_scenarios_keep_the_fleet_and_drop_the_changes() -> None:
    moving, steady = random_scenario(505), random_scenario(505, stationary=True)
    assert steady["phases"] == moving["phases"][:1] and steady["drift"] == []
    assert steady["classes"] == moving["classes"]
    assert steady["proposers"] == moving["proposers"]


def test_no_policy_beats_the_oracle() -> None:
    """Every shipped scenario and twenty random ones: no policy of ``bench policy`` gets
    more goodput than the oracle beyond the path noise (see ``PATH_NOISE``)."""
    rows = bound_check(bound_check_scenarios(), jobs=2)
    assert len(rows) >= 28
    beaten = {
        row["scenario"]: (row["top_other"], round(row["top_other_vs_oracle"], 5))
        for row in rows
        if row["top_other_vs_oracle"] > 1.0 + PATH_NOISE
    }
    assert beaten == {}
    for row in rows:
        assert max(row["policies_vs_oracle"].values()) == row["top_other_vs_oracle"]
