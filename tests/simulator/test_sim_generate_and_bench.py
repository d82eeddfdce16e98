from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from bench import cli
from simulator.generate import random_scenario
from simulator.scenario import load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_generated_scenarios_are_valid(seed: int) -> None:
    scenario = parse_scenario(random_scenario(seed))
    assert 2 <= len(scenario.classes) <= 5
    assert random_scenario(seed) == random_scenario(seed)


def test_shipped_scenarios_load() -> None:
    files = sorted(SCENARIOS.glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        load_scenario(path)


def test_bench_policy_cli_prints_the_issue_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = random_scenario(7, duration_s=240)
    data["phases"] = [{"at_s": 0, "concurrency": 2}, {"at_s": 120, "concurrency": 24}]
    data["drift"] = []
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "policy", "--scenario", str(path), "--json", "--jobs", "1"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    names = set(report["policies"])
    assert {
        "specpilot",
        "oracle",
        "fluid_oracle",
        "best_static",
        "off",
        "batch_size_table",
        "epsilon_greedy",
        "ucb1",
    } <= names
    assert any(n.startswith("static:") for n in names)
    for row in report["policies"].values():
        assert row["goodput"] > 0 and row["mean_tpot_s"] > 0
    ratios = report["ratios"]
    assert {"vs_best_static", "vs_oracle", "vs_off_at_saturation"} <= set(ratios)
    best = report["policies"]["best_static"]["goodput"]
    assert best >= report["policies"]["off"]["goodput"]
    assert ratios["vs_best_static"] == pytest.approx(
        report["policies"]["specpilot"]["goodput"] / best
    )
    assert report["drift_detection_delay_requests"] == []
    assert report["idle_arm_drifts"] == []
    assert isinstance(report["false_alarms"], int)
    assert 0 <= report["explore_fraction"] <= 1
    # One select per specpilot request, timed on the request path.
    latency = report["select_latency_us"]
    assert latency["calls"] > 100
    assert 0 < latency["p50"] <= latency["p99"] <= latency["p999"] <= latency["max"]
    assert report["bound"]["top_other"] in names
    # Per phase: goodput that adds up to the run's, and every admitted request's arm.
    phases = report["phases"]
    assert [p["concurrency"] for p in phases] == [2, 24]
    for name in ("specpilot", "oracle", "best_static"):
        seconds = [120.0, 120.0]
        total = sum(p["goodput"][name] * s for p, s in zip(phases, seconds, strict=True))
        # (A phase's seconds run from event to event: within a step of its nominal 120.)
        assert total / 240.0 == pytest.approx(report["policies"][name]["goodput"], rel=1e-3)
    classes = set(data["classes"])
    for phase in phases:
        assert set(phase["arms"]["oracle"]) == classes
        assert all(n > 0 for by_arm in phase["arms"]["specpilot"].values() for n in by_arm.values())
    # What specpilot believed at the end: every class × proposer it served or probed.
    learned = report["learned"]
    served = {
        (cls, arm.split(":")[0])
        for phase in phases
        for cls, by_arm in phase["arms"]["specpilot"].items()
        for arm in by_arm
        if arm != "off"
    }
    believed = {(a["workload_class"], a["proposer"]) for a in learned["acceptance"]}
    assert served <= believed
    for a in learned["acceptance"]:
        assert 0.0 <= a["first_position_acceptance"] <= 1.0 and a["requests"] > 0
    (cost,) = learned["cost"]
    assert cost["step_s"] > 0 and set(cost["draft_cost"]) == set(data["proposers"])


def test_bench_policy_cli_runs_a_stationary_random_scenario(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "policy", "--random", "31", "--stationary", "--duration", "240", "--json"]
    )
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scenario"]["stationary"] is True
    assert report["scenario"]["phases"] == 1 and report["scenario"]["drift_events"] == 0
    best = report["policies"]["best_static"]["goodput"]
    assert report["ratios"]["vs_best_static"] == pytest.approx(
        report["policies"]["specpilot"]["goodput"] / best
    )


def test_the_bound_check_runs_specpilot_with_more_policy_seeds() -> None:
    """``--seeds``: each row's ratio per policy seed, the full run's seed first, every
    other one as a whole bench run with that seed would give it."""
    from bench.policy import _bound_row, run_policy_bench, seeds_summary

    data = random_scenario(7, duration_s=120)
    data["drift"] = []
    scenario = parse_scenario(data)
    row = _bound_row("small", scenario, seed=0, seeds=(0, 3))
    by_seed = row["vs_oracle_by_seed"]
    assert list(by_seed) == ["0", "3"] and by_seed["0"] == row["vs_oracle"]
    alone = run_policy_bench(scenario, seed=3, jobs=1)["ratios"]["vs_oracle"]
    assert by_seed["3"] == pytest.approx(alone, rel=1e-12)
    other = {**row, "scenario": "other", "vs_oracle_by_seed": {"0": 0.99, "3": 0.5}}
    summary = seeds_summary([row, other])
    assert summary["seeds"] == ["0", "3"]
    assert (summary["min"], summary["min_at"]) == (0.5, "other, seed 3")
    assert summary["min_by_seed"] == {"0": min(by_seed["0"], 0.99), "3": 0.5}
    assert summary["mean"] == pytest.approx((by_seed["0"] + by_seed["3"] + 0.99 + 0.5) / 4)
