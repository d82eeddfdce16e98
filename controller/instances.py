"""Instance health: whether each pool instance answers, and serves its pool's model.

Every loop iteration ``InstanceHealth.probe`` asks each instance the loop knows of
(``FleetPlacements``: the settings' instances, a managed pool's running one)
``GET /v1/models``, vLLM's list of the names it serves (``--served-model-name``, else
the model path), all at once, each within ``collect.scrape.timeout_s``. That one request
is both the liveness probe and the model check, whatever ``collect`` reads (scrape,
Prometheus, the gateway's requests): an instance restarted with another model is caught
as a dead one is, and a check at start that finds nothing listening is simply retried at
the next iteration.

An instance is *up* when it answers with its pool's model (the pool's ``model``, or a
managed pool's ``served_model``) among the names; else *down*, for one of three reasons:
``unreachable`` (refused, timed out, reset), ``bad_answer`` (an HTTP error, a body that
is not a model list) or ``wrong_model`` (it serves other names, which the reason lists).

What follows from it:

- ``specpilot_instance_up{pool,url}`` is 1 or 0 per instance, the URL as ``/v1/fleet``
  shows it (credentials redacted);
- one ``instance_down`` action line when an instance goes down (or its reason changes
  kind), one ``instance_up`` when it answers again: never a line per probe;
- ``SpecpilotInstanceDown`` (warning, context ``pool=NAME,url=URL``) once it stayed
  down for ``alerting.instance_down_after_s`` (default three loop intervals), resolved at
  its first good answer or when it leaves the fleet; a restart keeps what fires;
- a wrong-model instance's windows are stored unhealthy with the reason and teach the
  policy nothing (``screen``), whatever its metrics say;
- ``pools_down``: the pools none of whose instances is up (``/readyz``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx

from collectors.scraper import describe_error
from controller import actions
from controller.actions import Action
from controller.notify import context_labels
from controller.ports import Collected
from controller.settings import Settings
from controller.sources import Placement
from controller.store.records import AlertRecord
from controller.telemetry import ServiceMetrics
from controller.urls import redact_url

INSTANCE_DOWN = "SpecpilotInstanceDown"
SEVERITY = "warning"
Reason = Literal["unreachable", "bad_answer", "wrong_model"]
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one probe found."""

    reason: Reason | None
    """None: up."""
    detail: str | None = None
    """One line for a reader (``serves tiny, not llama``)."""
    served: tuple[str, ...] = ()
    """The names the instance serves, when it answered with a model list."""

    @property
    def up(self) -> bool:
        return self.reason is None


def served_models(body: Any) -> tuple[str, ...]:
    """The model names of an OpenAI ``GET /v1/models`` answer; ValueError if it is not one."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("id"), str) for entry in data
    ):
        raise ValueError("not a model list")
    return tuple(entry["id"] for entry in data)


async def check_instance(
    client: httpx.AsyncClient, url: str, model: str, timeout_s: float
) -> Verdict:
    """Ask ``url`` which models it serves and judge it against ``model``."""
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.get(f"{url}/v1/models")
    except Exception as error:  # any failure to get an answer is this instance's
        return Verdict("unreachable", f"unreachable: {_scrubbed(describe_error(error), url)}")
    if response.status_code != 200:
        return Verdict("bad_answer", f"GET /v1/models answered HTTP {response.status_code}")
    try:
        served = served_models(response.json())
    except ValueError:
        return Verdict("bad_answer", "GET /v1/models did not answer with a model list")
    if model in served:
        return Verdict(None, served=served)
    names = ", ".join(served) if served else "no model"
    return Verdict("wrong_model", f"serves {names}, not {model}", served)


def expected_model(settings: Settings, pool: str) -> str:
    """The name a pool's instances must serve: a managed pool's ``served_model`` where
    set, else the pool's ``model``."""
    managed = settings.actuators.managed
    launch = managed.pools.get(pool) if managed is not None else None
    if launch is not None and launch.served_model:
        return launch.served_model
    return settings.fleet.pools[pool].model


def instance_context(pool: str, instance: str) -> str:
    """An alert's context for one instance (``notify.context_labels`` reads it back)."""
    return f"pool={pool},url={redact_url(instance).replace(',', '%2C')}"


@dataclass(frozen=True, slots=True)
class InstanceAlerts:
    """What a probe round found: alerts to raise, contexts whose alert resolved, and the
    alerts that fire on (for the notifier, which resolves what is not raised again)."""

    raised: list[AlertRecord] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    firing: list[AlertRecord] = field(default_factory=list)


@dataclass(slots=True)
class _Instance:
    pool: str
    instance: str
    verdict: Verdict
    down_since: float | None
    firing: bool = False

    @property
    def context(self) -> str:
        return instance_context(self.pool, self.instance)


