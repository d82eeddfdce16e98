"""When an operator's override ends, its contexts go where the policy's evidence says,
and without evidence back to the config their pool runs: neither kept on the pinned arm
nor dropped to off. Checked with the scripted fake policy and with specpilot's bandit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from controller.contexts import Context
from controller.ports import Collected, ControlPolicy
from controller.service import build_service
from controller.settings import Settings
from controller.store.records import OverrideRecord, Scope
from controller.wiring import bandit_policy
from tests.controller.fakes import QueueSource, ScriptedPolicy, observation
from tests.controller.test_loop import Clock

CODE_LOW = Context("m", "code", "1-3")
RUNNING = "ngram:2"
PINNED = "tiny:2"


def settings_running_ngram(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        classes=["code", "chat"],
        buckets=[1, 4],
        scrape_interval_s=0.05,
        policy={"min_dwell_s": 0, "measure_after_s": 10},
        fleet={
            "pools": {
                "p": {
                    "model": "m",
                    "instances": ["http://127.0.0.1:9"],
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
                    "proposers": {
                        "ngram": {"method": "ngram", "gamma": [1, 4]},
                        "tiny": {"method": "draft_model", "model": "/d", "gamma": [1, 3]},
                    },
                }
            }
        },
    )


def pin_then_expire(tmp_path: Path, policy: ControlPolicy, *learn: Any) -> dict[Context, str]:
    """Pin code to tiny:2 for 100 s, tick inside and after it; the arms after it."""
    settings = settings_running_ngram(tmp_path)
    clock = Clock()
    source = QueueSource()
    service = build_service(settings, policy, source, actuators=[], clock=clock)
    try:
        loop = service.loop
        asyncio.run(loop.start())
        service.store.add_override(
            OverrideRecord(
                "o1",
                1000.0,
                1100.0,
                Scope("*", "code", "*"),
                {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2},
                "incident",
            )
        )
        clock.now = 1010.0
        asyncio.run(loop.tick())
        assert loop.arms[CODE_LOW] == PINNED and loop.actors[CODE_LOW] == "operator"
        for item in learn:
            source.batches.append(Collected(observations=(item,)))
        clock.now = 1200.0  # expired
        asyncio.run(loop.tick())
        assert loop.actors[CODE_LOW] == "policy"
        return dict(loop.arms)
    finally:
        service.close()


def test_without_evidence_the_scope_returns_to_the_config_its_pool_runs(tmp_path: Path) -> None:
    arms = pin_then_expire(tmp_path, ScriptedPolicy([1, 4]))
    assert arms[CODE_LOW] == RUNNING


def test_with_evidence_the_scope_goes_where_the_policy_says(tmp_path: Path) -> None:
    seen = observation("ngram:3", 0.01)
    arms = pin_then_expire(tmp_path, ScriptedPolicy([1, 4]), seen)
    assert arms[CODE_LOW] == "ngram:3"


def test_the_bandit_without_evidence_returns_it_to_the_running_config_not_off(
    tmp_path: Path,
) -> None:
    policy = bandit_policy(
        settings_running_ngram(tmp_path), clock=Clock(), rng=np.random.default_rng(7)
    )
    arms = pin_then_expire(tmp_path, policy)
    assert arms[CODE_LOW] == RUNNING
