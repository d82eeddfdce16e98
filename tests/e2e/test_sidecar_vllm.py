"""Push mode beside a real vLLM whose clients go straight to it: specpilot learns from
the worker's own ``/metrics`` only (``collect: scrape``) and changes nothing without
evidence.

The loop is ticked by the test (``ControlLoop.tick``), so that each window's ends are
known: vLLM's own counters read right before and after the traffic bound exactly the
window specpilot scraped.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from bench.sidecar import sidecar_settings as managed_settings
from collectors.exposition import parse_exposition
from controller.api import create_app
from controller.runtime import Runtime, assemble
from controller.settings import Settings
from testbed.server import SERVED_MODEL
from testbed.traffic import run_streams
from tests.conftest import VllmServers
from tests.helpers.prometheus import running_prometheus

pytestmark = pytest.mark.vllm

TUNING = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4, **TUNING}


def sidecar_settings(url: str, data_dir: Path) -> Settings:
    """The README's first ``serve``: one pool, push mode, the file actuator, scraping."""
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": ["code"],
            "scrape_interval_s": 1.0,
            "collect": "scrape",
            "policy": {"min_dwell_s": 0.0},
            "api": {"port": 0},
            "fleet": {
                "pools": {
                    "code": {
                        "model": SERVED_MODEL,
                        "instances": [url],
                        "speculative_config": NGRAM4,
                        "proposers": {
                            "ngram": {"method": "ngram", "gamma": [1, 4], "tuning": TUNING}
                        },
                    }
                }
            },
        }
    )


async def counters(url: str) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) straight from vLLM's page."""
    async with httpx.AsyncClient() as client:
        page = (await client.get(f"{url}/metrics")).text
    snapshot = parse_exposition(page)
    spec = [e.spec for e in snapshot.engines.values() if e.spec is not None]
    assert spec, "vLLM serves no spec-decode series"
    return (
        sum(s.drafts for s in spec),
        sum(s.draft_tokens for s in spec),
        sum(s.accepted_tokens for s in spec),
    )


def pushed(runtime: Runtime) -> Any:
    path = runtime.service.settings.actuator_dir / "code.json"
    return json.loads(path.read_text()) if path.exists() else "nothing pushed"


def test_scraped_acceptance_matches_vllm_and_nothing_moves_without_evidence(
    vllm_servers: VllmServers, tmp_path: Path
) -> None:
    server = vllm_servers.get("ngram:4")
    settings = sidecar_settings(server.base_url, tmp_path / "data")
    registry = CollectorRegistry()
    runtime = assemble(settings, registry=registry)
    loop = runtime.service.loop

    async def scenario() -> None:
        await loop.start()
        # Before any traffic: the loop runs, sees the worker, and pushes what it runs.
        for _ in range(3):
            await loop.tick()
        assert pushed(runtime) == NGRAM4, pushed(runtime)
        before = await counters(server.base_url)
        await loop.tick()  # the window now starts at `before`
        await run_streams(server.base_url, count=1, requests_each=24)
        after = await counters(server.base_url)
        await loop.tick()
        drafts, draft_tokens, accepted = (b - a for a, b in zip(before, after, strict=True))
        assert drafts > 0 and draft_tokens > 0
        windows = runtime.service.store.latest_window_stats()
        [window] = [w for w in windows if w.pool == "code"]
        assert window.healthy, window
        assert window.status is None, window
        assert window.arm == "ngram:4"
        # Same window, same counters: equal within one verify step's tokens.
        step = 4 / draft_tokens
        assert window.acceptance_rate == pytest.approx(accepted / draft_tokens, abs=step)
        assert window.mean_acceptance_length == pytest.approx(1 + accepted / drafts, abs=4 / drafts)
        assert window.requests == pytest.approx(24, abs=1)
        app = create_app(settings, runtime.service)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            fleet = (await api.get("/v1/fleet")).json()
            stats = (await api.get("/v1/stats")).json()
        [instance] = fleet["pools"][0]["instances"]
        assert instance["healthy"] is True, instance
        assert instance["acceptance_rate"] == pytest.approx(accepted / draft_tokens, abs=step)
        assert instance["arm"] == "ngram:4"
        assert any(row["arm"] == "ngram:4" and row["requests"] >= 23 for row in stats["rows"]), (
            stats
        )
        observed = registry.get_sample_value("specpilot_observations_total")
        assert observed is not None and observed >= 23
        # The running config stands: every decision so far keeps n-gram.
        for _ in range(3):
            await loop.tick()
        decisions = runtime.service.store.decisions(limit=100).decisions
        assert all(d.arm.startswith("ngram:") for d in decisions), decisions
        assert pushed(runtime)["method"] == "ngram", pushed(runtime)
        await loop.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        runtime.close()


