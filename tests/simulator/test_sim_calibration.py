"""The published anchors the cost model is calibrated on, as measured ratios."""

from __future__ import annotations

import pytest

from policies.arms import OFF, Arm
from policies.baselines import StaticPolicy
from simulator.calibration import EAGLE3_DRAFT_COST, VANILLA_DRAFT_COST, calibration_scenario
from simulator.run import simulate
from simulator.scenario import Scenario


def _ratio(scenario: Scenario, arm: Arm) -> float:
    def make(arm: Arm):  # type: ignore[no-untyped-def]
        return lambda clock: StaticPolicy(arm)

    off = simulate(scenario, make(OFF))
    spec = simulate(scenario, make(arm))
    return spec.goodput / off.goodput


def test_vanilla_draft_quiet_gpu_about_1_95() -> None:
    scenario = calibration_scenario(1, "draft", 0.62, VANILLA_DRAFT_COST)
    best = max(_ratio(scenario, Arm("draft", g)) for g in (3, 4, 5))
    assert best == pytest.approx(1.95, abs=0.1)


def test_eagle3_quiet_gpu_about_2_9() -> None:
    scenario = calibration_scenario(1, "eagle3", 0.81, EAGLE3_DRAFT_COST)
    assert _ratio(scenario, Arm("eagle3", 4)) == pytest.approx(2.9, abs=0.15)


def test_gain_gone_by_about_12_requests_per_second_at_gamma_5() -> None:
    def at(streams: int) -> tuple[float, float]:
        scenario = calibration_scenario(
            streams,
            "draft",
            0.62,
            VANILLA_DRAFT_COST,
            step_ms=15,
            output_tokens=128,
            duration_s=120,
        )
        off = simulate(scenario, lambda clock: StaticPolicy(OFF))
        spec = simulate(scenario, lambda clock: StaticPolicy(Arm("draft", 5)))
        return spec.goodput / off.goodput, len(off.tpots) / scenario.duration_s

    light_ratio, light_rate = at(8)
    heavy_ratio, heavy_rate = at(24)
    assert light_rate < 6 and light_ratio > 1.5
    assert 10 < heavy_rate < 14
    assert heavy_ratio <= 1.0
