"""specpilot's own alerts, delivered to people: Alertmanager's v2 API and a webhook.

The control loop records an :class:`~controller.store.records.AlertRecord` (a failed
push, an override that cannot run, ...) and hands it to :meth:`Notifier.notify`, which
returns at once: it updates what is firing and queues deliveries, which background
tasks in the same event loop make with ``httpx`` (bounded retries with back-off and full
jitter, as the webhook actuator's), so a slow or dead receiver never holds the loop up.

An alert's identity is its labels: ``alertname`` (the record's name), ``severity``, the
settings' ``alerting.labels``, and what its ``context`` names — a context written as
``model/class/bucket`` gives ``model_name``, ``workload_class`` and ``bucket``; one
written as ``key=value,...`` gives any of ``model_name``, ``workload_class``, ``bucket``,
``proposer``, ``pool`` and ``url`` (an instance's, ``SpecpilotInstanceDown``). The
message is the ``summary`` annotation.

- **Alertmanager** (``alerting.alertmanager_url``): a firing alert is posted at once and
  again every ``resend_interval_s`` with ``endsAt`` four intervals ahead (so it resolves
  by itself should specpilot die), and once more with ``endsAt`` when it resolves.
- **Webhook** (``alerting.webhook_url``): one POST when an alert starts firing and one
  when it resolves, in Alertmanager's webhook format (version 4, one alert each).

An alert resolves when a record with ``resolved_at`` arrives, or when specpilot has not
raised it again for ``resolve_after_s`` (the loop raises a condition such as a failing
actuator each iteration it holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from controller.actuators.webhook import RETRYABLE_STATUS, RetrySettings
from controller.settings import AlertingSettings, Settings
from controller.store.records import AlertRecord
from controller.telemetry import ServiceMetrics

log = logging.getLogger(__name__)

CONTEXT_LABELS = frozenset({"model_name", "workload_class", "bucket", "proposer", "pool", "url"})
MAX_FIRING = 1000
"""Alerts kept firing at most (the oldest go first): labels are bounded by the fleet,
this only guards against a caller that puts unbounded values in a context."""
MAX_QUEUED = 1000
"""Deliveries waiting per receiver at most; past that the oldest is dropped (counted)."""
_ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's "no end" in its webhook payloads
_REPORT_EVERY_S = 60.0


def context_labels(context: str | None) -> dict[str, str]:
    """The routing labels an alert's ``context`` names (see the module docstring)."""
    if not context:
        return {}
    if "=" in context:
        labels = {}
        for part in context.split(","):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if sep and key in CONTEXT_LABELS and value:
                labels[key] = value
        return labels
    parts = context.rsplit("/", 2)  # model names have slashes of their own
    if len(parts) == 3 and all(parts):
        return {"model_name": parts[0], "workload_class": parts[1], "bucket": parts[2]}
    return {}