def test_prometheus_source_shows_the_same_acceptance_as_the_scrape(
    vllm_servers: VllmServers, tmp_path: Path
) -> None:
    server = vllm_servers.get("ngram:4")
    target = server.base_url.removeprefix("http://")
    scraping = assemble(sidecar_settings(server.base_url, tmp_path / "scrape"))
    with running_prometheus([target], tmp_path / "prom", scrape_interval_s=0.5) as prometheus:
        base = sidecar_settings(server.base_url, tmp_path / "prom-data")
        reading = assemble(
            Settings.model_validate(
                {
                    **base.model_dump(mode="python", exclude={"collect"}),
                    "scrape_interval_s": 4.0,
                    "collect": {"prometheus": {"url": prometheus.url, "selector": 'job="vllm"'}},
                }
            )
        )

        async def scenario() -> None:
            # Traffic before either window, so each window's start has a sample of
            # Prometheus' to count from exactly (collectors/promql.py).
            await run_streams(server.base_url, count=2, requests_each=24, seed=7)
            for runtime in (scraping, reading):
                await runtime.service.loop.start()
                await runtime.service.loop.tick()
            prometheus.wait_for("count_over_time(vllm:spec_decode_num_drafts_total[1h]) >= 2")
            # Both windows open on an idle worker and close on one, so their ends agree.
            # The Prometheus source skips a round less than half its window (4 s) after
            # the last: sooner, its window would open at the first tick, on a sample
            # Prometheus may have taken before the first traffic's end.
            await asyncio.sleep(2.5)
            for runtime in (scraping, reading):
                await runtime.service.loop.tick()
            await run_streams(server.base_url, count=1, requests_each=16, seed=100)
            await asyncio.sleep(4.0)  # Prometheus scrapes past the traffic
            for runtime in (scraping, reading):
                await runtime.service.loop.tick()

        try:
            asyncio.run(scenario())
            [scraped] = scraping.service.store.latest_window_stats()
            [queried] = reading.service.store.latest_window_stats()
        finally:
            scraping.close()
            reading.close()
    assert scraped.status is None and queried.status is None, (scraped, queried)
    assert scraped.acceptance_rate is not None and queried.acceptance_rate is not None
    # Both count the same events exactly: the scrapes at either end saw an idle worker.
    assert queried.acceptance_rate == pytest.approx(scraped.acceptance_rate, rel=1e-9)
    assert queried.mean_acceptance_length == pytest.approx(scraped.mean_acceptance_length, rel=1e-9)
    assert queried.arm == scraped.arm == "ngram:4"


def runs_off_alone(config: Any) -> bool:
    """No speculation for a batch of one: no config, or γ = 0 there by batch size."""
    if config is None:
        return True
    table = config.get("num_speculative_tokens_per_batch_size") or []
    return any(start <= 1 <= end and gamma == 0 for start, end, gamma in table)


def test_managed_pool_turns_off_when_sampled_traffic_gives_ngram_nothing(tmp_path: Path) -> None:
    """Greedy code first (n-gram accepts most of its drafts), then the same prompts
    sampled: n-gram finds no match, every step emits one token while paying for
    speculation. From the scraped windows alone specpilot raises AcceptanceDrift and
    moves the pool to off; the clients, following the pool's instance, see no failure."""
    settings = managed_settings(tmp_path / "data")  # bench sidecar's own deployment
    runtime = assemble(settings)
    managed = runtime.placements.managed
    assert managed is not None

    def current() -> str:
        urls = managed.urls("code")
        assert urls, "the pool has no instance"
        return str(urls[0])

    async def scenario() -> list[str]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await runtime.start(sock, log_level="warning")
        failures: list[str] = []
        try:
            deadline = time.monotonic() + 900
            while not managed.urls("code"):  # the first push starts the running config
                assert time.monotonic() < deadline, "the managed pool never started"
                await asyncio.sleep(1.0)
            assert managed.config("code") == NGRAM4
            # Long enough for the drift detector's baseline (warm-up and lag: a dozen
            # windows at one per second), however fast the machine serves it.
            for _ in range(15):
                await run_streams(current, count=1, requests_each=6, seed=0)
                await asyncio.sleep(1.0)
            sampled = 0
            deadline = time.monotonic() + 900  # a vLLM start on a loaded 2-core machine
            while not runs_off_alone(managed.config("code")) or sampled < 8:
                assert time.monotonic() < deadline, (
                    "the pool never left n-gram",
                    runtime.service.store.decisions(limit=20).decisions,
                    runtime.service.policy.estimates(next(iter(runtime.service.fleet.contexts))),
                    runtime.service.store.latest_window_stats(),
                )
                try:
                    await run_streams(
                        current, count=1, requests_each=4, seed=sampled, mix=(("code", 0.8),)
                    )
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                sampled += 4
        finally:
            await runtime.stop(grace_s=10.0)
        return failures

    try:
        failures = asyncio.run(scenario())
        alerts = runtime.service.store.alerts(limit=100)
        decisions = runtime.service.store.decisions(limit=100).decisions
    finally:
        runtime.close()
    assert failures == [], failures
    drift = [a for a in alerts if a.name == "AcceptanceDrift"]
    assert drift, alerts
    assert "ngram" in drift[0].message
    moved = [d for d in decisions if d.arm == "off" and d.context.bucket == "1"]
    assert moved and moved[0].previous_arm is not None, decisions
    assert moved[0].previous_arm.startswith("ngram:"), moved
