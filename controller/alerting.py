"""specpilot's own alerts on what speculation does: ``AcceptanceDrift`` and
``SpeculationLosing``, raised and resolved by the control loop.

- ``AcceptanceDrift`` (warning): the policy's change detector found a model × class ×
  proposer's acceptance fell (``ControlPolicy.drift``; a rise is no incident). Its
  message gives vLLM's acceptance (accepted over draft tokens, ``controller.acceptance``)
  before and after the fall, with the counts and the period of each, so that anyone can
  check them against vLLM's own counters. Evidence that drafted nothing (n-gram finds
  no match in prose) is no acceptance, so it neither raises nor feeds one. It resolves
  once vLLM's acceptance over the evidence since it fired (at least
  ``RECENT_DRAFT_TOKENS`` draft tokens) is back above the midpoint between before and
  after. While the proposer drafts nothing for the class, it stays as it is: there is
  no acceptance to say it came back.
- ``SpeculationLosing`` (critical): a context's running arm speculates and the policy is
  sure it loses against no speculation: the top of its predicted speed-up's 10–90 %
  interval stayed below 1 for ``LOSING_TICKS`` iterations; it resolves when the
  predicted speed-up (the median) is back at 1 or more, the policy has no prediction for
  it, or the context stops speculating.

Firing alerts are keyed by name and ``context``, written as the labels that route them
(``model_name=…,workload_class=…,proposer=…``; ``bucket=…`` for ``SpeculationLosing``,
see ``controller.notify.context_labels``), stored with the loop's other records and rebuilt from the
store's unresolved alerts at start, so a restart neither repeats nor forgets them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from collectors.observations import RequestObservation, WindowObservation
from controller.acceptance import RECENT_DRAFT_TOKENS, AcceptanceBook, Key
from controller.contexts import Context
from controller.notify import context_labels
from controller.ports import DriftEvent
from controller.store.records import AlertRecord, Alternative
from controller.telemetry import ServiceMetrics
from policies.arms import Arm

DRIFT = "AcceptanceDrift"
LOSING = "SpeculationLosing"
LOSING_TICKS = 2
"""Consecutive iterations below break-even before ``SpeculationLosing`` fires."""


@dataclass(slots=True)
class _Firing:
    before: float
    """vLLM's acceptance before the fall."""
    after: float
    fired_after: float
    """The end of the newest evidence when it fired: recovery reads only later evidence."""
    record: AlertRecord | None = None


