"""specpilot's own alerts on what speculation does: ``AcceptanceDrift`` and
``SpeculationLosing``, raised and resolved by the control loop.

- ``AcceptanceDrift`` (warning): the policy's change detector found a model × class ×
  proposer's acceptance fell (``ControlPolicy.drift``; a rise is no incident). The
  alert says acceptance and tokens per verify step before and after, as the evidence
  showed them (scraped windows or requests alike); it resolves once the recent
  acceptance is back above the midpoint between before and after.
- ``SpeculationLosing`` (critical): a context's running arm speculates and the policy's
  estimate of its speed-up over no speculation stayed below 1 (the break-even,
  acceptance around 0.5 in the seeds' numbers) for ``LOSING_TICKS`` iterations; it
  resolves when the estimate is back at 1 or more, or the context stops speculating.

Firing alerts are keyed by name and ``context``, written as the labels that route them
(``model_name=…,workload_class=…,proposer=…``; ``bucket=…`` for ``SpeculationLosing``,
see ``controller.notify.context_labels``), stored with the loop's other records and rebuilt from the
store's unresolved alerts at start, so a restart neither repeats nor forgets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from collectors.observations import RequestObservation, WindowObservation
from controller.contexts import Context
from controller.notify import context_labels
from controller.ports import DriftEvent
from controller.store.records import AlertRecord
from controller.telemetry import ServiceMetrics
from policies.arms import Arm

DRIFT = "AcceptanceDrift"
LOSING = "SpeculationLosing"
LOSING_TICKS = 2
"""Consecutive iterations below break-even before ``SpeculationLosing`` fires."""
_SLOW, _FAST = 0.05, 0.5
"""Weights of a new window or request in the long-run and the recent means."""
_RECOVERY_UPDATES = 3
"""Evidence seen since firing before a recovery is believed."""


@dataclass(slots=True)
class _Track:
    """Acceptance and tokens per verify step of one model × class × proposer."""

    slow_acceptance: float | None = None
    fast_acceptance: float | None = None
    slow_tokens: float | None = None
    fast_tokens: float | None = None
    updates: int = 0

    def add(self, acceptance: float | None, tokens: float | None, weight: float) -> None:
        slow, fast = 1 - (1 - _SLOW) ** weight, 1 - (1 - _FAST) ** weight
        if acceptance is not None:
            self.slow_acceptance = _mix(self.slow_acceptance, acceptance, slow)
            self.fast_acceptance = _mix(self.fast_acceptance, acceptance, fast)
        if tokens is not None:
            self.slow_tokens = _mix(self.slow_tokens, tokens, slow)
            self.fast_tokens = _mix(self.fast_tokens, tokens, fast)
        self.updates += 1


@dataclass(slots=True)
class _Firing:
    before_acceptance: float
    after_acceptance: float
    updates_at_fire: int


class Alerts:
    """What fires and what resolves; the loop records what this returns."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self._tracks: dict[tuple[str, str, str], _Track] = {}
        self._drifting: dict[str, _Firing] = {}
        self._losing_ticks: dict[Context, int] = {}
        self._losing: dict[str, str] = {}
        """Firing ``SpeculationLosing`` contexts → the proposer of the arm they run."""

    def restore(self, unresolved: Iterable[AlertRecord]) -> None:
        """Alerts still firing when the service stopped fire on (no repeat, no loss)."""
        for alert in unresolved:
            if alert.context is None:
                continue
            if alert.name == DRIFT:
                self._drifting.setdefault(alert.context, _Firing(1.0, 0.0, 0))
                self._gauge(DRIFT, alert.context, 1)
            elif alert.name == LOSING:
                self._losing[alert.context] = alert.message.split(":", 1)[0].split(" ", 1)[0]
                self._losing_gauge(alert.context)

    # -- evidence ------------------------------------------------------------------------

    def note_window(self, window: WindowObservation) -> None:
        arm = _arm(window.arm)
        if arm is None or arm.proposer is None or window.generation_tokens <= 0:
            return
        track = self._tracks.setdefault(
            (window.model, window.workload_class or "", arm.proposer), _Track()
        )
        if window.drafts > 0:
            track.add(window.acceptance_rate, window.mean_acceptance_length, 1.0)
        else:  # it proposed nothing: every step emitted one token
            track.add(0.0, 1.0, 1.0)

    def note_request(self, observation: RequestObservation) -> None:
        arm = _arm(observation.arm)
        spec = observation.spec
        if arm is None or arm.proposer is None or spec is None or not spec.num_drafts:
            return
        key = (observation.model or "", observation.workload_class or "", arm.proposer)
        track = self._tracks.setdefault(key, _Track())
        # A request is a small window: it moves the means by a tenth of one.
        track.add(spec.acceptance_rate, spec.mean_acceptance_length, 0.1)

    # -- AcceptanceDrift -----------------------------------------------------------------

    def drifted(self, event: DriftEvent) -> AlertRecord | None:
        """The alert to raise for a detected drift (None while one already fires)."""
        context = drift_context(event.model, event.workload_class, event.proposer)
        track = self._tracks.get((event.model, event.workload_class, event.proposer), _Track())
        firing = self._drifting.get(context)
        before = track.slow_acceptance
        after = track.fast_acceptance
        if event.after >= event.before:
            # A rise is no incident; it resolves a fall's alert (see ``recovered``).
            if firing is not None:
                firing.updates_at_fire = -_RECOVERY_UPDATES
            return None
        if firing is not None:
            return None
        self._drifting[context] = _Firing(
            before if before is not None else event.before,
            after if after is not None else event.after,
            track.updates,
        )
        self._gauge(DRIFT, context, 1)
        message = (
            f"{event.proposer} acceptance for {event.workload_class} on {event.model} "
            f"moved: acceptance {_pct(before)} -> {_pct(after)}, tokens per verify step "
            f"{_num(track.slow_tokens)} -> {_num(track.fast_tokens)} (first-position "
            f"acceptance {event.before:.2f} -> {event.after:.2f})"
        )
        return AlertRecord(event.at, DRIFT, "warning", message, context=context)

    def recovered(self) -> list[str]:
        """Contexts of drift alerts whose acceptance came back (each once)."""
        done = []
        for context, firing in list(self._drifting.items()):
            labels = context_labels(context)
            key = (labels.get("model_name", ""), labels.get("workload_class", ""))
            track = self._tracks.get((*key, labels.get("proposer", "")))
            if track is None or track.fast_acceptance is None:
                continue
            if track.updates - firing.updates_at_fire < _RECOVERY_UPDATES:
                continue
            midpoint = (firing.before_acceptance + firing.after_acceptance) / 2
            if (
                firing.before_acceptance > firing.after_acceptance
                and (track.fast_acceptance >= midpoint)
            ) or (
                firing.before_acceptance <= firing.after_acceptance
                and (track.fast_acceptance <= midpoint)
            ):
                done.append(context)
        for context in done:
            del self._drifting[context]
            self._gauge(DRIFT, context, 0)
        return done

    # -- SpeculationLosing ---------------------------------------------------------------

    def judge(
        self, context: Context, arm: str, speedup: float | None, at: float
    ) -> tuple[AlertRecord | None, bool]:
        """(an alert to raise, whether a firing one resolved) for the arm a context runs
        and the policy's estimate of its speed-up."""
        key = losing_context(context)
        parsed = _arm(arm)
        losing = (
            parsed is not None
            and parsed.proposer is not None
            and speedup is not None
            and speedup < 1.0
        )
        if not losing:
            self._losing_ticks.pop(context, None)
            if key in self._losing:
                self._losing_gauge(key, resolved=True)
                return None, True
            return None, False
        ticks = self._losing_ticks[context] = self._losing_ticks.get(context, 0) + 1
        if ticks < LOSING_TICKS or key in self._losing:
            return None, False
        assert parsed is not None and parsed.proposer is not None
        self._losing[key] = parsed.proposer
        self._losing_gauge(key)
        message = (
            f"{arm} runs for {context.workload_class} at concurrency {context.bucket} on "
            f"{context.model} and loses: predicted speed-up {speedup:.2f} over no speculation"
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


def losing_context(context: Context) -> str:
    return (
        f"model_name={context.model},workload_class={context.workload_class},"
        f"bucket={context.bucket}"
    )


def _mix(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


def _arm(text: str | None) -> Arm | None:
    try:
        return Arm.parse(text) if text else None
    except ValueError:
        return None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