def alert_labels(record: AlertRecord, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {
        **(extra or {}),
        **context_labels(record.context),
        "alertname": record.name,
        "severity": record.severity,
    }


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class _Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    last_seen: float

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(sorted(self.labels.items()), separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def for_alertmanager(self, ends_at: float) -> dict[str, Any]:
        return {
            "labels": self.labels,
            "annotations": self.annotations,
            "startsAt": rfc3339(self.starts_at),
            "endsAt": rfc3339(ends_at),
        }

    def for_webhook(self, ends_at: float | None) -> dict[str, Any]:
        status = "firing" if ends_at is None else "resolved"
        alert = {
            "status": status,
            "labels": self.labels,
            "annotations": self.annotations,
            "startsAt": rfc3339(self.starts_at),
            "endsAt": _ZERO_TIME if ends_at is None else rfc3339(ends_at),
            "generatorURL": "",
            "fingerprint": self.fingerprint,
        }
        return {
            "version": "4",
            "groupKey": f"specpilot:{self.fingerprint}",
            "truncatedAlerts": 0,
            "status": status,
            "receiver": "specpilot",
            "groupLabels": {"alertname": self.labels["alertname"]},
            "commonLabels": self.labels,
            "commonAnnotations": self.annotations,
            "externalURL": "",
            "alerts": [alert],
        }


DELIVERED, FAILED, DROPPED = "ok", "failed", "dropped"
"""Outcomes of a delivery: taken, given up after every attempt, dropped from a full queue."""


class _Receiver:
    """One destination: a bounded queue of request bodies and the task that posts them."""

    def __init__(
        self,
        name: str,
        url: str,
        headers: Mapping[str, str],
        retry: RetrySettings,
        metrics: ServiceMetrics | None,
        rng: random.Random,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        self.name, self.url, self.headers = name, url, dict(headers)
        self.retry, self.metrics, self.rng, self.transport = retry, metrics, rng, transport
        self.queue: deque[Any] = deque()
        self.ready = asyncio.Event()
        self.idle = asyncio.Event()
        """Set while nothing waits to be delivered or is being delivered."""
        self.idle.set()
        self._reported_at: float | None = None
        if metrics is not None:  # at 0, so that Prometheus' increase() sees the first
            for outcome in (DELIVERED, FAILED, DROPPED):
                metrics.alert_notifications.labels(sink=name, outcome=outcome)

    def submit(self, body: Any) -> None:
        if len(self.queue) >= MAX_QUEUED:
            self.queue.popleft()
            self._count(DROPPED)
        self.queue.append(body)
        self.idle.clear()
        self.ready.set()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.retry.timeout_s, transport=self.transport) as c:
            while True:
                await self.ready.wait()
                self.ready.clear()
                while self.queue:
                    try:
                        error = await self._post(c, self.queue.popleft())
                    except Exception as exc:  # a bug must not end deliveries for good
                        error = f"{type(exc).__name__}: {exc}"
                    self._count(DELIVERED if error is None else FAILED)
                    if error is not None:
                        self._report(error)
                self.idle.set()

    async def _post(self, client: httpx.AsyncClient, body: Any) -> str | None:
        """None once the receiver took it, else the last error."""
        error = "no attempt made"
        for attempt in range(self.retry.attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt - 1, self.rng))
            try:
                response = await client.post(self.url, json=body, headers=self.headers)
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}"
                continue
            if response.is_success:
                return None
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code not in RETRYABLE_STATUS:
                return error
        return f"{error} (after {self.retry.attempts} attempts)"

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.alert_notifications.labels(sink=self.name, outcome=outcome).inc()

    def _report(self, error: str) -> None:
        now = time.monotonic()
        if self._reported_at is None or now - self._reported_at >= _REPORT_EVERY_S:
            self._reported_at = now
            log.warning("alert delivery to %s (%s) failed: %s", self.name, self.url, error)