class Alerts:
    """What fires and what resolves; the loop records what this returns."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.book = AcceptanceBook()
        """vLLM's acceptance per model × class × proposer, from the loop's evidence."""
        self._drifting: dict[str, _Firing] = {}
        self._settled: dict[Key, float] = {}
        """Where a drift resolved: the next fall is sought in the evidence after it."""
        self._losing_ticks: dict[Context, int] = {}
        self._losing: dict[str, str] = {}
        """Firing ``SpeculationLosing`` contexts → the proposer of the arm they run."""

    def restore(self, unresolved: Iterable[AlertRecord]) -> None:
        """Alerts still firing when the service stopped fire on (no repeat, no loss)."""
        for alert in unresolved:
            if alert.context is None:
                continue
            if alert.name == DRIFT:
                # Before and after are in the message only: recover at 0.5, the break-even.
                self._drifting.setdefault(alert.context, _Firing(1.0, 0.0, -math.inf, alert))
                self._gauge(DRIFT, alert.context, 1)
            elif alert.name == LOSING:
                self._losing[alert.context] = alert.message.split(":", 1)[0].split(" ", 1)[0]
                self._losing_gauge(alert.context)

    # -- evidence ------------------------------------------------------------------------

    def note_window(self, window: WindowObservation) -> None:
        key = self.book.note_window(window)
        if key is not None:
            self._publish(key)

    def note_request(self, observation: RequestObservation) -> None:
        key = self.book.note_request(observation)
        if key is not None:
            self._publish(key)

    def _publish(self, key: Key) -> None:
        """``specpilot_acceptance_ratio`` and ``specpilot_drafted_nothing`` of one key."""
        track = self.book.track(key)
        if track is None:
            return
        labels = {"model_name": key[0], "workload_class": key[1], "proposer": key[2]}
        recent = track.recent()
        if recent is not None:
            self.metrics.acceptance.labels(**labels).set(recent.ratio)
        self.metrics.drafted_nothing.labels(**labels).set(1 if track.drafted_nothing else 0)

    # -- AcceptanceDrift -----------------------------------------------------------------

    def drifted(self, event: DriftEvent) -> AlertRecord | None:
        """The alert to raise for a detected fall (None for a rise, or while one fires)."""
        if event.after >= event.before:
            return None  # a rise is no incident
        context = drift_context(event.model, event.workload_class, event.proposer)
        if context in self._drifting:
            return None
        key = (event.model, event.workload_class, event.proposer)
        track = self.book.track(key)
        detector = (
            f"the change detector saw position-0 acceptance per drafted step fall "
            f"{event.before:.2f} -> {event.after:.2f}"
        )
        what = f"{event.proposer} acceptance for {event.workload_class} on {event.model}"
        if track is None or not track.evidence:
            # No drafted evidence with vLLM's token counts (requests reported without).
            firing = _Firing(event.before, event.after, -math.inf)
            message = f"{what} fell; vLLM reported no draft token counts: {detector}"
        else:
            fall = track.fall(after=self._settled.get(key, -math.inf))
            if fall is None:
                return None  # vLLM's acceptance over the same evidence shows no fall
            before, after = fall
            firing = _Firing(before.ratio, after.ratio, track.evidence[-1].until)
            message = f"{what} fell from {before.describe()} to {after.describe()}; {detector}"
        record = AlertRecord(event.at, DRIFT, "warning", message, context=context)
        firing.record = record
        self._drifting[context] = firing
        self._gauge(DRIFT, context, 1)
        return record

    def recovered(self) -> list[tuple[str, str]]:
        """(context, message) of each drift alert whose acceptance came back (each once):
        vLLM's acceptance over the evidence since it fired, at least
        ``RECENT_DRAFT_TOKENS`` draft tokens of it, at or above the midpoint."""
        done = []
        for context, firing in list(self._drifting.items()):
            key = _drift_key(context)
            track = self.book.track(key)
            recent = track.recent(after=firing.fired_after) if track else None
            if recent is None or recent.draft_tokens < RECENT_DRAFT_TOKENS:
                continue
            midpoint = (firing.before + firing.after) / 2
            if recent.ratio < midpoint:
                continue
            del self._drifting[context]
            self._settled[key] = recent.until
            self._gauge(DRIFT, context, 0)
            done.append(
                (
                    context,
                    f"{key[2]} acceptance for {key[1]} on {key[0]} is back at "
                    f"{recent.describe()}, at or above {midpoint:.2f} (it fell from "
                    f"{firing.before:.2f} to {firing.after:.2f})",
                )
            )
        return done

    def firing_drifts(self) -> list[AlertRecord]:
        """The drift alerts still firing, as raised (to re-announce while they hold)."""
        return [f.record for f in self._drifting.values() if f.record is not None]

    # -- SpeculationLosing ---------------------------------------------------------------

    def judge(
        self, context: Context, arm: str, predicted: Alternative | None, at: float
    ) -> tuple[AlertRecord | None, bool]:
        """(an alert to raise, whether a firing one resolved) for the arm a context runs
        and the policy's prediction for it."""
        key = losing_context(context)
        parsed = _arm(arm)
        speculating = parsed is not None and parsed.proposer is not None
        if key in self._losing:
            if speculating and predicted is not None and predicted.predicted_speedup < 1.0:
                return None, False
            self._losing_ticks.pop(context, None)
            self._losing_gauge(key, resolved=True)
            return None, True
        if not speculating or predicted is None or predicted.high >= 1.0:
            self._losing_ticks.pop(context, None)
            return None, False
        ticks = self._losing_ticks[context] = self._losing_ticks.get(context, 0) + 1
        if ticks < LOSING_TICKS:
            return None, False
        assert parsed is not None and parsed.proposer is not None
        self._losing[key] = parsed.proposer
        self._losing_gauge(key)
        message = (
            f"{arm} runs for {context.workload_class} at concurrency {context.bucket} on "
            f"{context.model} and loses: predicted speed-up {predicted.predicted_speedup:.2f} "
            f"({predicted.low:.2f}-{predicted.high:.2f}) over no speculation"
        )
        return AlertRecord(at, LOSING, "critical", message, context=key), False

    def _gauge(self, name: str, context: str, value: int) -> None:
        labels = context_labels(context)
        self.metrics.alert_firing.labels(
            alert=name,
            model_name=labels.get("model_name", ""),
            workload_class=labels.get("workload_class", ""),
            proposer=labels.get("proposer", ""),
        ).set(value)

    def _losing_gauge(self, key: str, *, resolved: bool = False) -> None:
        """The gauge of a losing context's labels: how many of its buckets fire."""
        proposer = self._losing[key]
        if resolved:
            del self._losing[key]
        labels = context_labels(key)
        model, cls = labels.get("model_name", ""), labels.get("workload_class", "")

        def same(other: str) -> bool:
            theirs = context_labels(other)
            return (theirs.get("model_name"), theirs.get("workload_class")) == (model, cls)

        firing = sum(1 for k, p in self._losing.items() if p == proposer and same(k))
        self.metrics.alert_firing.labels(
            alert=LOSING, model_name=model, workload_class=cls, proposer=proposer
        ).set(firing)


def drift_context(model: str, workload_class: str, proposer: str) -> str:
    return f"model_name={model},workload_class={workload_class},proposer={proposer}"


def _drift_key(context: str) -> Key:
    labels = context_labels(context)
    return (
        labels.get("model_name", ""),
        labels.get("workload_class", ""),
        labels.get("proposer", ""),
    )


def losing_context(context: Context) -> str:
    return (
        f"model_name={context.model},workload_class={context.workload_class},"
        f"bucket={context.bucket}"
    )


def _arm(text: str | None) -> Arm | None:
    try:
        return Arm.parse(text) if text else None
    except ValueError:
        return None
