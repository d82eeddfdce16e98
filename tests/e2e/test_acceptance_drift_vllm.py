"""AcceptanceDrift on real vLLM, push mode beside it (``collect: scrape``): a fall of
acceptance fires it, the recovery resolves it, and every figure it and ``/v1/policy``
give is vLLM's acceptance (accepted over draft tokens) over the same counters.

n-gram γ = 4 accepts most drafts on greedy code (its continuations repeat the prompt)
and few on JSON sampled at T = 1, where it still drafts on most steps: a fall of
acceptance, not of drafting. The test ticks the loop after each batch of requests, on
an idle server, so each scraped window ends where the test reads vLLM's counters and
the alert's counts can be checked exactly. An override pins the running arm, so what
the policy would decide does not move the attribution of the windows.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from controller.api import create_app
from controller.runtime import assemble
from controller.store.records import OverrideRecord, Scope
from testbed.traffic import Mix, run_streams
from tests.conftest import VllmServers
from tests.e2e.test_sidecar_vllm import counters, sidecar_settings

pytestmark = pytest.mark.vllm

CODE: Mix = (("code", 0.0),)
SAMPLED_JSON: Mix = (("json", 1.0),)
HIGH_BATCHES = 8
"""Greedy-code windows before the fall: the detector's warm-up (5) and some."""
MAX_BATCHES = 12
"""At most this many windows for the alert to fire, and again to resolve."""
RECENT_DRAFT_TOKENS = 500
PIN = {"method": "ngram", "num_speculative_tokens": 4}

Counts = tuple[float, float, float]
"""vLLM's (drafts, draft tokens, accepted tokens) as the test read them."""


def stated(counts: Counts) -> str:
    """How specpilot states vLLM's acceptance over a span of counts."""
    drafts, tokens, accepted = counts
    return (
        f"{accepted / tokens:.2f} ({accepted:.0f} of {tokens:.0f} draft tokens accepted, "
        f"{1 + accepted / drafts:.2f} tokens per verify step"
    )


def between(start: Counts, end: Counts) -> Counts:
    d = tuple(b - a for a, b in zip(start, end, strict=True))
    return (d[0], d[1], d[2])


def test_acceptance_drift_fires_on_a_fall_and_resolves_on_the_recovery(
    vllm_servers: VllmServers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = vllm_servers.get("ngram:4")
    settings = sidecar_settings(server.base_url, tmp_path / "data")
    registry = CollectorRegistry()
    runtime = assemble(settings, registry=registry)
    service, loop = runtime.service, runtime.service.loop
    seen: list[Counts] = []
    """vLLM's counters after each tick: the ends of the windows specpilot scraped."""
    batch = 0

    model = settings.fleet.pools["code"].model
    proposer = {"model_name": model, "workload_class": "code", "proposer": "ngram"}

    def firing() -> float | None:
        labels = {"alert": "AcceptanceDrift", **proposer}
        return registry.get_sample_value("specpilot_alert_firing", labels)

    async def window(mix: Mix) -> None:
        nonlocal batch
        batch += 1
        await run_streams(server.base_url, count=2, requests_each=2, mix=mix, seed=batch * 10)
        await loop.tick()
        seen.append(await counters(server.base_url))

    async def scenario() -> tuple[int, int, int, Any]:
        await loop.start()
        now = service.clock()
        service.store.add_override(
            OverrideRecord("pin", now, now + 3600, Scope(), PIN, "e2e: hold ngram:4")
        )
        await loop.tick()  # the first window starts here, on an idle server
        seen.append(await counters(server.base_url))
        for _ in range(HIGH_BATCHES):
            await window(CODE)
        high_end = len(seen) - 1
        assert service.store.alerts(limit=10) == [], "an alert before any fall"
        for _ in range(MAX_BATCHES):
            await window(SAMPLED_JSON)
            if firing() == 1:
                break
        fired = len(seen) - 1
        assert firing() == 1, ("no AcceptanceDrift after the fall", seen, windows())
        for _ in range(MAX_BATCHES):
            await window(CODE)
            if firing() == 0:
                break
        resolved = len(seen) - 1
        assert firing() == 0, ("AcceptanceDrift never resolved", seen, windows())
        transport = httpx.ASGITransport(app=create_app(settings, service))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            policy = (await api.get("/v1/policy")).json()
        await loop.shutdown()
        return high_end, fired, resolved, policy

    def windows() -> list[tuple[str | None, float | None]]:
        return [(w.arm, w.acceptance_rate) for w in service.store.latest_window_stats()]

    caplog.set_level(logging.INFO, logger="specpilot.actions")
    try:
        high_end, fired, resolved, policy = asyncio.run(scenario())
        alerts = [a for a in service.store.alerts(limit=100) if a.name == "AcceptanceDrift"]
    finally:
        runtime.close()

    [alert] = alerts
    assert alert.resolved_at is not None
    assert alert.context == f"model_name={model},workload_class=code,proposer=ngram"
    high = between(seen[0], seen[high_end])
    low = between(seen[high_end], seen[fired])
    # The figures are vLLM's, over exactly the windows before and after the fall.
    assert high[2] / high[1] > 0.6 and low[2] / low[1] < 0.4, (high, low)
    assert low[0] > 0, "the sampled JSON drafted: this is a fall of acceptance"
    assert f"fell from {stated(high)}" in alert.message, (alert.message, high, low)
    assert f"to {stated(low)}" in alert.message, (alert.message, high, low)
    # Resolved on the newest windows since it fired worth 500 draft tokens, all back up.
    start = resolved
    while seen[resolved][1] - seen[start][1] < RECENT_DRAFT_TOKENS:
        start -= 1
    assert start >= fired, (start, fired)
    back = between(seen[start], seen[resolved])
    lines = [r.getMessage() for r in caplog.records]
    [line] = [text for text in lines if "AcceptanceDrift resolved" in text]
    assert f"is back at {stated(back)}" in line, (line, back)
    midpoint = float(re.search(r"at or above (\d\.\d\d)", line).group(1))  # type: ignore[union-attr]
    assert back[2] / back[1] >= midpoint
    # /v1/policy's acceptance for the running arm: vLLM's over the same windows.
    [context] = [c for c in policy["contexts"] if c["bucket"] == "1"]
    estimate = context["estimate"]
    assert estimate["arm"] == "ngram:4"
    assert estimate["acceptance"] == pytest.approx(back[2] / back[1], rel=1e-9)
    assert estimate["acceptance_evidence"]["draft_tokens"] == back[1]
    assert estimate["drafted_nothing"] is False
    gauge = registry.get_sample_value("specpilot_acceptance_ratio", proposer)
    assert gauge == pytest.approx(back[2] / back[1], rel=1e-9)
