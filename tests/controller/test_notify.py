"""specpilot's alerts reach people: a real Alertmanager (the Debian package's, started on
loopback by the test) receives them, groups them by its route and resolves them; the
generic webhook gets one POST when an alert fires and one when it resolves. The loop
hands its alerts over without waiting for any of it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry

from controller.fleet import PoolConfig
from controller.notify import MAX_QUEUED, Notifier, alert_labels, context_labels
from controller.service import build_service
from controller.settings import AlertingSettings, Settings
from controller.store.records import AlertRecord
from controller.telemetry import ServiceMetrics
from tests.controller.conftest import make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy
from tests.helpers.alertmanager import AlertmanagerServer, running_alertmanager

T = TypeVar("T")


class Receiver:
    """An HTTP endpoint on loopback that keeps every JSON body POSTed to it; answers
    ``statuses`` in turn (then 200), or never answers while ``hang`` is set."""

    def __init__(self, statuses: Sequence[int] = ()) -> None:
        self.bodies: list[tuple[str, Any]] = []
        self.statuses = list(statuses)
        self.hang = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length))
                if receiver.hang.is_set():
                    while receiver.hang.is_set():  # no answer until the test ends
                        time.sleep(0.05)
                    return
                receiver.bodies.append((self.path, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def at(self, path: str) -> list[Any]:
        return [body for p, body in list(self.bodies) if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


ROUTE = """
route:
  receiver: hook
  group_by: [alertname, model_name]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {url}/from-alertmanager
        send_resolved: true
