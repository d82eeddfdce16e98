"""The REST API end to end: real uvicorn on a loopback port, real SQLite and PostgreSQL.

The policy and collector behind it are the fakes of ``fakes.py`` (to isolate the
service from the real policy engine and collectors, built elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.observations import SpecDecodeRequestStats
from controller.api import create_app
from controller.contexts import Context
from controller.ports import Collected
from controller.service import Service, build_service
from controller.settings import Settings
from controller.store.records import AlertRecord, DecisionRecord, ObservationRecord
from tests.controller.conftest import LiveServer, PgDatabase, make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy, observation
from tests.controller.test_settings_modes import routing

RW, RO = "rw-secret", "ro-secret"
WRITE = {"Authorization": f"Bearer {RW}"}
READ_ONLY = {"Authorization": f"Bearer {RO}"}
NGRAM3 = {
    "scope": {"model": "*", "class": "code", "bucket": "*"},
    "config": {"method": "ngram", "num_speculative_tokens": 3},
    "ttl_s": 600,
    "reason": "incident 42",
}


class Api:
    def __init__(self, service: Service, client: httpx.Client) -> None:
        self.service, self.client = service, client

    def until(self, probe: Callable[[], Any], timeout_s: float = 20.0) -> Any:
        """Poll until ``probe()`` is truthy (the loop runs on its own interval)."""
        deadline = time.monotonic() + timeout_s
        while not (value := probe()):
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.05)
        return value


@contextlib.contextmanager
def serve(tmp_path: Path, store_url: str | None, api: dict[str, Any]) -> Iterator[Api]:
    settings = make_settings(tmp_path, store_url, api=api)
    policy = ScriptedPolicy(settings.buckets)
    service = build_service(settings, policy, QueueSource())
    try:
        with (
            LiveServer(create_app(settings, service)) as server,
            httpx.Client(base_url=server.url, timeout=10) as client,
        ):
            yield Api(service, client)
    finally:
        service.close()


@pytest.fixture
def api(tmp_path: Path, store_url: str) -> Iterator[Api]:
    with serve(tmp_path, store_url, {"token": RW, "read_only_tokens": [RO]}) as running:
        yield running


def test_health_and_readiness(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok", "checks": {}}
    ready = api.until(lambda: (r := api.client.get("/readyz")).status_code == 200 and r)
    assert ready.json()["checks"] == {"store": "ok", "loop": "ok", "role": "leader"}


def test_writes_need_the_read_write_token(api: Api) -> None:
    no_token = api.client.post("/v1/overrides", json=NGRAM3)
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"
    assert api.client.post("/v1/overrides", json=NGRAM3, headers=READ_ONLY).status_code == 403
    wrong = {"Authorization": "Bearer nope"}
    assert api.client.post("/v1/policy/freeze", headers=wrong).status_code == 401
    assert api.client.post("/v1/policy/freeze", headers=READ_ONLY).status_code == 403
    assert api.client.delete("/v1/overrides/x", headers=READ_ONLY).status_code == 403
    assert api.client.get("/v1/overrides").json() == {"overrides": []}  # nothing got through
    assert api.client.post("/v1/overrides", json=NGRAM3, headers=WRITE).status_code == 201


def test_no_token_configured_refuses_every_write(tmp_path: Path) -> None:
    with serve(tmp_path, None, {}) as api:
        for headers in ({}, WRITE):
            response = api.client.post("/v1/overrides", json=NGRAM3, headers=headers)
            assert response.status_code in (401, 403)
        response = api.client.post("/v1/policy/freeze", headers=WRITE)
        assert response.status_code == 403 and "no read-write token" in response.json()["detail"]
        assert api.client.get("/v1/policy").json()["frozen"] is False


UNRUNNABLE: list[tuple[dict[str, Any], str]] = [
    ({"config": {"method": "magic", "num_speculative_tokens": 3}}, "unknown method 'magic'"),
    ({"config": {"method": "ngram", "num_speculative_tokens": 9}}, "out of range on pool 'p'"),
    ({"config": {"method": "ngram", "num_speculative_tokens": 0}}, ">= 1"),
    (
        {"config": {"method": "draft_model", "model": "/other", "num_speculative_tokens": 2}},
        "no draft model '/other'",
    ),
    (
        {"config": {"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}},
        "no 'eagle3' proposer",
    ),
    ({"scope": {"class": "poetry"}}, "scope.class: unknown class 'poetry'"),
    ({"scope": {"bucket": "2-3"}}, "scope.bucket: unknown bucket '2-3'"),
]


def test_overrides_the_fleet_cannot_run_are_422_with_the_reason(api: Api) -> None:
    for change, reason in UNRUNNABLE:
        response = api.client.post("/v1/overrides", json={**NGRAM3, **change}, headers=WRITE)
        assert response.status_code == 422, change
        assert reason in response.json()["detail"]
    assert api.client.get("/v1/overrides").json() == {"overrides": []}


def test_malformed_override_bodies_are_422(api: Api) -> None:
    for body in (
        {**NGRAM3, "ttl_s": 0},
        {**NGRAM3, "ttl_s": "soon"},
        {**NGRAM3, "reason": ""},
        {k: v for k, v in NGRAM3.items() if k != "config"},
        {**NGRAM3, "extra": 1},
    ):
        assert api.client.post("/v1/overrides", json=body, headers=WRITE).status_code == 422


def test_override_lifecycle(api: Api) -> None:
    created = api.client.post("/v1/overrides", json=NGRAM3, headers=WRITE)
    assert created.status_code == 201
    body = created.json()
    assert body["arm"] == "ngram:3" and body["scope"] == NGRAM3["scope"]
    assert body["expires_at"] - body["created_at"] == pytest.approx(600)
    listed = api.client.get("/v1/overrides").json()["overrides"]
    assert [o["id"] for o in listed] == [body["id"]]

    def operator_decisions() -> list[dict[str, Any]]:
        page = api.client.get("/v1/decisions", params={"class": "code"}).json()
        return [d for d in page["decisions"] if d["actor"] == "operator"]

    decided = api.until(lambda: len(operator_decisions()) == 2 and operator_decisions())
    assert {d["bucket"] for d in decided} == {"1-3", "4+"}
    assert all(
        d["arm"] == "ngram:3" and d["reason"] == "override" and "incident 42" in d["detail"]
        for d in decided
    )
    policy = api.client.get("/v1/policy").json()
    code = [c for c in policy["contexts"] if c["class"] == "code"]
    assert all(c["decided_arm"] == "ngram:3" and c["override_id"] == body["id"] for c in code)
    # Nothing runs it: the pool's instance never answers, so what runs is what ran.
    assert all(c["arm"] == "off" for c in code)
    fleet = api.client.get("/v1/fleet").json()
    pool = fleet["pools"][0]
    assert pool["effective_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert (pool["pushed_arm"], pool["push_state"], pool["running_arm"]) == (
        "ngram:3",
        "pending",
        "off",
    )
    assert pool["summary"] == "pushed ngram:3, running off (pending)"

    assert api.client.delete(f"/v1/overrides/{body['id']}", headers=WRITE).status_code == 204
    assert api.client.delete(f"/v1/overrides/{body['id']}", headers=WRITE).status_code == 404
    assert api.client.get("/v1/overrides").json() == {"overrides": []}


def test_off_override_and_expiry(api: Api) -> None:
    off = {**NGRAM3, "config": {"method": "off"}, "ttl_s": 0.5}
    created = api.client.post("/v1/overrides", json=off, headers=WRITE).json()
    assert created["arm"] == "off"
    api.until(lambda: api.client.get("/v1/overrides").json() == {"overrides": []}, 10)


def test_freeze_and_unfreeze(api: Api) -> None:
    assert api.client.post("/v1/policy/freeze", headers=WRITE).json() == {"frozen": True}
    assert api.client.get("/v1/policy").json()["frozen"] is True
    assert api.service.store.get_state("frozen") is True  # survives a restart
    assert api.client.post("/v1/policy/unfreeze", headers=WRITE).json() == {"frozen": False}
    assert api.client.get("/v1/fleet").json()["frozen"] is False


def test_decisions_paginated_newest_first(api: Api) -> None:
    store = api.service.store
    for i in range(5):
        store.record_decision(
            DecisionRecord(
                float(i),
                Context("m", "chat", "4+"),
                f"ngram:{i % 4 + 1}",
                None,
                f"step {i}",
                "policy",
            )
        )
    first = api.client.get("/v1/decisions", params={"limit": 2, "class": "chat"}).json()
    assert [d["reason"] for d in first["decisions"]] == ["step 4", "step 3"]
    second = api.client.get(
        "/v1/decisions", params={"limit": 2, "class": "chat", "before": first["next_before"]}
    ).json()
    assert [d["reason"] for d in second["decisions"]] == ["step 2", "step 1"]
    assert api.client.get("/v1/decisions", params={"limit": 0}).status_code == 422


def test_alerts_newest_first_and_unresolved_only(api: Api) -> None:
    store = api.service.store
    store.record_alert(AlertRecord(1.0, "AcceptanceDrift", "warning", "code × eagle3 0.8→0.4"))
    store.record_alert(
        AlertRecord(2.0, "ActuatorFailed", "critical", "rolled back", "pool a", resolved_at=3.0)
    )
    body = api.client.get("/v1/alerts").json()
    assert [a["name"] for a in body["alerts"]] == ["ActuatorFailed", "AcceptanceDrift"]
    assert body["alerts"][0]["context"] == "pool a" and body["alerts"][0]["resolved_at"] == 3.0
    open_only = api.client.get("/v1/alerts", params={"unresolved": "true"}).json()
    assert [a["message"] for a in open_only["alerts"]] == ["code × eagle3 0.8→0.4"]
    assert api.client.get("/v1/alerts", params={"limit": 0}).status_code == 422


def test_stats_filtered_by_class_and_window(api: Api) -> None:
    now = time.time()
    store = api.service.store
    store.add_observations(
        [
            ObservationRecord(
                now - 10, Context("m", "code", "1-3"), "ngram:3", "p", 100, 0.01, 0.1, 0.8, 3.4
            ),
            ObservationRecord(now - 10, Context("m", "chat", "1-3"), "off", "p", 50, 0.02),
            ObservationRecord(now - 7200, Context("m", "code", "1-3"), "off", "p", 50, 0.02),
        ]
    )
    rows = api.client.get("/v1/stats", params={"class": "code", "window_s": 60}).json()["rows"]
    assert len(rows) == 1
    assert rows[0]["acceptance_rate"] == 0.8 and rows[0]["emitted_tokens_per_verify"] == 3.4
    everything = api.client.get("/v1/stats", params={"window_s": 86400}).json()["rows"]
    assert len(everything) == 3


def test_metrics_are_specpilot_own_in_base_units(api: Api) -> None:
    api.until(lambda: api.client.get("/readyz").status_code == 200)
    api.client.get("/v1/policy")
    text = api.client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families and all(name.startswith("specpilot_") for name in families)
    assert families["specpilot_leader"].samples[0].value == 1
    requests = [
        s
        for s in families["specpilot_api_requests"].samples
        if s.name.endswith("_total") and s.labels["route"] == "/v1/policy"
    ]
    assert requests and requests[0].labels["status"] == "200"
    assert "specpilot_loop_iteration_duration_seconds" in families


ASSET_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_load_nothing_from_another_host(api: Api, page: str) -> None:
    """Clusters often have no internet: every script, style sheet and icon the docs
    pages reference is served by specpilot itself, with its content type."""
    html = api.client.get(page).text
    referenced = re.findall(r'(?:src|href)\s*[=:]\s*["\']([^"\']+)["\']', html)
    referenced += re.findall(r"url\s*:\s*[\"']([^\"']+)[\"']", html)
    assets = [url for url in referenced if url.rsplit(".", 1)[-1] in ("js", "css", "png")]
    assert assets, html
    external = [url for url in referenced if re.match(r"(?:https?:)?//", url)]
    assert external == []
    for url in assets:
        response = api.client.get(url)
        assert response.status_code == 200, url
        kind = ASSET_TYPES["." + url.rsplit(".", 1)[-1]]
        assert kind in response.headers["content-type"], (url, response.headers)
        assert len(response.content) > 1000, url


def test_openapi_is_published_with_the_v1_paths(api: Api) -> None:
    paths = api.client.get("/openapi.json").json()["paths"]
    assert {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/fleet",
        "/v1/policy",
        "/v1/stats",
        "/v1/overrides",
        "/v1/overrides/{override_id}",
        "/v1/policy/freeze",
        "/v1/policy/unfreeze",
        "/v1/decisions",
    } <= set(paths)


def test_store_outage_is_503_for_writes_and_not_ready(tmp_path: Path, pg: PgDatabase) -> None:
    with serve(tmp_path, pg.url, {"token": RW}) as api:
        api.until(lambda: api.client.get("/readyz").status_code == 200)
        pg.refuse_logins()
        try:
            response = api.client.post("/v1/overrides", json=NGRAM3, headers=WRITE)
            assert response.status_code == 503
            assert "store is unreachable" in response.json()["detail"]
            ready = api.client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["store"].startswith(
                "unreachable"
            )
            assert api.client.get("/v1/policy").status_code == 200  # served from memory
            assert api.client.get("/healthz").status_code == 200
        finally:
            pg.allow_logins()
        api.until(lambda: api.client.get("/readyz").status_code == 200)
        assert api.client.post("/v1/overrides", json=NGRAM3, headers=WRITE).status_code == 201


def test_fleet_shows_instance_urls_without_their_credentials(tmp_path: Path) -> None:
    base = make_settings(tmp_path)
    pool = base.fleet.pools["p"].model_copy(update={"instances": ["http://ops:s3cret@127.0.0.1:9"]})
    settings = base.model_copy(
        update={"fleet": base.fleet.model_copy(update={"pools": {"p": pool}})}
    )
    service = build_service(settings, ScriptedPolicy(settings.buckets), QueueSource())
    try:
        with (
            LiveServer(create_app(settings, service, run_loop=False)) as server,
            httpx.Client(base_url=server.url, timeout=10) as client,
        ):
            response = client.get("/v1/fleet")
    finally:
        service.close()
    assert response.status_code == 200
    [instance] = response.json()["pools"][0]["instances"]
    assert instance["url"] == "http://ops:***@127.0.0.1:9"
    assert "s3cret" not in response.text


def test_fleet_shows_per_instance_what_the_gateway_measured_in_routing_mode(
    tmp_path: Path,
) -> None:
    """Routing mode scrapes nothing: each instance shows the requests the gateway
    relayed to it (as the loop took them in), not "not scraped yet" for ever."""
    settings = Settings(
        data_dir=tmp_path / "data", classes=["code", "chat"], buckets=[1, 4], **routing()
    )
    source = QueueSource()
    service = build_service(settings, ScriptedPolicy(settings.buckets), source)
    now = time.time()
    relayed = [
        replace(
            observation("ngram:4", 0.01, finished_at=now - 2 + i),
            pool="fast",
            instance="http://127.0.0.1:9002",
            routed_arm="ngram:4",
            e2e_s=1.5,
            spec=SpecDecodeRequestStats(40, 160, 120 + i),
        )
        for i in range(3)
    ]
    source.batches.append(Collected(tuple(relayed)))
    try:
        asyncio.run(service.loop.start())
        asyncio.run(service.loop.tick())
        with (
            LiveServer(create_app(settings, service, run_loop=False)) as server,
            httpx.Client(base_url=server.url, timeout=10) as client,
        ):
            fleet = client.get("/v1/fleet").json()
    finally:
        service.close()
    instances = {p["name"]: p["instances"][0] for p in fleet["pools"]}
    fast, plain = instances["fast"], instances["plain"]
    measured = fast["gateway"]
    assert (measured["requests"], measured["arm"], measured["output_tokens"]) == (3, "ngram:4", 303)
    assert measured["acceptance_rate"] == pytest.approx(363 / 480)
    assert measured["mean_acceptance_length"] == pytest.approx(1 + 363 / 120)
    assert measured["mean_tpot_s"] == pytest.approx(0.01)
    assert measured["mean_e2e_s"] == pytest.approx(1.5)
    assert measured["window_s"] == 60.0
    assert fast["status"] == plain["status"] == "not scraped (collect: gateway)"
    assert plain["gateway"] is None
