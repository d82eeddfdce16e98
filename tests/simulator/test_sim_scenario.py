from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from policies.arms import OFF, Arm
from simulator.scenario import ScenarioError, load_scenario, parse_scenario

ISSUE_EXAMPLE = """
seed: 1
duration_s: 1800
model: {step_ms: 30, knee_tokens: 64}
proposers:
  eagle3: {draft_cost: 0.05, gammas: [1, 2, 3, 4, 5, 6, 8]}
  draft:  {draft_cost: 0.12, gammas: [2, 4, 6]}
  ngram:  {draft_cost: 0.005, gammas: [2, 3, 4, 5]}
classes:
  code:     {share: 0.4, output_tokens: 256, acceptance: {eagle3: 0.82, draft: 0.7, ngram: 0.55}}
  chat:     {share: 0.4, output_tokens: 384, acceptance: {eagle3: 0.7, draft: 0.6, ngram: 0.15}}
  creative: {share: 0.2, output_tokens: 512, acceptance: {eagle3: 0.45, draft: 0.35, ngram: 0.03}}
phases:
  - {at_s: 0, concurrency: 2}
  - {at_s: 600, concurrency: 48}
  - {at_s: 1200, concurrency: 4}
drift:
  - {at_s: 900, class: code, proposer: eagle3, acceptance: 0.4}
"""


def _minimal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "proposers": {"ngram": {}},
        "classes": {"code": {"share": 1.0, "acceptance": {"ngram": 0.5}}},
    }
    data.update(overrides)
    return data


def test_issue_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "example.yaml"
    path.write_text(ISSUE_EXAMPLE)
    scenario = load_scenario(path)
    assert scenario.duration_s == 1800
    assert len(scenario.arms) == 1 + 7 + 3 + 4
    assert scenario.arms[0] is OFF and Arm("draft", 6) in scenario.arms
    assert scenario.concurrency_at(0) == 2
    assert scenario.concurrency_at(700) == 48
    assert scenario.acceptance_at("code", "eagle3", 899) == 0.82
    assert scenario.acceptance_at("code", "eagle3", 900) == 0.4
    assert scenario.acceptance_at("chat", "eagle3", 1500) == 0.7
    assert scenario.cost.step_s == pytest.approx(0.03)


def test_documented_defaults() -> None:
    scenario = parse_scenario(_minimal())
    assert scenario.seed == 0
    assert scenario.duration_s == 3600
    assert scenario.model.step_ms == 30 and scenario.model.knee_tokens == 64
    assert scenario.model.position_decay == 0.97
    assert scenario.proposers["ngram"].gammas == [1, 2, 3, 4, 5]
    assert scenario.proposers["ngram"].draft_cost == 0.05
    assert scenario.classes["code"].output_tokens == 256
    assert [(p.at_s, p.concurrency) for p in scenario.phases] == [(0, 1)]
    assert scenario.drift == []


def test_unlisted_proposer_means_no_acceptance() -> None:
    data = _minimal(proposers={"ngram": {}, "eagle3": {}})
    assert parse_scenario(data).acceptance_at("code", "eagle3", 0) == 0.0


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (
            _minimal(classes={"code": {"share": 1.0, "acceptance": {"medusa": 0.5}}}),
            "classes.code.acceptance.medusa",
        ),
        (
            _minimal(
                classes={
                    "code": {"share": 0.5, "acceptance": {}},
                    "chat": {"share": 0.4, "acceptance": {}},
                }
            ),
            "share",
        ),
        (
            _minimal(classes={"code": {"share": 1.0, "acceptance": {"ngram": 1.3}}}),
            "classes.code.acceptance.ngram",
        ),
        (
            _minimal(drift=[{"at_s": 5, "class": "code", "proposer": "x", "acceptance": 0.1}]),
            "drift[0].proposer",
        ),
        (
            _minimal(drift=[{"at_s": 5, "class": "code", "proposer": "ngram", "acceptance": -1}]),
            "drift[0].acceptance",
        ),
        (_minimal(model={"step_ms": -1}), "model.step_ms"),
        (_minimal(modle={"step_ms": 3}), "modle"),
        (_minimal(proposers={"ngram": {"gammas": [0, 2]}}), "proposers.ngram"),
        (
            _minimal(phases=[{"at_s": 10, "concurrency": 2}, {"at_s": 5, "concurrency": 1}]),
            "phases",
        ),
    ],
)
def test_rejections_name_the_key(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data)
    assert key in str(info.value)


def test_not_yaml_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError):
        load_scenario(path)
