"""Drift becomes an alert from scraped windows alone: the real bandit, the real loop and
store, windows queued as a scrape would deliver them (the scrape itself is tested on
real vLLM pages and a real vLLM elsewhere)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from collectors.observations import WindowObservation
from controller.alerting import Alerts
from controller.api import create_app
from controller.ports import Collected, DriftEvent
from controller.service import build_service
from controller.settings import Settings
from controller.telemetry import ServiceMetrics
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


class Harness:
    """The real bandit, loop, store and API, fed windows as a scrape delivers them."""

    def __init__(self, tmp_path: Path, seed: int = 11) -> None:
        self.config = settings(tmp_path)
        self.clock = Clock()
        self.registry = CollectorRegistry()
        policy = bandit_policy(self.config, clock=self.clock, rng=np.random.default_rng(0))
        self.source = QueueSource()
        self.service = build_service(
            self.config,
            policy,
            self.source,
            actuators=[],
            registry=self.registry,
            clock=self.clock,
        )
        self.loop = self.service.loop
        self.rng = np.random.default_rng(seed)
        self.fed: list[WindowObservation] = []

    async def windows(
        self, conditionals: tuple[float, ...], count: int, *, drafting: bool = True
    ) -> None:
        for _ in range(count):
            self.clock.now += 15.0
            window = as_window(requests(self.rng, 20, conditionals), self.clock.now)
            if not drafting:  # n-gram found no match: the same tokens, one per step
                window = dataclasses.replace(
                    window, drafts=0.0, draft_tokens=0.0, accepted_per_position=(0.0,) * 4
                )
            self.fed.append(window)
            self.source.batches.append(Collected(window_observations=[window]))
            await self.loop.tick()

    def gauge(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def firing(self) -> float | None:
        return self.gauge("specpilot_alert_firing", alert="AcceptanceDrift", **PROPOSER)

    async def api(self, path: str, **params: str) -> Any:
        transport = httpx.ASGITransport(app=create_app(self.config, self.service))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return (await api.get(path, params=params)).json()


PROPOSER = {"model_name": "m", "workload_class": "code", "proposer": "ngram"}


def counts(windows: list[WindowObservation]) -> str:
    """How an alert states vLLM's counts over these windows."""
    accepted = sum(w.accepted_tokens for w in windows)
    tokens = sum(w.draft_tokens for w in windows)
    return f"{accepted / tokens:.2f} ({accepted:.0f} of {tokens:.0f} draft tokens accepted"


def test_acceptance_drift_alert_fires_from_windows_and_resolves(tmp_path: Path) -> None:
    """Before and after in the message are vLLM's acceptance (accepted over draft
    tokens) summed over exactly the windows before and after the fall; it resolves once
    the windows since it fired are back above the midpoint, saying so."""
    h = Harness(tmp_path)
    resolved: list[str] = []

    async def run() -> dict[str, Any]:
        await h.loop.start()
        await h.windows(CONDITIONALS, 10)
        assert h.service.store.alerts(unresolved_only=True) == []
        for _ in range(8):
            await h.windows((0.1, 0.1, 0.1, 0.1), 1)
            if h.firing() == 1:
                break
        listed = await h.api("/v1/alerts", unresolved="true")
        assert h.firing() == 1
        fired = len(h.fed)
        for _ in range(8):
            await h.windows(CONDITIONALS, 1)
            if h.firing() == 0:
                resolved.extend(
                    a.message for a in h.service.store.alerts() if a.resolved_at is not None
                )
                break
        listed["fired"] = fired
        return dict(listed)

    try:
        listed = asyncio.run(run())
    finally:
        h.service.close()
    [alert] = [a for a in listed["alerts"] if a["name"] == "AcceptanceDrift"]
    assert alert["severity"] == "warning"
    assert alert["context"] == "model_name=m,workload_class=code,proposer=ngram"
    message = alert["message"]
    high, low = h.fed[:10], h.fed[10 : listed["fired"]]
    assert f"fell from {counts(high)}" in message, message
    assert f"to {counts(low)}" in message, message
    assert "position-0 acceptance per drafted step" in message
    assert h.gauge("specpilot_alerts_total", alert="AcceptanceDrift") == 1
    # Recovered: resolved in the store, the gauge back at 0.
    assert h.firing() == 0
    stored = [a for a in h.service.store.alerts() if a.name == "AcceptanceDrift"]
    assert stored and all(a.resolved_at is not None for a in stored)
    back = h.fed[listed["fired"] :]
    assert sum(w.draft_tokens for w in back) >= 500


def test_a_proposer_that_drafts_nothing_raises_no_drift_and_says_so(tmp_path: Path) -> None:
    """n-gram on prose finds no match and proposes nothing: no acceptance to measure.
    That is neither acceptance 0 nor a drift; specpilot_drafted_nothing and /v1/policy
    say it, and acceptance stays what vLLM last measured."""
    h = Harness(tmp_path)

    async def run() -> Any:
        await h.loop.start()
        await h.windows(CONDITIONALS, 10)
        await h.windows(CONDITIONALS, 12, drafting=False)
        return await h.api("/v1/policy")

    try:
        policy = asyncio.run(run())
    finally:
        h.service.close()
    # No drift (speculation that drafts nothing may well lose, and say so, at high load).
    assert [a for a in h.service.store.alerts() if a.name == "AcceptanceDrift"] == []
    assert h.firing() is None
    assert h.gauge("specpilot_drafted_nothing", **PROPOSER) == 1
    drafted = h.fed[:10]
    recent = drafted[-next(k for k in range(1, 11) if draft_tokens(drafted[-k:]) >= 500) :]
    expected = sum(w.accepted_tokens for w in recent) / draft_tokens(recent)
    assert h.gauge("specpilot_acceptance_ratio", **PROPOSER) == pytest.approx(expected)
    running = [c for c in policy["contexts"] if c["arm"] == "ngram:4"]
    assert running, policy
    for context in running:
        assert context["estimate"]["drafted_nothing"] is True
        assert context["estimate"]["acceptance"] == pytest.approx(expected)


