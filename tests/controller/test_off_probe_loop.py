"""Push mode's way back from off, as the decision log shows it: the real bandit, loop,
store and API, fed windows as a scrape delivers them. An n-gram context whose
acceptance collapsed goes off; after ``push_probe_every_s`` the loop records a
``probe`` decision back to n-gram with what the policy predicted for every arm."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from controller.ports import Collected
from controller.service import build_service
from controller.settings import Settings
from controller.wiring import bandit_policy
from tests.controller.fakes import QueueSource
from tests.controller.test_drift_alerts import NGRAM4, Clock
from tests.policies.test_off_probe import COLLAPSED, off_window, spec_window
from tests.policies.test_window_evidence import CONDITIONALS

EVERY_S = 300.0


def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": tmp_path,
            "classes": ["code"],
            "buckets": [1, 2, 4, 8, 16, 32],
            "policy": {
                "min_dwell_s": 0.0,
                "params": {"push_probe_every_s": EVERY_S, "push_probe_s": 60.0},
            },
            "fleet": {
                "pools": {
                    "code": {
                        "model": "m",
                        "instances": ["http://w:8000"],
                        "speculative_config": NGRAM4,
                        "proposers": {"ngram": {"method": "ngram", "gamma": [1, 4]}},
                    }
                }
            },
        }
    )


def test_a_context_turned_off_probes_back_and_the_decision_log_says_so(tmp_path: Path) -> None:
    config = settings(tmp_path)
    clock = Clock()
    policy = bandit_policy(config, clock=clock, rng=np.random.default_rng(0))
    source = QueueSource()
    service = build_service(
        config, policy, source, actuators=[], registry=CollectorRegistry(), clock=clock
    )
    rng = np.random.default_rng(3)

    async def feed(make: Any, count: int) -> None:
        for _ in range(count):
            clock.now += 15.0
            source.batches.append(Collected(window_observations=[make(clock.now)]))
            await service.loop.tick()

    async def run() -> list[dict[str, Any]]:
        await service.loop.start()
        await feed(lambda at: spec_window(rng, CONDITIONALS, at), 10)
        await feed(lambda at: spec_window(rng, COLLAPSED, at), 12)
        await feed(off_window, int(EVERY_S / 15) + 4)
        return [
            {
                "arm": d.arm,
                "previous_arm": d.previous_arm,
                "reason": d.reason,
                "ts": d.ts,
                "alternatives": d.alternatives,
            }
            for d in reversed(service.store.decisions(limit=100).decisions)
            if d.context.bucket == "1"
        ]

    try:
        decided = asyncio.run(run())
    finally:
        service.close()
    arms = [(d["arm"], d["reason"]) for d in decided]
    went_off = next(i for i, d in enumerate(decided) if d["arm"] == "off")
    probes = [d for d in decided[went_off:] if d["reason"] == "probe"]
    assert probes, arms
    probe = probes[0]
    assert probe["arm"] == "ngram:1" and probe["previous_arm"] == "off", arms
    assert probe["ts"] - decided[went_off]["ts"] >= EVERY_S, arms
    weighed = {a.arm: a for a in probe["alternatives"]}
    assert weighed["off"].predicted_speedup == 1.0 and "ngram:1" in weighed