"""


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: Receiver) -> Iterator[AlertmanagerServer]:
    with running_alertmanager(tmp_path / "am", ROUTE.format(url=receiver.url)) as server:
        yield server


async def eventually(probe: Callable[[], T | None], what: str, budget_s: float = 60.0) -> T:
    """Poll ``probe`` (in a thread: it may do blocking HTTP) until it returns a value.
    The budget only guards against a hang; nothing here asserts a speed."""
    deadline = time.monotonic() + budget_s
    while True:
        found = await asyncio.to_thread(probe)
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_labels_route_by_context() -> None:
    assert context_labels("meta-llama/Llama-3.1-8B/code/2-3") == {
        "model_name": "meta-llama/Llama-3.1-8B",
        "workload_class": "code",
        "bucket": "2-3",
    }
    assert context_labels("pool=fast, proposer=ngram, other=x, model_name=") == {
        "pool": "fast",
        "proposer": "ngram",
    }
    assert context_labels("just words") == {}
    record = AlertRecord(1.0, "ActuatorFailed", "critical", "m", context="pool=fast")
    labels = alert_labels(record, {"cluster": "eu-1", "alertname": "not this"})
    assert labels == {
        "cluster": "eu-1",
        "pool": "fast",
        "alertname": "ActuatorFailed",
        "severity": "critical",
    }


@pytest.mark.alertmanager
def test_alerts_reach_alertmanager_group_there_and_resolve(
    alertmanager: AlertmanagerServer, receiver: Receiver
) -> None:
    settings = AlertingSettings(
        alertmanager_url=alertmanager.url, labels={"cluster": "eu-1"}, resend_interval_s=0.5
    )
    notifier = Notifier(settings)
    now = time.time()
    drift = [
        AlertRecord(now, "SpeculationDrift", "warning", f"{cls} fell", context=f"m/{cls}/1")
        for cls in ("code", "chat")
    ]
    failed = AlertRecord(now, "ActuatorFailed", "critical", "webhook: HTTP 500")

    async def scenario() -> None:
        for record in [*drift, failed]:
            notifier.notify(record)
        held = await eventually(
            lambda: held if len(held := alertmanager.alerts()) == 3 else None, "3 alerts held"
        )
        by_class = {a["labels"].get("workload_class"): a for a in held}
        code = by_class["code"]
        assert code["labels"] == {
            "alertname": "SpeculationDrift",
            "severity": "warning",
            "cluster": "eu-1",
            "model_name": "m",
            "workload_class": "code",
            "bucket": "1",
        }
        assert code["annotations"]["summary"] == "code fell"
        assert code["status"]["state"] == "active"
        assert by_class[None]["labels"]["alertname"] == "ActuatorFailed"

        # Alertmanager's route groups by alertname and model: both drift alerts in one
        # group, and one notification to its receiver carries both.
        groups = await asyncio.to_thread(alertmanager.groups)
        by_labels = {json.dumps(g["labels"], sort_keys=True): g for g in groups}
        group = by_labels[json.dumps({"alertname": "SpeculationDrift", "model_name": "m"})]
        assert {a["labels"]["workload_class"] for a in group["alerts"]} == {"code", "chat"}
        # (the first may come before the second alert arrived: group_wait is 1 s)
        note = await eventually(
            lambda: next(
                (
                    b
                    for b in receiver.at("/from-alertmanager")
                    if b["groupLabels"].get("alertname") == "SpeculationDrift"
                    and len(b["alerts"]) == 2
                ),
                None,
            ),
            "one notification for the drift group with both alerts",
        )
        assert note["status"] == "firing"
        assert {a["labels"]["workload_class"] for a in note["alerts"]} == {"code", "chat"}

        # Re-sent while firing: each copy moves endsAt on (four re-send intervals
        # ahead), so Alertmanager does not let the alert lapse.
        first_end = parse_time(code["endsAt"])
        await eventually(
            lambda: (
                all(parse_time(a["endsAt"]) > first_end + 1.0 for a in alertmanager.alerts())
                or None
            ),
            "endsAt moved on by re-sends",
        )
        assert len(await asyncio.to_thread(alertmanager.alerts)) == 3
        resolved_at = time.time()
        for record in drift:
            notifier.notify(dataclasses.replace(record, resolved_at=resolved_at))
        gone = await eventually(
            lambda: next(
                (
                    b
                    for b in receiver.at("/from-alertmanager")
                    if b["status"] == "resolved"
                    and b["groupLabels"].get("alertname") == "SpeculationDrift"
                ),
                None,
            ),
            "the drift group resolved",
        )
        assert {a["status"] for a in gone["alerts"]} == {"resolved"}
        active = await asyncio.to_thread(alertmanager.alerts, active="true")
        assert [a["labels"]["alertname"] for a in active] == ["ActuatorFailed"]
        await notifier.aclose()

    run(scenario)


class FailingActuator:
    name = "webhook"

    def __init__(self) -> None:
        self.fail = True

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        if self.fail:
            raise RuntimeError("HTTP 503 from the orchestrator")


def loop_settings(tmp_path: Path, alerting: dict[str, Any]) -> Settings:
    base = make_settings(tmp_path)
    return Settings.model_validate({**base.model_dump(exclude={"alerting"}), "alerting": alerting})


@pytest.mark.alertmanager
def test_the_loop_sends_its_alerts_to_alertmanager_and_the_webhook(
    tmp_path: Path, alertmanager: AlertmanagerServer, receiver: Receiver
) -> None:
    settings = loop_settings(
        tmp_path,
        {
            "alertmanager_url": alertmanager.url,
            "webhook_url": f"{receiver.url}/hook",
            "webhook_headers": {"Authorization": "Bearer hook-secret"},
            "resend_interval_s": 0.5,
            # Long enough for Alertmanager's group_wait (1 s) to see it firing.
            "resolve_after_s": 5.0,
        },
    )
    actuator = FailingActuator()
    registry = CollectorRegistry()
    service = build_service(
        settings,
        ScriptedPolicy(settings.buckets),
        QueueSource(),
        actuators=[actuator],
        registry=registry,
    )
    loop = service.loop

    async def scenario() -> None:
        await loop.start()
        await loop.tick()  # the first push fails: ActuatorFailed is recorded
        [firing] = await eventually(lambda: receiver.at("/hook") or None, "the webhook's POST")
        assert firing["status"] == "firing"
        (alert,) = firing["alerts"]
        assert alert["labels"] == {"alertname": "ActuatorFailed", "severity": "critical"}
        assert "HTTP 503 from the orchestrator" in alert["annotations"]["summary"]
        # Alertmanager routed it to its receiver (what it sends is kept there).
        [routed] = await eventually(
            lambda: (
                [b for b in receiver.at("/from-alertmanager") if b["status"] == "firing"] or None
            ),
            "alertmanager's notification",
        )
        assert routed["commonLabels"] == {"alertname": "ActuatorFailed", "severity": "critical"}

        actuator.fail = False
        await loop.tick()  # the push goes through: nothing raises the alert again
        resolved = await eventually(
            lambda: [b for b in receiver.at("/hook") if b["status"] == "resolved"] or None,
            "the webhook's resolved POST",
        )
        assert resolved[0]["alerts"][0]["labels"]["alertname"] == "ActuatorFailed"
        assert len(receiver.at("/hook")) == 2  # one when it fired, one when it resolved
        await eventually(
            lambda: (
                [b for b in receiver.at("/from-alertmanager") if b["status"] == "resolved"] or None
            ),
            "alertmanager's resolved notification",
        )
        assert await asyncio.to_thread(alertmanager.alerts, active="true") == []
        await loop.shutdown()

    try:
        run(scenario)
    finally:
        service.close()
    ok = registry.get_sample_value(
        "specpilot_alert_notifications_total", {"sink": "webhook", "outcome": "ok"}
    )
    assert ok == 2


def test_deliveries_are_retried_boundedly_and_firing_alerts_resent() -> None:
    flaky = Receiver(statuses=[503, 503, 503, 400])
    metrics = ServiceMetrics(CollectorRegistry())
    settings = AlertingSettings(
        alertmanager_url=flaky.url, attempts=3, resend_interval_s=0.2, resolve_after_s=600
    )
    notifier = Notifier(settings, metrics=metrics)

    def count(outcome: str) -> float:
        value = metrics.registry.get_sample_value(
            "specpilot_alert_notifications_total", {"sink": "alertmanager", "outcome": outcome}
        )
        return value or 0.0

    async def scenario() -> None:
        notifier.notify(AlertRecord(time.time(), "ActuatorFailed", "critical", "boom"))
        # Three attempts, all 503: given up (bounded). The next re-send meets a 400,
        # which is final at once; later re-sends go through.
        await eventually(lambda: count("ok") >= 2 or None, "two re-sends taken")
        assert count("failed") == 2
        bodies = flaky.at("/api/v2/alerts")
        assert len(bodies) >= 3 + 1 + 2
        assert all(b[0]["labels"]["alertname"] == "ActuatorFailed" for b in bodies)
        await notifier.aclose()

    try:
        run(scenario)
    finally:
        flaky.close()


def test_notify_returns_at_once_while_the_receiver_hangs() -> None:
    stuck = Receiver()
    stuck.hang.set()
    metrics = ServiceMetrics(CollectorRegistry())
    settings = AlertingSettings(webhook_url=stuck.url, timeout_s=30.0, attempts=1)
    notifier = Notifier(settings, metrics=metrics)

    async def scenario() -> None:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0)
        for i in range(MAX_QUEUED + 500):
            notifier.notify(AlertRecord(float(i), f"Alert{i}", "warning", "x"))
        # The loop went on: every notify returned and the event loop kept running.
        before = ticks
        await asyncio.sleep(0.05)
        assert ticks > before
        assert notifier.webhook is not None
        assert len(notifier.webhook.queue) <= MAX_QUEUED
        dropped = metrics.registry.get_sample_value(
            "specpilot_alert_notifications_total", {"sink": "webhook", "outcome": "dropped"}
        )
        assert dropped is not None and dropped >= 500
        await notifier.aclose(grace_s=0.1)  # gives up on the stuck delivery
        beat.cancel()

    try:
        run(scenario)
    finally:
        stuck.hang.clear()
        stuck.close()