def draft_tokens(windows: list[WindowObservation]) -> float:
    return sum(w.draft_tokens for w in windows)


def test_policy_api_and_metrics_show_vllms_acceptance_not_the_models(tmp_path: Path) -> None:
    """Windows in which a third of the steps drafted nothing: vLLM's acceptance counts
    only what was drafted; the policy's per-step figure is lower and has its own name."""
    h = Harness(tmp_path)

    async def run() -> Any:
        await h.loop.start()
        for _ in range(8):
            h.clock.now += 15.0
            window = as_window(requests(h.rng, 20, CONDITIONALS), h.clock.now)
            # As many steps again that found no match, one token each.
            window = dataclasses.replace(
                window, generation_tokens=window.generation_tokens + window.drafts / 2
            )
            h.fed.append(window)
            h.source.batches.append(Collected(window_observations=[window]))
            await h.loop.tick()
        return await h.api("/v1/policy")

    try:
        policy = asyncio.run(run())
    finally:
        h.service.close()
    fed = h.fed
    recent = fed[-next(k for k in range(1, 9) if draft_tokens(fed[-k:]) >= 500) :]
    expected = sum(w.accepted_tokens for w in recent) / draft_tokens(recent)
    [context] = [c for c in policy["contexts"] if c["bucket"] == "1"]
    estimate = context["estimate"]
    assert estimate["arm"] == "ngram:4"
    assert estimate["acceptance"] == pytest.approx(expected)
    assert estimate["acceptance_evidence"]["draft_tokens"] == draft_tokens(recent)
    assert estimate["acceptance_evidence"]["until"] == fed[-1].finished_at
    assert estimate["drafted_nothing"] is False
    # The policy's own figure, per decode step, is another number under another name.
    modelled = estimate["estimated_first_position_acceptance"]
    assert modelled is not None and abs(modelled - expected) > 0.03
    labels = {"model_name": "m", "workload_class": "code", "bucket": "1"}
    assert h.gauge("specpilot_context_acceptance_ratio", **labels) == pytest.approx(expected)
    assert h.gauge("specpilot_acceptance_ratio", **PROPOSER) == pytest.approx(expected)
    assert h.gauge("specpilot_drafted_nothing", **PROPOSER) == 0
    # Arms that did not run have no acceptance of vLLM's to show.
    others = [e for e in context["estimates"] if e["arm"] != "ngram:4"]
    assert others and all(e["acceptance"] is None for e in others)


def test_a_firing_drift_is_announced_again_while_it_holds(tmp_path: Path) -> None:
    """The notifier resolves what is not raised again within resolve_after_s: a drift
    that still holds is re-announced every iteration, so it never expires there."""
    h = Harness(tmp_path)
    announced: list[str] = []

    async def run() -> None:
        await h.loop.start()
        h.loop.notifier.notify = lambda record: announced.append(record.name)  # type: ignore[method-assign]
        await h.windows(CONDITIONALS, 10)
        await h.windows((0.1, 0.1, 0.1, 0.1), 8)
        assert h.firing() == 1
        before = announced.count("AcceptanceDrift")
        await h.windows((0.1, 0.1, 0.1, 0.1), 3)
        assert announced.count("AcceptanceDrift") == before + 3

    try:
        asyncio.run(run())
    finally:
        h.service.close()


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


def test_a_detected_fall_that_vllms_acceptance_does_not_show_raises_nothing() -> None:
    """The detector reads position 0 only; the alert speaks of vLLM's acceptance, so a
    fall there that the accepted-over-draft-tokens figure does not show is no alert."""
    alerts = Alerts(ServiceMetrics(CollectorRegistry()))
    rng = np.random.default_rng(3)
    at = 1000.0
    for conditionals in [(0.5, 0.5, 0.5, 0.5)] * 4 + [(0.9, 0.9, 0.9, 0.9)] * 4:
        at += 15.0
        alerts.note_window(as_window(requests(rng, 20, conditionals), at))
    event = DriftEvent(at, "m", "code", "ngram", before=0.9, after=0.6)
    assert alerts.drifted(event) is None
    assert alerts.firing_drifts() == []


def test_a_fall_without_vllms_counts_says_so() -> None:
    """Requests whose stats lack draft token counts: the alert says what the detector
    saw and that vLLM gave no counts, rather than a figure it does not have."""
    alerts = Alerts(ServiceMetrics(CollectorRegistry()))
    event = DriftEvent(1000.0, "m", "code", "ngram", before=0.9, after=0.3)
    record = alerts.drifted(event)
    assert record is not None
    assert "vLLM reported no draft token counts" in record.message
    assert "position-0 acceptance per drafted step fall 0.90 -> 0.30" in record.message