class Notifier:
    """Takes alert records (firing and resolved) and delivers them; see the module
    docstring. ``notify`` never blocks and never raises; with no receiver configured it
    does nothing. Its tasks start in the event loop of the first ``notify``."""

    def __init__(
        self,
        settings: AlertingSettings,
        *,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings, self.clock = settings, clock
        retry = RetrySettings(
            attempts=settings.attempts, max_delay_s=5.0, timeout_s=settings.timeout_s
        )
        rng = rng or random.Random()
        self.alertmanager: _Receiver | None = None
        self.webhook: _Receiver | None = None
        if settings.alertmanager_url is not None:
            url = settings.alertmanager_url.rstrip("/") + "/api/v2/alerts"
            self.alertmanager = _Receiver("alertmanager", url, {}, retry, metrics, rng, transport)
        if settings.webhook_url is not None:
            self.webhook = _Receiver(
                "webhook",
                settings.webhook_url,
                settings.webhook_headers,
                retry,
                metrics,
                rng,
                transport,
            )
        self.receivers = [r for r in (self.alertmanager, self.webhook) if r is not None]
        self.firing: dict[tuple[tuple[str, str], ...], _Alert] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()

    def notify(self, record: AlertRecord) -> None:
        if not self.receivers:
            return
        try:
            self._start()
            self._take(record)
        except Exception:
            log.exception("could not queue alert %s for delivery", record.name)

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Give queued deliveries ``grace_s`` to go out, then stop. Firing alerts are not
        resolved: Alertmanager lets them end at their ``endsAt`` unless sent again."""
        if not self._tasks:
            return
        drained = asyncio.gather(*(r.idle.wait() for r in self.receivers))
        try:
            await asyncio.wait_for(drained, grace_s)
        except TimeoutError:
            log.warning("stopping with alert deliveries still queued or in progress")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await task
        self._tasks, self._loop = [], None

    # -- state ---------------------------------------------------------------------

    def _take(self, record: AlertRecord) -> None:
        labels = alert_labels(record, self.settings.labels)
        annotations = {"summary": record.message}
        if record.context:
            annotations["context"] = record.context
        key = tuple(sorted(labels.items()))
        alert = self.firing.get(key)
        if record.resolved_at is not None:
            self.firing.pop(key, None)
            if alert is None:
                alert = _Alert(labels, annotations, record.ts, record.ts)
            self._resolved(alert, record.resolved_at)
            return
        if alert is None:
            if len(self.firing) >= MAX_FIRING:
                oldest = min(self.firing, key=lambda k: self.firing[k].last_seen)
                self._resolved(self.firing.pop(oldest), self.clock())
            alert = self.firing[key] = _Alert(labels, annotations, record.ts, record.ts)
            if self.webhook is not None:
                self.webhook.submit(alert.for_webhook(None))
        else:
            alert.annotations = annotations
            alert.last_seen = max(alert.last_seen, record.ts)
        if self.alertmanager is not None:
            self.alertmanager.submit([alert.for_alertmanager(self._valid_until())])
        self._wake.set()

    def _resolved(self, alert: _Alert, ends_at: float) -> None:
        if self.alertmanager is not None:
            self.alertmanager.submit([alert.for_alertmanager(ends_at)])
        if self.webhook is not None:
            self.webhook.submit(alert.for_webhook(ends_at))

    def _valid_until(self) -> float:
        return self.clock() + 4 * self.settings.resend_interval_s

    # -- tasks ---------------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        # First use, or a new event loop (the old one's tasks went with it).
        self._loop = loop
        self._wake = asyncio.Event()
        for receiver in self.receivers:
            receiver.ready, receiver.idle = asyncio.Event(), asyncio.Event()
            (receiver.ready if receiver.queue else receiver.idle).set()
        self._tasks = [loop.create_task(r.run()) for r in self.receivers]
        self._tasks.append(loop.create_task(self._tick()))

    async def _tick(self) -> None:
        """Re-send what fires; resolve what was not raised again in time."""
        interval = self.settings.resend_interval_s
        resend_at = time.monotonic() + interval
        while True:
            timeout = max(0.0, min(resend_at - time.monotonic(), self._next_expiry()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            now = self.clock()
            for key, alert in list(self.firing.items()):
                if now - alert.last_seen >= self.settings.resolve_after_s:
                    del self.firing[key]
                    self._resolved(alert, now)
            if time.monotonic() >= resend_at:
                resend_at = time.monotonic() + interval
                if self.alertmanager is not None and self.firing:
                    until = self._valid_until()
                    self.alertmanager.submit(
                        [a.for_alertmanager(until) for a in self.firing.values()]
                    )

    def _next_expiry(self) -> float:
        """Seconds until the first firing alert is due to resolve (inf: none fires)."""
        if not self.firing:
            return float("inf")
        now = self.clock()
        after = self.settings.resolve_after_s
        return max(0.0, min(a.last_seen + after - now for a in self.firing.values()))


def notifier_from(settings: Settings, metrics: ServiceMetrics | None = None) -> Notifier:
    """The notifier ``settings.alerting`` describes (one that does nothing when neither
    receiver is set)."""
    return Notifier(settings.alerting, metrics=metrics)
