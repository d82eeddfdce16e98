"""A version-1 policy state, as ``policies/bandit.py`` saved it before it became a
package, still loads: for the same arms and, through the checks of what still holds,
for others. After the restore the policy learns from the same steps exactly what the
old code learned (``fixtures/bandit_state_v1.json``, made by
``fixtures/make_bandit_state_v1.py`` at commit a219f69); what it decides from that is
today's fleet model's, and every request it serves is the decided arm or explores.
It reports no drift the old code reported from the replay: those read position-0
acceptance over every step, drafted or not, and the replay's windows draft on 150 of
246 steps while accepting 0.7 of every drafted step's first token throughout, so they
were falls and rises of drafting, not of acceptance (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bandit_state_replay import replay

from policies.arms import Arm
from policies.bandit import BanditConfig, SpecPilotPolicy

FIXTURE = Path(__file__).with_name("fixtures") / "bandit_state_v1.json"


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


@pytest.mark.parametrize(
    ("variant", "arms_key"),
    [("same_arms", "arms"), ("wider", "wider_arms"), ("ngram_only", "ngram_only_arms")],
)
def test_version_1_state_loads_and_learns_as_before(
    saved: dict[str, Any], variant: str, arms_key: str
) -> None:
    assert saved["state"]["version"] == 1
    policy = SpecPilotPolicy(
        [Arm.parse(a) for a in saved[arms_key]],
        clock=lambda: 0.0,
        rng=np.random.default_rng(11),
        config=BanditConfig(probe_budget=0.05),
    )
    policy.load_state_dict(json.loads(json.dumps(saved["state"])))
    replayed = json.loads(json.dumps(replay(policy)))
    before = saved[variant]
    for part in ("acceptance", "overrides"):
        assert replayed["estimates"][part] == before["estimates"][part]
    restored = saved["state"]["change_events"]
    assert replayed["estimates"]["change_events"] == restored
    assert len(before["estimates"]["change_events"]) > len(restored)
    (cost,), (cost_before,) = replayed["estimates"]["cost"], before["estimates"]["cost"]
    assert cost["knee_tokens"] == cost_before["knee_tokens"]
    assert cost["step_s"] == pytest.approx(cost_before["step_s"], rel=1e-9)
    assert cost["draft_cost"] == pytest.approx(cost_before["draft_cost"], rel=1e-9)
    assert replayed["selected"] == before["selected"]
    for decided, _, chosen, _, explored in replayed["steps"]:
        assert explored or chosen == decided


def test_a_migrated_state_saves_as_the_current_version(saved: dict[str, Any]) -> None:
    arms = [Arm.parse(a) for a in saved["arms"]]
    config = BanditConfig(probe_budget=0.05)
    policy = SpecPilotPolicy(arms, clock=lambda: 0.0, rng=np.random.default_rng(1), config=config)
    policy.load_state_dict(saved["state"])
    state = json.loads(json.dumps(policy.state_dict()))
    clone = SpecPilotPolicy(arms, clock=lambda: 0.0, rng=np.random.default_rng(1), config=config)
    clone.load_state_dict(state)
    assert clone.state_dict() == state
    assert clone.estimates() == policy.estimates()
