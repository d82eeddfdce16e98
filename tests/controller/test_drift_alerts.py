"""Drift becomes an alert from scraped windows alone: the real bandit, the real loop and
store, windows queued as a scrape would deliver them (the scrape itself is tested on
real vLLM pages and a real vLLM elsewhere)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
from prometheus_client import CollectorRegistry

from controller.api import create_app
from controller.ports import Collected
from controller.service import build_service
from controller.settings import Settings
from controller.wiring import bandit_policy
from tests.controller.fakes import QueueSource
from tests.policies.test_window_evidence import CONDITIONALS, as_window, requests

NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": tmp_path,
            "classes": ["code"],
            "policy": {"min_dwell_s": 0.0},
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


def test_acceptance_drift_alert_fires_from_windows_and_resolves(tmp_path: Path) -> None:
    config = settings(tmp_path)
    clock = Clock()
    registry = CollectorRegistry()
    policy = bandit_policy(config, clock=clock, rng=np.random.default_rng(0))
    source = QueueSource()
    service = build_service(config, policy, source, actuators=[], registry=registry, clock=clock)
    loop = service.loop
    rng = np.random.default_rng(11)

    def firing() -> float | None:
        return registry.get_sample_value(
            "specpilot_alert_firing",
            {
                "alert": "AcceptanceDrift",
                "model_name": "m",
                "workload_class": "code",
                "proposer": "ngram",
            },
        )

    async def windows(conditionals: tuple[float, ...], count: int) -> None:
        for _ in range(count):
            clock.now += 15.0
            window = as_window(requests(rng, 20, conditionals), clock.now)
            source.batches.append(Collected(window_observations=[window]))
            await loop.tick()

    async def run() -> dict[str, object]:
        await loop.start()
        await windows(CONDITIONALS, 10)
        assert service.store.alerts(unresolved_only=True) == []
        await windows((0.1, 0.1, 0.1, 0.1), 8)
        transport = httpx.ASGITransport(app=create_app(config, service))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            listed = (await api.get("/v1/alerts", params={"unresolved": "true"})).json()
        assert firing() == 1
        await windows(CONDITIONALS, 8)
        return listed

    try:
        listed = asyncio.run(run())
    finally:
        service.close()
    [alert] = [a for a in listed["alerts"] if a["name"] == "AcceptanceDrift"]  # type: ignore[index]
    assert alert["severity"] == "warning"
    assert alert["context"] == "model_name=m,workload_class=code,proposer=ngram"
    # Before and after, as the windows showed them: acceptance and tokens per verify.
    assert "acceptance 0." in alert["message"] and "tokens per verify step" in alert["message"]
    assert registry.get_sample_value("specpilot_alerts_total", {"alert": "AcceptanceDrift"}) == 1
    # Recovered: resolved in the store, the gauge back at 0.
    assert firing() == 0
    stored = [a for a in service.store.alerts() if a.name == "AcceptanceDrift"]
    assert stored and all(a.resolved_at is not None for a in stored)


def test_a_restart_with_other_arms_keeps_what_still_holds(tmp_path: Path) -> None:
    """The settings widened the γ range and added a proposer: serve starts, warm."""
    config = settings(tmp_path)
    clock = Clock()
    source = QueueSource()
    first = build_service(
        config, bandit_policy(config, clock=clock), source, actuators=[], clock=clock
    )
    rng = np.random.default_rng(2)

    async def learn() -> None:
        await first.loop.start()
        for _ in range(6):
            clock.now += 15.0
            window = as_window(requests(rng, 20, CONDITIONALS), clock.now)
            source.batches.append(Collected(window_observations=[window]))
            await first.loop.tick()
        await first.loop.shutdown()

    asyncio.run(learn())
    first.close()
    data = config.model_dump(mode="python")
    data["fleet"]["pools"]["code"]["proposers"] = {
        "ngram": {"method": "ngram", "gamma": [1, 6]},
        "eagle3": {"method": "eagle3", "model": "heads/eagle3", "gamma": [1, 3]},
    }
    wider = Settings.model_validate(data)
    policy = bandit_policy(wider, clock=clock)
    second = build_service(wider, policy, QueueSource(), actuators=[], clock=clock)
    try:
        asyncio.run(second.loop.start())
        kept = policy.policy.learning.acceptance[("m", "code", "ngram")]
        assert kept.positions == 6 and kept.requests > 50
        assert second.loop.arms  # every context has its arm back
    finally:
        second.close()
