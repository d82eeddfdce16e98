"""Instance health (``controller.instances``): the up metric, one log line per change,
``SpecpilotInstanceDown`` raised after a bounded time and resolved when the instance
answers, the model check, ``/readyz``.

The instances are an ``httpx.MockTransport`` answering ``GET /v1/models`` per host as
vLLM does (``{"object": "list", "data": [{"id": NAME, ...}]}``) or refusing connections,
so each rule is tested on its own with an injected clock; the store, the loop and the API
are real. ``tests/e2e/test_instances_vllm.py`` runs the same against a real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from collectors.observations import WindowObservation
from controller.actions import ACTIONS
from controller.api import create_app
from controller.instances import (
    INSTANCE_DOWN,
    InstanceHealth,
    Verdict,
    check_instance,
    instance_context,
    served_models,
)
from controller.notify import Notifier, alert_labels
from controller.ports import Collected, InstanceSeen
from controller.service import Service, build_service
from controller.settings import Settings
from controller.sources import Placement
from controller.store.records import AlertRecord, WindowStatRecord
from controller.telemetry import ServiceMetrics
from tests.controller.fakes import QueueSource, ScriptedPolicy

A1, A2, B1 = "http://127.0.0.1:7001", "http://ops:s3cret@127.0.0.1:7002", "http://127.0.0.1:7003"
A2_SHOWN = "http://ops:***@127.0.0.1:7002"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Instances:
    """What each instance (by ``host:port``) does when asked: serve these model names,
    answer with an HTTP status, or refuse the connection (None)."""

    def __init__(self, **serving: Any) -> None:
        self.serving: dict[str, Any] = {}
        self.asked: list[str] = []

    def set(self, url: str, behaviour: Any) -> None:
        self.serving[httpx.URL(url).netloc.decode().rpartition("@")[2]] = behaviour

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(str(request.url))
        behaviour = self.serving.get(request.url.netloc.decode().rpartition("@")[2])
        if behaviour is None:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if isinstance(behaviour, int):
            return httpx.Response(behaviour, text="nope")
        data = [{"id": name, "object": "model", "owned_by": "vllm"} for name in behaviour]
        return httpx.Response(200, json={"object": "list", "data": data})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))


def settings_for(tmp_path: Path, **alerting: Any) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": tmp_path / "data",
            "classes": ["code", "chat"],
            "scrape_interval_s": 10.0,
            "alerting": alerting,
            "fleet": {
                "pools": {
                    "a": {"model": "m", "instances": [A1, A2], "classes": ["code"]},
                    "b": {"model": "m", "instances": [B1], "classes": ["chat"]},
                }
            },
        }
    )


def placements_of(settings: Settings) -> list[Placement]:
    return [
        Placement(name, url, None)
        for name, pool in sorted(settings.fleet.pools.items())
        for url in pool.instances
    ]


@pytest.fixture
def actions_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=ACTIONS.name):
        yield caplog


def lines(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


class Health:
    def __init__(self, tmp_path: Path, placements: list[Placement] | None = None, **alerting: Any):
        self.settings = settings_for(tmp_path, **alerting)
        self.clock = Clock()
        self.fleet = Instances()
        self.registry = CollectorRegistry()
        self.placements = placements if placements is not None else placements_of(self.settings)
        self.health = InstanceHealth(
            self.settings,
            lambda: self.placements,
            ServiceMetrics(self.registry),
            clock=self.clock,
            client=self.fleet.client(),
        )

    def probe(self, after_s: float = 10.0) -> Any:
        self.clock.now += after_s
        return asyncio.run(self.health.probe())

    def up(self, pool: str, url: str) -> float | None:
        return self.registry.get_sample_value("specpilot_instance_up", {"pool": pool, "url": url})


# -- the model check -------------------------------------------------------------------


def test_the_model_list_is_read_as_vllm_writes_it_and_judged_against_the_pool() -> None:
    fleet = Instances()
    fleet.set(A1, ["tiny", "tiny-lora"])
    fleet.set(B1, 404)

    async def judge(url: str, model: str) -> Verdict:
        async with fleet.client() as client:
            return await check_instance(client, url, model, timeout_s=1.0)

    assert asyncio.run(judge(A1, "tiny-lora")) == Verdict(None, None, ("tiny", "tiny-lora"))
    wrong = asyncio.run(judge(A1, "llama"))
    assert (wrong.reason, wrong.detail) == ("wrong_model", "serves tiny, tiny-lora, not llama")
    http = asyncio.run(judge(B1, "tiny"))
    assert (http.reason, http.detail) == ("bad_answer", "GET /v1/models answered HTTP 404")
    refused = asyncio.run(judge(A2, "tiny"))
    assert refused.reason == "unreachable" and "Connection refused" in (refused.detail or "")
    assert served_models({"object": "list", "data": []}) == ()
    for garbage in ([], {"data": [{"name": "x"}]}, {"data": "x"}, "text"):
        with pytest.raises(ValueError):
            served_models(garbage)


def test_a_real_closed_port_is_unreachable_within_the_timeout() -> None:
    async def judge() -> Verdict:
        async with httpx.AsyncClient() as client:
            return await check_instance(client, "http://127.0.0.1:9", "m", timeout_s=2.0)

    verdict = asyncio.run(judge())
    assert verdict.reason == "unreachable" and verdict.detail, verdict


# -- the up metric, the log, the alert ---------------------------------------------------


def test_up_metric_per_instance_with_credentials_redacted(tmp_path: Path) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.fleet.set(B1, ["m"])
    h.probe()
    assert h.up("a", A1) == 1
    assert h.up("a", A2_SHOWN) == 0  # refused
    assert h.up("b", B1) == 1
    assert h.up("a", A2) is None  # the password never is a label
    h.fleet.set(A2, ["m"])
    h.probe()
    assert h.up("a", A2_SHOWN) == 1


def test_a_dead_instance_is_logged_once_with_its_reason_and_once_when_back(
    tmp_path: Path, actions_log: pytest.LogCaptureFixture
) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.fleet.set(B1, ["m"])
    for _ in range(5):
        h.probe()
    [down] = lines(actions_log, "instance_down")
    assert down.levelno == logging.WARNING
    assert down.getMessage().startswith(f"instance_down: pool a: {A2_SHOWN} unreachable: ")
    assert "Connection refused" in down.getMessage() and "s3cret" not in down.getMessage()
    assert down.fields["reason"] == "unreachable"  # type: ignore[attr-defined]
    assert lines(actions_log, "instance_up") == []
    h.fleet.set(A2, ["m"])
    h.probe()
    h.probe()
    [up] = lines(actions_log, "instance_up")
    assert up.getMessage().startswith(f"instance_up: pool a: {A2_SHOWN} answers again after 50 s")
    assert len(lines(actions_log, "instance_down")) == 1
    # Another reason while down is a new line; the same reason again is not.
    h.fleet.set(A2, 500)
    h.probe()
    h.fleet.set(A2, ["other"])
    h.probe()
    h.probe()
    reasons = [r.fields["reason"] for r in lines(actions_log, "instance_down")]  # type: ignore[attr-defined]
    assert reasons == ["unreachable", "bad_answer", "wrong_model"]


def test_the_alert_fires_after_the_bound_once_and_resolves_when_it_answers(
    tmp_path: Path,
) -> None:
    h = Health(tmp_path, instance_down_after_s=25.0)
    h.fleet.set(A1, ["m"])
    h.fleet.set(B1, ["m"])
    assert h.probe(0.0).raised == []  # down since now
    assert h.probe(10.0).raised == []  # 10 s
    assert h.probe(10.0).raised == []  # 20 s
    [alert] = h.probe(10.0).raised  # 30 s >= 25 s
    assert alert.name == INSTANCE_DOWN == "SpecpilotInstanceDown"
    assert alert.severity == "warning"
    assert alert.context == f"pool=a,url={A2_SHOWN}"
    assert alert.message.startswith(f"pool a: {A2_SHOWN} unreachable: ")
    assert alert.message.endswith("(down for 30 s)")
    assert "s3cret" not in alert.message
    on = h.probe()
    assert (on.raised, on.resolved) == ([], [])  # fires on, not raised again
    [still] = on.firing  # for the notifier, which lets an alert not raised again lapse
    assert (still.context, still.ts) == (alert.context, h.clock.now)
    h.fleet.set(A2, ["m"])
    changed = h.probe()
    assert (changed.raised, changed.resolved, changed.firing) == ([], [alert.context], [])
    assert h.probe().resolved == []


def test_the_bound_defaults_to_three_loop_intervals(tmp_path: Path) -> None:
    h = Health(tmp_path)
    assert h.health.down_after_s == 30.0
    h.probe(0.0)
    assert h.probe(29.0).raised == []
    assert {a.context for a in h.probe(1.0).raised} == {
        instance_context("a", A1),
        instance_context("a", A2),
        instance_context("b", B1),
    }


def test_a_blip_shorter_than_the_bound_raises_nothing(
    tmp_path: Path, actions_log: pytest.LogCaptureFixture
) -> None:
    h = Health(tmp_path)
    for url in (A1, A2, B1):
        h.fleet.set(url, ["m"])
    h.probe()
    h.fleet.set(B1, None)
    assert h.probe().raised == []
    h.fleet.set(B1, ["m"])
    changed = h.probe(100.0)
    assert (changed.raised, changed.resolved) == ([], [])
    assert len(lines(actions_log, "instance_down")) == len(lines(actions_log, "instance_up")) == 1


def test_an_instance_that_leaves_the_fleet_loses_its_series_and_its_alert(tmp_path: Path) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.fleet.set(B1, ["m"])
    h.probe(0.0)
    [alert] = h.probe(30.0).raised
    h.placements = [p for p in h.placements if p.url != A2]
    assert h.probe().resolved == [alert.context]
    assert h.up("a", A2_SHOWN) is None


def test_alerts_firing_before_a_restart_fire_on_and_resolve(tmp_path: Path) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.fleet.set(B1, ["m"])
    before = [
        AlertRecord(1.0, INSTANCE_DOWN, "warning", "down", instance_context("a", A2)),
        AlertRecord(1.0, INSTANCE_DOWN, "warning", "down", "pool=gone,url=http://10.0.0.9:8000"),
        AlertRecord(1.0, "ActuatorFailed", "critical", "x", None),
    ]
    h.health.restore(before)
    first = h.probe(0.0)
    # the dead one is not raised twice; the one no longer in the fleet resolves
    assert first.resolved == ["pool=gone,url=http://10.0.0.9:8000"]
    assert h.probe(60.0).raised == []
    h.fleet.set(A2, ["m"])
    assert h.probe().resolved == [instance_context("a", A2)]


def test_a_pod_resolves_only_its_own_restored_alerts(tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {
            "data_dir": tmp_path,
            "classes": ["code"],
            "collect": "scrape",
            "actuators": {
                "file": False,
                "managed": {
                    "mode": "in_place",
                    "pod": {"replica": "pod-a"},
                    "pools": {"a": {"command": ["vllm", "serve", "/m"], "port": 8000}},
                },
            },
            "fleet": {"pools": {"a": {"model": "m"}}},
        }
    )
    health = InstanceHealth(settings, lambda: [], ServiceMetrics(CollectorRegistry()))
    mine, theirs = (
        "pool=a,url=http://127.0.0.1:8000#pod-a",
        "pool=a,url=http://127.0.0.1:8000#pod-b",
    )
    health.restore([AlertRecord(1.0, INSTANCE_DOWN, "warning", "x", c) for c in (mine, theirs)])
    # This pod's vLLM is not running (yet): its own alert resolves, the other pod's stays.
    assert asyncio.run(health.probe()).resolved == [mine]
    assert health.pools_down() == {}  # between starts, /readyz's checks.vllm says so


def test_a_pool_with_no_instance_at_all_has_no_healthy_one(tmp_path: Path) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.placements = [p for p in h.placements if p.pool == "a"]  # b's managed start failed
    assert h.health.pools_down() == {}  # not probed yet: nothing known
    h.probe()
    assert h.health.pools_down() == {"b": "no instance running"}


def test_alertmanager_tells_two_instances_of_a_pool_apart() -> None:
    labels = alert_labels(
        AlertRecord(1.0, INSTANCE_DOWN, "warning", "m", instance_context("a", A2))
    )
    assert labels == {
        "alertname": INSTANCE_DOWN,
        "severity": "warning",
        "pool": "a",
        "url": A2_SHOWN,
    }


# -- the model check's consequences ------------------------------------------------------


def test_a_wrong_model_instance_is_down_and_its_windows_teach_nothing(
    tmp_path: Path, actions_log: pytest.LogCaptureFixture
) -> None:
    h = Health(tmp_path)
    h.fleet.set(A1, ["m"])
    h.fleet.set(A2, ["llama-3"])
    h.fleet.set(B1, ["m"])
    h.probe()
    assert h.up("a", A2_SHOWN) == 0
    [down] = lines(actions_log, "instance_down")
    assert down.getMessage().startswith(f"instance_down: pool a: {A2_SHOWN} serves llama-3, not m")
    assert down.fields["served"] == "llama-3"  # type: ignore[attr-defined]

    def stat(url: str) -> WindowStatRecord:
        return WindowStatRecord(ts=1.0, pool="a", instance=url, model="m", window_s=10.0)

    def evidence(url: str) -> WindowObservation:
        return WindowObservation(
            "m",
            0.0,
            10.0,
            10.0,
            5,
            100,
            20,
            80,
            (15.0,),
            0.01,
            0.01,
            1.0,
            "code",
            "a",
            url,
            "ngram:4",
        )

    def shape(url: str) -> InstanceSeen:
        return InstanceSeen("a", url, positions=4, restarted=False, at=1.0)

    screened = h.health.screen(
        Collected(
            windows=[stat(A1), stat(A2)],
            window_observations=[evidence(A1), evidence(A2)],
            instances=[shape(A1), shape(A2)],
        )
    )
    assert [w.instance for w in screened.window_observations] == [A1]
    assert screened.instances == (shape(A1),)  # confirms no push either
    right, wrong = screened.windows
    assert right == stat(A1)
    assert (wrong.healthy, wrong.status) == (False, "serves llama-3, not m")


def test_a_managed_pool_is_checked_against_its_served_model(tmp_path: Path) -> None:
    from controller.instances import expected_model

    settings = Settings.model_validate(
        {
            "data_dir": tmp_path,
            "classes": ["code"],
            "actuators": {
                "file": False,
                "managed": {
                    "pools": {"p": {"command": ["vllm", "serve", "/m"], "served_model": "tiny"}}
                },
            },
            "fleet": {"pools": {"p": {"model": "m"}, "q": {"model": "n", "instances": [A1]}}},
        }
    )
    assert expected_model(settings, "p") == "tiny"
    assert expected_model(settings, "q") == "n"


# -- in the loop and the API -------------------------------------------------------------


class Served:
    """A service as ``assemble`` wires it (probing its instances), on a test clock."""

    def __init__(self, tmp_path: Path, *, pod: bool = False, **alerting: Any) -> None:
        self.clock = Clock()
        self.fleet = Instances()
        settings = settings_for(tmp_path, instance_down_after_s=15.0, **alerting)
        self.service: Service = build_service(
            settings,
            ScriptedPolicy(settings.buckets),
            QueueSource(),
            actuators=[],
            clock=self.clock,
        )
        self.service.instances = self.service.loop.instances = InstanceHealth(
            settings,
            self.service.placements,
            self.service.metrics,
            clock=self.clock,
            client=self.fleet.client(),
        )
        if pod:  # per-pod topology: this pod's vLLM is between restarts
            self.service.pod = SimpleNamespace(readiness=lambda: "ok")  # type: ignore[assignment]
        self.loop = self.service.loop
        asyncio.run(self.loop.start())

    def tick(self, after_s: float = 10.0) -> None:
        self.clock.now += after_s
        asyncio.run(self.loop.tick())

    def get(self, path: str) -> httpx.Response:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=create_app(self.service.settings, self.service))
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return await client.get(path)

        return asyncio.run(call())

    def close(self) -> None:
        asyncio.run(self.loop.shutdown())
        self.service.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    running = Served(tmp_path)
    try:
        yield running
    finally:
        running.close()


def test_the_loop_stores_counts_and_resolves_the_alert(served: Served) -> None:
    served.fleet.set(A1, ["m"])
    served.fleet.set(A2, ["m"])
    served.tick()  # b's only instance refuses: down since now
    assert served.get("/v1/alerts").json()["alerts"] == []
    served.tick()
    served.tick()  # 20 s >= 15 s
    [alert] = served.get("/v1/alerts").json()["alerts"]
    assert (alert["name"], alert["context"], alert["resolved_at"]) == (
        INSTANCE_DOWN,
        f"pool=b,url={B1}",
        None,
    )
    registry = served.service.registry
    assert registry.get_sample_value("specpilot_alerts_total", {"alert": INSTANCE_DOWN}) == 1
    served.tick()
    assert registry.get_sample_value("specpilot_alerts_total", {"alert": INSTANCE_DOWN}) == 1
    served.fleet.set(B1, ["m"])
    served.tick()
    [alert] = served.get("/v1/alerts").json()["alerts"]
    assert alert["resolved_at"] == served.clock.now
    assert served.get("/v1/alerts?unresolved=true").json()["alerts"] == []


def test_readyz_is_degraded_but_200_while_another_pool_serves(served: Served) -> None:
    served.fleet.set(A1, ["m"])
    served.tick()
    response = served.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "degraded"
    assert body["checks"]["instances"].startswith(
        f"pool b: no healthy instance ({B1} unreachable: "
    )
    assert "pool a" not in body["checks"]["instances"]  # one of a's two answers
    served.fleet.set(B1, ["m"])
    served.tick()
    body = served.get("/readyz").json()
    assert (body["status"], body["checks"]["instances"]) == ("ready", "ok")


def test_readyz_before_the_first_probe_says_so(served: Served) -> None:
    assert served.get("/readyz").json()["checks"]["instances"] == "not probed yet"


def test_a_pod_whose_vllm_is_down_is_not_ready(tmp_path: Path) -> None:
    served = Served(tmp_path, pod=True)
    try:
        served.fleet.set(A1, ["m"])
        served.tick()
        response = served.get("/readyz")
        assert response.status_code == 503
        assert response.json()["status"] == "not ready"
        assert response.json()["checks"]["instances"].startswith("pool b: no healthy instance")
        served.fleet.set(B1, ["m"])
        served.tick()
        assert served.get("/readyz").status_code == 200
    finally:
        served.close()


def test_a_restart_keeps_the_alert_firing_without_raising_it_again(tmp_path: Path) -> None:
    first = Served(tmp_path)
    first.fleet.set(A1, ["m"])
    first.fleet.set(A2, ["m"])
    for _ in range(3):
        first.tick()
    first.close()
    second = Served(tmp_path)
    try:
        second.fleet.set(A1, ["m"])
        second.fleet.set(A2, ["m"])
        for _ in range(4):
            second.tick()
        alerts = second.get("/v1/alerts").json()["alerts"]
        assert [(a["name"], a["resolved_at"]) for a in alerts] == [(INSTANCE_DOWN, None)]
        second.fleet.set(B1, ["m"])
        second.tick()
        [alert] = second.get("/v1/alerts").json()["alerts"]
        assert alert["resolved_at"] is not None
    finally:
        second.close()


class NeverLeads:
    def check(self) -> bool:
        return False

    def release(self) -> None:
        pass


def test_a_follower_beside_the_leader_leaves_probing_to_it(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    fleet = Instances()
    service = build_service(
        settings,
        ScriptedPolicy(settings.buckets),
        QueueSource(),
        actuators=[],
        leadership=NeverLeads(),  # type: ignore[arg-type]
    )
    service.instances = service.loop.instances = InstanceHealth(
        settings, service.placements, service.metrics, client=fleet.client()
    )

    async def scenario() -> httpx.Response:
        await service.loop.start()
        await service.loop.tick()
        transport = httpx.ASGITransport(app=create_app(settings, service))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            response = await client.get("/readyz")
        await service.loop.shutdown()
        return response

    try:
        response = asyncio.run(scenario())
    finally:
        service.close()
    assert fleet.asked == []
    assert response.status_code == 200
    assert response.json()["checks"]["instances"] == "not probed here: the leader probes the fleet"


def test_alertmanager_keeps_hearing_of_an_instance_still_down(tmp_path: Path) -> None:
    """The notifier resolves an alert not raised again for ``resolve_after_s``: each
    iteration an instance stays down, the loop hands its alert over again."""
    served = Served(tmp_path, webhook_url="http://hooks.test/alerts", resolve_after_s=30.0)
    posted: list[Any] = []

    def hook(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content)["status"])
        return httpx.Response(200)

    served.loop.notifier = Notifier(  # the loop's, on the test's clock and a recording hook
        served.service.settings.alerting,
        clock=served.clock,
        transport=httpx.MockTransport(hook),
    )
    try:
        served.fleet.set(A1, ["m"])
        served.fleet.set(A2, ["m"])
        for _ in range(3):
            served.tick()
        [heard] = served.loop.notifier.firing.values()
        assert heard.labels["url"] == B1 and heard.last_seen == served.clock.now
        for _ in range(6):  # 60 s, twice resolve_after_s
            served.tick()
        [heard] = served.loop.notifier.firing.values()
        assert heard.last_seen == served.clock.now
        served.fleet.set(B1, ["m"])
        served.tick()
        assert served.loop.notifier.firing == {}
    finally:
        served.close()
    assert posted == ["firing", "resolved"]