class InstanceHealth:
    """The state of every instance, updated by ``probe`` once per loop iteration."""

    def __init__(
        self,
        settings: Settings,
        placements: Callable[[], Sequence[Placement]],
        metrics: ServiceMetrics,
        *,
        clock: Clock = time.time,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings, self.metrics, self._clock = settings, metrics, clock
        self._placements = placements
        self._timeout_s = settings.collect.scrape.timeout_s
        self.down_after_s = (
            settings.alerting.instance_down_after_s or 3 * settings.scrape_interval_s
        )
        managed = settings.actuators.managed
        self._replica = managed.replica if managed is not None and managed.pod else None
        """Per-pod topology: this replica; its instances are named ``URL#REPLICA``."""
        self._client = client or httpx.AsyncClient(timeout=self._timeout_s)
        self._owns_client = client is None
        self._states: dict[tuple[str, str], _Instance] = {}
        self._restored: set[str] = set()
        """Contexts of alerts that fired when the service last stopped."""
        self._placed: set[str] = set()
        """Pools with an instance at the last probe."""
        self.probed = False

    def restore(self, unresolved: Iterable[AlertRecord]) -> None:
        """Alerts still firing from before fire on: not raised twice, resolved when
        their instance answers (or is gone)."""
        for alert in unresolved:
            if alert.name == INSTANCE_DOWN and alert.context:
                self._restored.add(alert.context)
        for state in self._states.values():
            if state.context in self._restored:
                state.firing = True
                self._restored.discard(state.context)

    async def probe(self) -> InstanceAlerts:
        """Probe every instance once, concurrently; log and count what changed."""
        placements = {(p.pool, p.instance): p for p in self._placements()}
        verdicts = await asyncio.gather(
            *(
                check_instance(
                    self._client, p.url, expected_model(self.settings, p.pool), self._timeout_s
                )
                for p in placements.values()
            )
        )
        now = self._clock()
        changes = InstanceAlerts()
        self._placed = {pool for pool, _ in placements}
        for key, verdict in zip(placements, verdicts, strict=True):
            self._judge(key, verdict, now, changes)
        for key in [k for k in self._states if k not in placements]:
            gone = self._states.pop(key)
            _remove(self.metrics.instance_up, gone.pool, redact_url(gone.instance))
            if gone.firing:
                changes.resolved.append(gone.context)
        if not self.probed:
            # Alerts restored for instances that are no longer here resolve; in the
            # per-pod topology only this pod's own (the others' replicas judge theirs).
            here = {state.context for state in self._states.values()}
            for context in sorted(self._restored - here):
                if self._owns(context):
                    changes.resolved.append(context)
            self._restored.clear()
        self.probed = True
        return changes

    def _judge(
        self, key: tuple[str, str], verdict: Verdict, now: float, changes: InstanceAlerts
    ) -> None:
        pool, instance = key
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _Instance(pool, instance, Verdict(None), None)
            if state.context in self._restored:
                state.firing = True
                self._restored.discard(state.context)
        shown = redact_url(instance)
        self.metrics.instance_up.labels(pool=pool, url=shown).set(1 if verdict.up else 0)
        was = state.verdict
        state.verdict = verdict
        if verdict.up:
            if state.down_since is not None:
                down_s = now - state.down_since
                actions.record(
                    Action.INSTANCE_UP,
                    f"pool {pool}: {shown} answers again after {down_s:.0f} s",
                    pool=pool,
                    instance=shown,
                )
            state.down_since = None
            if state.firing:
                state.firing = False
                changes.resolved.append(state.context)
            return
        if state.down_since is None:
            state.down_since = now
        if verdict.reason != was.reason:  # went down, or down for another reason now
            actions.record(
                Action.INSTANCE_DOWN,
                f"pool {pool}: {shown} {verdict.detail}",
                pool=pool,
                instance=shown,
                reason=verdict.reason,
                served=",".join(verdict.served) or None,
            )
        down_s = now - state.down_since
        message = f"pool {pool}: {shown} {verdict.detail} (down for {down_s:.0f} s)"
        alert = AlertRecord(now, INSTANCE_DOWN, SEVERITY, message, state.context)
        if state.firing:
            changes.firing.append(alert)
        elif down_s >= self.down_after_s:
            state.firing = True
            changes.raised.append(alert)

    def _owns(self, context: str) -> bool:
        if self._replica is None:
            return True
        return context_labels(context).get("url", "").endswith(f"#{self._replica}")

    def screen(self, collected: Collected) -> Collected:
        """A wrong-model instance's windows: stored unhealthy with the reason, and no
        evidence for its pool (its figures are another model's), neither to learn from
        nor to confirm a push by."""
        wrong = {
            key: state.verdict.detail
            for key, state in self._states.items()
            if state.verdict.reason == "wrong_model"
        }
        if not wrong:
            return collected
        windows = tuple(
            replace(w, healthy=False, status=wrong[(w.pool, w.instance)])
            if (w.pool, w.instance) in wrong
            else w
            for w in collected.windows
        )
        evidence = tuple(
            w
            for w in collected.window_observations
            if (w.pool or "", w.instance or "") not in wrong
        )
        shapes = tuple(i for i in collected.instances if (i.pool, i.instance) not in wrong)
        return replace(collected, windows=windows, window_observations=evidence, instances=shapes)

    def pools_down(self) -> dict[str, str]:
        """Pools none of whose instances is up → why, one line (``/readyz``). A pool
        with no instance at all (a managed pool not started, or whose start failed)
        counts, but in the per-pod topology, where the other pools run in other pods and
        the pod's own vLLM between starts is ``checks.vllm``'s."""
        by_pool: dict[str, list[_Instance]] = {}
        for state in self._states.values():
            by_pool.setdefault(state.pool, []).append(state)
        down = {
            pool: "; ".join(f"{redact_url(s.instance)} {s.verdict.detail}" for s in states)
            for pool, states in by_pool.items()
            if not any(s.verdict.up for s in states)
        }
        if self.probed and self._replica is None:
            for pool in set(self.settings.fleet.pools) - self._placed:
                down[pool] = "no instance running"
        return dict(sorted(down.items()))

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _scrubbed(text: str, url: str) -> str:
    """An error line without the URL's credentials, should the error quote the URL."""
    return text.replace(url, redact_url(url)) if url != redact_url(url) else text


def _remove(gauge: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to remove
        gauge.remove(*labels)
