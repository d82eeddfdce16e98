"""The control loop: every interval, collect → learn → decide → override and guard → act → record.

One iteration (``tick``) on the leader:

1. collect what the collectors saw since the last iteration, and store it (buffered:
   observations are the one thing a crash or a long outage may lose);
2. unless frozen, let the policy learn from the new observations;
3. for every context, take the operator's pin if an override covers it, else the
   policy's choice, subject to the guard rails (the arm must be runnable on every pool
   serving the context; a context changes arm at most once per ``min_dwell_s``). In
   routing mode the gateway asks the policy per request, so there is nothing to hold
   back: the context runs what the policy committed (or the pin) as soon as it does,
   and the loop records that arm (``_routed_target``);
4. record every change as a decision — synchronously, before anything is pushed, so a
   crash can never have acted on a decision the audit log does not have;
5. hand the pools whose effective config changed to the actuators;
6. measure what earlier decisions bought (mean time per output token under the
   previous arm over the one under the new arm, once ``measure_after_s`` has passed),
   snapshot the learned state, and roll old observations up.

A follower only reloads state from the store (the newest snapshot, decisions, the
freeze flag), so its API serves fresh reads and a take-over starts warm.

Store calls run in worker threads so the API shares the event loop undisturbed, and so
does the policy's work (learning, planning and deciding take seconds under load): every
call into the policy and every store read runs, one at a time and in order, in the
loop's own worker thread (``_think``; ``consult`` for anyone else), while the iteration
waits for it and the event loop serves the API. What the API shows of the policy is
what the loop published at the end of its last iteration (``estimates``); the loop's
own tables (arms, actors, overrides) it reads live. A store that cannot be reached does
not stop the loop: reads fall back to what was last read, writes wait in the bounded
``BufferedWriter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, get_args

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from collectors.observations import RequestObservation, WindowObservation
from controller import actions
from controller.actions import Action
from controller.actuators.base import Actuator, wrapped
from controller.actuators.rolling import RollingRestarts
from controller.alerting import DRIFT, LOSING, Alerts, losing_context
from controller.contexts import Context, bucket_of
from controller.exactness import EXACTNESS_BROKEN, ExactnessChecker, exactness_failures
from controller.fleet import Fleet, PoolConfig, pool_arms
from controller.instances import INSTANCE_DOWN, InstanceHealth
from controller.instances import SEVERITY as INSTANCE_DOWN_SEVERITY
from controller.notify import notifier_from
from controller.override_pools import OVERRIDE_POOL_DOWN, OverridePools, PinnedPools
from controller.override_pools import SEVERITY as OVERRIDE_POOL_DOWN_SEVERITY
from controller.ports import (
    ArmChoice,
    ArmEstimate,
    Collected,
    ControlPolicy,
    ObservationSource,
    Route,
    Routed,
)
from controller.relayed import RelayedWindows
from controller.running import Push, PushState, RunningConfigs
from controller.settings import Settings
from controller.specconfig import OFF, SpecConfigError
from controller.store.buffer import BufferedWriter
from controller.store.db import ROLLUP_BATCH, Store, is_unavailable
from controller.store.journal import Journal
from controller.store.leader import Leadership
from controller.store.records import (
    Actor,
    AlertRecord,
    Alternative,
    DecisionRecord,
    ObservationRecord,
    OverrideRecord,
)
from controller.telemetry import ServiceMetrics
from policies.reasons import Reason

log = logging.getLogger(__name__)
T = TypeVar("T")
Clock = Callable[[], float]

FROZEN_KEY = "frozen"
SNAPSHOT_WRITE = "policy-snapshot"
"""Buffered snapshot writes share this key: during an outage only the newest is kept."""
UNKNOWN = "unknown"
WINDOW_KEY = "window"
"""A handed-over window (per-pod topology) is ``{"window": WindowObservation.to_json()}``;
a handed-over request is the bare ``RequestObservation.to_json()``."""
HOUSEKEEPING_EVERY_S = 60.0
MAX_ROLLUP_BATCHES = 20
MIN_MEASURED_REQUESTS = 3
"""Requests under a new arm before its speed-up is taken as measured."""
ACTUATOR_FAILED = "ActuatorFailed"
OVERRIDE_NOT_RUNNABLE = "OverrideNotRunnable"
STORE_LOST = "StoreLost"
PUSH_NOT_APPLIED = "SpecpilotPushNotApplied"
ALERT_NAMES = (
    DRIFT,
    LOSING,
    ACTUATOR_FAILED,
    EXACTNESS_BROKEN,
    OVERRIDE_NOT_RUNNABLE,
    STORE_LOST,
    PUSH_NOT_APPLIED,
    INSTANCE_DOWN,
    OVERRIDE_POOL_DOWN,
)
"""Every alert the loop raises."""
NOT_RUNNABLE = "not_runnable"
MIN_DWELL = "min_dwell"
PUSH_OK, PUSH_ERROR = "ok", "error"
SWITCH_INTERVAL_S = 0.001
"""How long the policy's thread may hold the GIL while the event loop waits for it."""


@dataclass(frozen=True, slots=True)
class Target:
    arm: str
    reason: Reason
    actor: Actor
    predicted_speedup: float | None = None
    detail: str = ""
    alternatives: tuple[Alternative, ...] = ()


@dataclass(frozen=True, slots=True)
class Pin:
    arm: str
    override: OverrideRecord


@dataclass(slots=True)
class _Mean:
    total: float = 0.0
    count: int = 0

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass(slots=True)
class RouteShare:
    """Routing mode: requests of a context finished since its arm last changed, how many
    of them the routing table sent to another arm (exploration, probes, trials), and
    how many the gateway served on another pool than the table's, because that pool
    could not take them (failovers: neither the policy's choice nor exploration)."""

    requests: int = 0
    elsewhere: int = 0
    failovers: int = 0

    @property
    def explored(self) -> float | None:
        return self.elsewhere / self.requests if self.requests else None

    @property
    def failed_over(self) -> float | None:
        return self.failovers / self.requests if self.requests else None


@dataclass(frozen=True, slots=True)
class _Pending:
    decided_at: float
    arm: str
    baseline_tpot_s: float


def context_of(observation: RequestObservation, bucket_edges: Sequence[int]) -> Context:
    return Context(
        observation.model or UNKNOWN,
        observation.workload_class or UNKNOWN,
        bucket_of(observation.concurrency, bucket_edges),
    )


def observation_record(
    observation: RequestObservation, bucket_edges: Sequence[int], now: float
) -> ObservationRecord:
    spec = observation.spec
    return ObservationRecord(
        ts=observation.finished_at if observation.finished_at is not None else now,
        context=context_of(observation, bucket_edges),
        arm=observation.arm or UNKNOWN,
        pool=observation.pool,
        output_tokens=observation.output_tokens,
        tpot_s=observation.tpot_s,
        ttft_s=observation.ttft_s,
        acceptance_rate=spec.acceptance_rate if spec else None,
        mean_acceptance_length=spec.mean_acceptance_length if spec else None,
    )


class ControlLoop:
    def __init__(
        self,
        *,
        settings: Settings,
        fleet: Fleet,
        policy: ControlPolicy,
        source: ObservationSource,
        store: Store,
        writer: BufferedWriter,
        leadership: Leadership,
        actuators: Sequence[Actuator],
        metrics: ServiceMetrics,
        journal: Journal,
        clock: Clock = time.time,
    ) -> None:
        self.settings, self.fleet, self.policy, self.source = settings, fleet, policy, source
        self.store, self.writer, self.leadership = store, writer, leadership
        self.actuators, self.metrics, self.clock = actuators, metrics, clock
        self.journal = journal
        self.notifier = notifier_from(settings, metrics)  # alerts to Alertmanager / webhook
        _start_counters(metrics, actuators)
        self._known = frozenset(fleet.contexts)
        # What the API reads (this replica's view).
        self.arms: dict[Context, str] = {}
        self.actors: dict[Context, Actor] = {}
        self.changed_at: dict[Context, float] = {}
        self.frozen = False
        self._frozen_sets = 0
        """How often the API set ``frozen``: a store read begun before the last set is
        older than it and must not undo it."""
        self.is_leader = False
        self.overrides: list[OverrideRecord] = []
        self.routes: dict[Context, RouteShare] = {}
        """Routing mode: where the requests of each context went since its last change."""
        self.relayed = RelayedWindows()
        """What the gateway measured per instance (the leader's, of every replica's)."""
        self._published: dict[Context, str] = {}
        """The arm ``specpilot_context_arm`` shows per context."""
        self.last_tick_at: float | None = None
        self.store_reachable = True
        # Bookkeeping of the leader.
        self._tpot: dict[tuple[Context, str], _Mean] = {}
        self._pending: dict[Context, _Pending] = {}
        self._bad_overrides: dict[str, str | None] = {}
        """Overrides ``OverrideNotRunnable`` fires for → its context (the override's scope;
        None for one restored from a store written before alerts had one)."""
        self._snapshot_ts = -math.inf
        self._loaded_snapshot_ts = -math.inf
        self._housekeeping_at = -math.inf
        self._push_all = True
        self._to_push: set[str] = set()
        self._pushing: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.alerts = Alerts(metrics)
        self._running_prediction: dict[Context, tuple[str, Alternative | None]] = {}
        self._acting_as_leader = False
        """Whether the previous iteration ran as leader (a change means: take over)."""
        self._store_lost = False
        self.tracer: Tracer | None = None
        self._exactness_firing: set[str] = set()
        """Spans per iteration and per push (``controller.tracing``); None: none."""
        self.routes_to: Callable[[Mapping[Context, Route]], None] | None = None
        """Routing mode: where each iteration's routing table goes (the gateway's
        workers, which route by the last one they got whatever the loop does next)."""
        self.running = RunningConfigs(
            fleet, confirm_within_s=settings.actuators.confirm_within_s, clock=clock
        )
        """Push mode: what each pool runs as vLLM shows it, and whether pushes took."""
        self._overrides_logged: dict[str, OverrideRecord] = {}
        """The overrides whose coming into force the log has (see ``_log_overrides``)."""
        self._not_applied: set[str] = set()
        """Pools whose ``SpecpilotPushNotApplied`` fires."""
        self._actuators_failing: set[str] = set()
        """Contexts (``actuator=NAME``) whose ``ActuatorFailed`` fires."""
        self._exactness_refused: set[str] = set()
        """Pools (``pool=NAME``) whose refused push raised ``ExactnessBroken``."""
        self.instances: InstanceHealth | None = None
        """Probes the pool instances each iteration this replica collects
        (``controller.instances``); None: not probed."""
        self._override_pools = OverridePools(
            settings.alerting.instance_down_after_s or 3 * settings.scrape_interval_s
        )
        """Overrides whose pool has no instance up (``controller.override_pools``)."""
        self.estimates: Mapping[Context, Sequence[ArmEstimate]] = {}
        """The policy's estimates per context as of the end of the last iteration (what
        ``/v1/policy`` shows): replaced whole, never changed in place."""
        self._lane: ThreadPoolExecutor | None = None
        """The one worker thread the policy and the store reads run in (``_think``)."""

    # -- store access that survives outages ---------------------------------------------

    def set_frozen(self, frozen: bool) -> None:
        """What the API calls once the store holds ``frozen``."""
        self.frozen = frozen
        self._frozen_sets += 1
        self.metrics.frozen.set(1 if frozen else 0)

    async def _think(self, work: Callable[[], T]) -> T:
        """Run ``work`` (a call into the policy, a store read) in the loop's worker
        thread, after whatever runs there already: the event loop stays free for the API
        and the gateway while the policy plans, and the policy is never used by two
        threads at once."""
        if self._lane is None:
            self._lane = ThreadPoolExecutor(1, thread_name_prefix="specpilot-policy")
            # The policy's work is pure Python that holds the GIL; the event loop wakes
            # for each request and waits for the GIL up to the switch interval each time
            # (5 ms by default: tens of ms per API request while the policy plans).
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        return await asyncio.get_running_loop().run_in_executor(self._lane, work)

    async def consult(self, question: Callable[[], T]) -> T:
        """Ask the policy something from outside the loop (a live table, a test): in
        turn with the loop's own use of it, in its worker thread. Never call the policy
        directly while the loop runs."""
        return await self._think(question)

    def _estimates(self) -> dict[Context, tuple[ArmEstimate, ...]]:
        return {context: tuple(self.policy.estimates(context)) for context in self.fleet.contexts}

    async def _publish_estimates(self) -> None:
        self.estimates = await self._think(self._estimates)

    async def _read(self, read: Callable[[], T], fallback: T) -> T:
        """Run a store read in the loop's worker thread; on an outage return ``fallback``."""
        try:
            value = await self._think(read)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            self._note_store(False)
            return fallback
        self._note_store(True)
        return value

    async def _write(
        self,
        method: Callable[..., object],
        *args: Any,
        records: int = 1,
        droppable: bool = False,
        key: str | None = None,
    ) -> None:
        """``method(store, *args)`` now, or buffered if the store is away."""
        reached = await asyncio.to_thread(
            self.writer.write,
            lambda store: method(store, *args),
            records=records,
            droppable=droppable,
            key=key,
        )
        self._note_store(reached)

    async def _record(self, record: DecisionRecord | AlertRecord) -> None:
        """Store a decision or alert before acting on it; if the store is away, also
        journal it on local disk so that not even a crash during the outage loses it."""
        if isinstance(record, DecisionRecord):
            actions.record(
                Action.DECISION,
                f"{record.context}: {record.previous_arm} -> {record.arm}",
                context=str(record.context),
                arm=record.arm,
                previous_arm=record.previous_arm,
                actor=record.actor,
                reason=record.reason,
                detail=record.detail,
                predicted_speedup=record.predicted_speedup,
                alternatives="; ".join(
                    f"{a.arm} {a.predicted_speedup:.2f} ({a.low:.2f}-{a.high:.2f})"
                    for a in record.alternatives
                )
                or None,
            )
            await self._write(Store.record_decision, record)
        else:
            actions.record(
                Action.ALERT_RAISED,
                f"{record.name}: {record.message}",
                alert=record.name,
                severity=record.severity,
                context=record.context,
            )
            await self._write(Store.record_alert, record)
            self.metrics.alerts.labels(alert=record.name).inc()
            self.notifier.notify(record)  # returns at once; delivered in the background
        if not self.store_reachable:
            await asyncio.to_thread(self.journal.append, record)

    async def _flush(self) -> None:
        """Replay buffered writes; once all reached the store, the journal is redundant."""
        if await asyncio.to_thread(self.writer.flush) and self.journal:
            await asyncio.to_thread(self.journal.clear)

    def _note_store(self, reachable: bool) -> None:
        self.store_reachable = reachable
        self.metrics.store_up.set(1 if reachable else 0)
        self.metrics.store_buffered.set(self.writer.pending_records)

    # -- start, follow, take over --------------------------------------------------------

    def _load(self) -> None:
        """Bring this replica's view up to the store's: arms, freeze flag, learned state
        (after replaying what a crash during an outage left in the journal)."""
        if self.journal:
            self.journal.replay(self.store)
        latest = self.store.latest_decisions()
        for context in self.fleet.contexts:
            decision = latest.get(context)
            if decision is not None and decision.arm not in self.fleet.allowed_arms(context):
                # The fleet settings changed since: start over from what the pools run.
                log.warning("%s: stored arm %s is no longer runnable", context, decision.arm)
                decision = None
                self.arms.pop(context, None)
            if decision is not None:
                self.arms[context] = decision.arm
                self.actors[context] = decision.actor
                self.changed_at[context] = decision.ts
            elif context not in self.arms:
                self.arms[context] = self.fleet.running_arm(context)
                self.actors[context] = "policy"
                self.changed_at[context] = -math.inf
        self.frozen = bool(self.store.get_state(FROZEN_KEY, False))
        self.overrides = self.store.active_overrides(self.clock())
        snapshot = self.store.latest_snapshot()
        if snapshot is not None and snapshot[0] > self._loaded_snapshot_ts:
            self.policy.load_state(snapshot[1])
            self._loaded_snapshot_ts = snapshot[0]

    async def start(self) -> None:
        """Restore from the store (the store was reachable at open)."""
        await self._think(self._load)
        unresolved = await asyncio.to_thread(
            lambda: self.store.alerts(limit=1000, unresolved_only=True)
        )
        self.alerts.restore(unresolved)
        for alert in unresolved:
            if alert.name == OVERRIDE_NOT_RUNNABLE:
                # Resolved at the first pass over the overrides unless it still holds.
                self._bad_overrides.setdefault(f"restored:{alert.context}", alert.context)
        if self.instances is not None:
            self.instances.restore(unresolved)
        self._override_pools.restore(unresolved)
        # Resolved by the first push that succeeds or that the evidence confirms (every
        # pool is pushed again at start).
        self._not_applied = {
            a.context.removeprefix("pool=")
            for a in unresolved
            if a.name == PUSH_NOT_APPLIED and a.context is not None
        }
        self._actuators_failing = {a.context or "" for a in unresolved if a.name == ACTUATOR_FAILED}
        self._exactness_refused = {
            a.context for a in unresolved if a.name == EXACTNESS_BROKEN and a.context
        } - self._exactness_firing
        self.metrics.frozen.set(1 if self.frozen else 0)
        await self._publish_routes()
        await self._publish_estimates()

    async def run(self, stop: asyncio.Event) -> None:
        """Iterate every scrape interval until ``stop`` is set, then shut down cleanly."""
        watcher = asyncio.create_task(self._watch_leadership(stop))
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.tick()
                except Exception:
                    log.exception("control-loop iteration failed")
                    self.metrics.loop_errors.inc()
                self.metrics.loop_duration.observe(time.monotonic() - started)
                self.metrics.loop_iterations.inc()
                await self._sleep(stop)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.shutdown()

    async def _watch_leadership(self, stop: asyncio.Event) -> None:
        """Check leadership every ``leader.check_interval_s``, between iterations too, so a
        follower takes over within seconds of the leader's death, whatever the interval."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.leader.check_interval_s)
            if not self.is_leader and await self._check_leadership():
                self.wake()

    async def _check_leadership(self) -> bool:
        self.is_leader = await asyncio.to_thread(self.leadership.check)
        self.metrics.leader.set(1 if self.is_leader else 0)
        return self.is_leader

    def wake(self) -> None:
        """Run the next iteration now (an operator changed something), not at the interval."""
        self._wake.set()

    async def _sleep(self, stop: asyncio.Event) -> None:
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())}
        _, pending = await asyncio.wait(
            waits, timeout=self.settings.scrape_interval_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        self._wake.clear()

    async def shutdown(self) -> None:
        """Save the learned state, flush buffered writes and close the actuators (a
        managed one stops the vLLM processes it started); SIGTERM ends here."""
        if self.is_leader:
            state, now = await self._think(self.policy.state_dict), self.clock()
            await self._write(Store.save_snapshot, now, state, key=SNAPSHOT_WRITE)
        if self._pushing is not None and not self._pushing.done():
            # A restart in progress: the actuators' close stops what it started.
            self._pushing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pushing
        await self._flush()
        await self.source.aclose()
        if self.instances is not None:
            await self.instances.aclose()
        for actuator in self.actuators:
            close = getattr(actuator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing actuator %s failed", actuator.name)
        await self.notifier.aclose()
        await asyncio.to_thread(self.leadership.release)
        self.is_leader = False
        if self._lane is not None:
            self._lane.shutdown(wait=False)
            self._lane = None

    # -- one iteration -------------------------------------------------------------------

    async def tick(self) -> None:
        tracer = self.tracer
        if tracer is None:
            await self._tick(None)
            return
        with tracer.start_as_current_span("specpilot.loop.tick") as span:
            await self._tick(span)

    async def _tick(self, span: Span | None) -> None:
        now = self.clock()
        await self._check_store_lost(now)
        was_leader = self._acting_as_leader
        self._acting_as_leader = await self._check_leadership()
        if span is not None:
            span.set_attribute("specpilot.leader", self.is_leader)
        if not self.is_leader:
            await self._read(self._load, None)
            await self._hand_over(now)
            await self._actuate_here()
            await self._publish_routes()
            await self._publish_estimates()
            self.last_tick_at = now
            return
        if not was_leader:
            await self._read(self._load, None)  # take-over: continue from the store
            self._push_all = True
            await self._restore_instances()
        await self._flush()

        collected = await self._collect_and_probe(self.source.collect())
        for seen in collected.instances:
            self.running.see(seen)
        await self._settle_pushes()
        await self._think(functools.partial(self._count_routed, collected.routed))
        handed, handed_windows = await self._handed_over()
        observations = [*collected.observations, *handed]
        windows = [*collected.window_observations, *handed_windows]
        await self._store_collected(observations, collected.windows, now)
        self.metrics.observations.inc(sum(round(w.requests) for w in windows))
        # Another replica's API may have frozen the policy; this one's API sets it directly.
        sets = self._frozen_sets
        stored = await self._read(lambda: bool(self.store.get_state(FROZEN_KEY, False)), None)
        if stored is not None and sets == self._frozen_sets:
            self.frozen = stored
        self.metrics.frozen.set(1 if self.frozen else 0)
        if not self.frozen:
            await self._think(functools.partial(self._learn, observations, windows))
        if self.fleet.routing:
            self._tally_routes(observations)
        self.relayed.add(observations)
        for observation in observations:
            self.alerts.note_request(observation)
        for window in windows:
            self.alerts.note_window(window)
        await self._raise_drift()

        self.overrides = await self._read(lambda: self.store.active_overrides(now), self.overrides)
        self.overrides = [o for o in self.overrides if o.active(now)]
        self._log_overrides(now)
        self.metrics.overrides_active.set(len(self.overrides))
        pins = await self._pins(self.overrides, now)
        targets = await self._think(functools.partial(self._targets, pins, now))
        await self._judge_override_pools(pins, now)

        decisions = []
        for context, target in targets:
            if target is not None and target.arm != self.arms.get(context):
                decisions.append(self._decision(context, target, now))
        for decision in decisions:
            await self._record(decision)
            self._apply(decision)
        if span is not None:
            span.set_attributes(
                {
                    "specpilot.observations": len(observations),
                    "specpilot.windows": len(windows),
                    "specpilot.frozen": self.frozen,
                    "specpilot.overrides": len(self.overrides),
                    "specpilot.decisions": len(decisions),
                }
            )
        await self._publish_routes()
        await self._actuate([d.context for d in decisions])
        await self._judge_losing(now)
        self._publish_contexts()
        if self._pushing is None or self._pushing.done():  # never beside a restart
            await self.check_exactness(now)

        await self._measure(now)
        await self._snapshot(now)
        await self._housekeeping(now)
        await self._publish_estimates()
        self.last_tick_at = now

    def _learn(
        self, observations: Sequence[RequestObservation], windows: Sequence[WindowObservation]
    ) -> None:
        """Teach the policy what was collected (in the loop's worker thread)."""
        for observation in observations:
            self.policy.observe(observation)
        for window in windows:
            self.policy.observe_window(window)

    def _targets(
        self, pins: Mapping[Context, Pin], now: float
    ) -> list[tuple[Context, Target | None]]:
        """Every context's target, in the loop's worker thread (deciding plans). The
        iteration waits for it, so it may change the loop's tables as the iteration's
        own code does: the API, running meanwhile, only looks single values up in them."""
        self.policy.set_pins({context: pin.arm for context, pin in pins.items()})
        return [
            (context, self._target(context, pins.get(context), now))
            for context in self.fleet.contexts
        ]

    async def _raise_drift(self) -> None:
        """Every drift the policy detected becomes an ``AcceptanceDrift`` alert; one whose
        acceptance recovered is resolved."""
        raised = []
        for event in await self._think(self.policy.drift):
            alert = self.alerts.drifted(event)
            if alert is not None:
                await self._record(alert)
                raised.append(alert)
        for context, message in self.alerts.recovered():
            await self._resolve(DRIFT, "warning", context, message)
        for alert in self.alerts.firing_drifts():
            if alert not in raised:  # still holds: so the notifier does not let it expire
                self.notifier.notify(alert)

    async def _judge_losing(self, now: float) -> None:
        """``SpeculationLosing`` for contexts whose running arm the policy predicts to
        lose against no speculation (see ``controller.alerting``)."""
        for context in self.fleet.contexts:
            arm = self.running_arm(context)
            seen_arm, predicted = self._running_prediction.get(context, (arm, None))
            alert, resolved = self.alerts.judge(
                context, arm, predicted if seen_arm == arm else None, now
            )
            if alert is not None:
                await self._record(alert)
            if resolved:
                await self._resolve(LOSING, "critical", losing_context(context))

    async def _resolve(
        self, name: str, severity: str, context: str | None, message: str = "resolved"
    ) -> None:
        """An alert that stopped firing: resolved in the store, and to whoever hears."""
        now = self.clock()
        text = f"{name} resolved" if message == "resolved" else f"{name} resolved: {message}"
        actions.record(Action.ALERT_RESOLVED, text, alert=name, context=context)
        await self._write(Store.resolve_alerts, name, context, now)
        self.notifier.notify(
            AlertRecord(now, name, severity, message, context=context, resolved_at=now)
        )

    async def _collect_and_probe(self, collecting: Awaitable[Collected]) -> Collected:
        """Collect while probing the instances (``controller.instances``): raise or
        resolve ``SpecpilotInstanceDown``; a wrong-model instance's windows teach nothing."""
        if self.instances is None:
            return await collecting
        collected, changed = await asyncio.gather(collecting, self.instances.probe())
        for alert in changed.raised:
            await self._record(alert)
        for context in changed.resolved:
            await self._resolve(INSTANCE_DOWN, INSTANCE_DOWN_SEVERITY, context)
        for alert in changed.firing:  # still down: Alertmanager's copy must not lapse
            self.notifier.notify(alert)
        return self.instances.screen(collected)

    async def _restore_instances(self) -> None:
        """Take-over: the instance alerts the last leader raised fire on, not twice."""
        if self.instances is None:
            return
        none: list[AlertRecord] = []
        unresolved = await self._read(
            lambda: self.store.alerts(limit=1000, unresolved_only=True), none
        )
        self.instances.restore(unresolved)

    async def _check_store_lost(self, now: float) -> None:
        """A SQLite file deleted or replaced under the store: say so once, loudly (the
        store refuses every call from then on, so this alert waits in the journal for
        the next start)."""
        lost = await asyncio.to_thread(self.store.check_lost)
        if lost is None or self._store_lost:
            return
        self._store_lost = True
        log.error("store lost: %s; everything it held is gone from where a restart looks", lost)
        await self._record(AlertRecord(now, STORE_LOST, "critical", lost))

    async def _hand_over(self, now: float) -> None:
        """A follower whose source only it sees (its own gateway's requests, its own
        pod's vLLM) hands what it collected to the leader through the store; without
        this, every request a follower's gateway served and every window of its pod
        would be lost to the policy. It stores its windows' stats itself. A source every
        replica sees alike (scraping the fleet) is left to the leader, which reads it."""
        if not self._source_is_exclusive:
            return
        collect = getattr(self.source, "collect_exclusive", self.source.collect)
        collected = await self._collect_and_probe(collect())
        await self._think(functools.partial(self._count_routed, collected.routed))
        handed = [o.to_json() for o in collected.observations]
        handed += [{WINDOW_KEY: w.to_json()} for w in collected.window_observations]
        if handed:
            await self._write(Store.hand_over, handed, now, records=len(handed), droppable=True)
        if collected.windows:
            windows = list(collected.windows)
            await self._write(Store.add_window_stats, windows, records=len(windows), droppable=True)

    def _count_routed(self, routed: Sequence[Routed]) -> None:
        """The requests the gateway routed since, counted by the policy as if it had
        chosen each itself (frozen too: freezing stops learning, not routing)."""
        for request in routed:
            self.policy.routed(request)

    async def _publish_routes(self) -> None:
        """Routing mode: each context's route (an arm no pool runs goes to the off pool)
        for the gateway's workers, who route by it until the next iteration's."""
        if self.routes_to is None:
            return
        self.routes_to(await self._think(self._routing_table))

    def _routing_table(self) -> dict[Context, Route]:
        routed_arm = self.fleet.routed_arm
        table = {}
        for context in self.fleet.contexts:
            route = self.policy.route(context)
            arm = routed_arm(route.arm)
            explore = tuple(
                (routed_arm(other), share, why)
                for other, share, why in route.explore
                if routed_arm(other) != arm
            )
            table[context] = Route(arm, route.reason, explore)
        return table

    @property
    def _source_is_exclusive(self) -> bool:
        """See ``controller.ports.ObservationSource``: replicas share the settings, so
        where the leader's source is not exclusive, no follower hands anything over."""
        return bool(getattr(self.source, "exclusive", False))

    async def _handed_over(self) -> tuple[list[RequestObservation], list[WindowObservation]]:
        """What followers handed over since the last iteration (see ``_hand_over``)."""
        if not self._source_is_exclusive:
            return [], []
        none: list[dict[str, Any]] = []
        taken = await self._read(lambda: self.store.take_handed_over(), none)
        observations, windows = [], []
        for data in taken:
            try:
                if WINDOW_KEY in data:
                    windows.append(WindowObservation.from_json(data[WINDOW_KEY]))
                else:
                    observations.append(RequestObservation.from_json(data))
            except (TypeError, ValueError, KeyError):
                log.warning("dropped a handed-over observation that does not parse: %r", data)
        return observations, windows

    async def _store_collected(
        self, observations: Sequence[RequestObservation], windows: Sequence[Any], now: float
    ) -> None:
        edges = self.settings.buckets
        records = [observation_record(o, edges, now) for o in observations]
        self.metrics.observations.inc(len(records))
        for record in records:
            # Only contexts the fleet serves: stray labels must not grow this without bound.
            if record.tpot_s is not None and record.context in self._known:
                mean = self._tpot.setdefault((record.context, record.arm), _Mean())
                mean.total += record.tpot_s
                mean.count += 1
        if records:
            await self._write(Store.add_observations, records, records=len(records), droppable=True)
        if windows:
            await self._write(Store.add_window_stats, windows, records=len(windows), droppable=True)

    def _log_overrides(self, now: float) -> None:
        """An action line for each override that came into force or ended since the
        last iteration (set or deleted through any replica's API, or expired)."""
        before = self._overrides_logged
        current = self._overrides_logged = {o.id: o for o in self.overrides}
        for override in current.values():
            if override.id not in before:
                actions.record(
                    Action.OVERRIDE_SET,
                    f"override {override.id} in force: {override.reason}",
                    override=override.id,
                    scope="/".join(
                        (override.scope.model, override.scope.workload_class, override.scope.bucket)
                    ),
                    config=_config_text(override.config),
                    expires_in_s=round(override.expires_at - now),
                )
        for override in before.values():
            if override.id not in current:
                why = "expired" if override.expires_at <= now else "deleted"
                actions.record(
                    Action.OVERRIDE_ENDED,
                    f"override {override.id} {why}: {override.reason}",
                    override=override.id,
                    ended=why,
                )

    async def _pins(self, overrides: Sequence[OverrideRecord], now: float) -> dict[Context, Pin]:
        """Which contexts operators pinned: the most specific override wins, then the newest."""
        pins: dict[Context, Pin] = {}
        bad: set[str] = set()
        for override in sorted(overrides, key=lambda o: (o.scope.specificity, o.created_at)):
            contexts = [c for c in self.fleet.contexts if override.scope.matches(c)]
            try:
                arm = self.fleet.resolve_override(override.config, contexts)
            except SpecConfigError as exc:
                # Valid when made, but the fleet settings changed since: say so once.
                bad.add(override.id)
                scope = override.scope
                where = f"{scope.model}/{scope.workload_class}/{scope.bucket}"
                if override.id not in self._bad_overrides:
                    self._bad_overrides[override.id] = where
                    alert = AlertRecord(
                        now,
                        OVERRIDE_NOT_RUNNABLE,
                        "warning",
                        f"override {override.id} ({override.reason}) is ignored: {exc}",
                        context=where,
                    )
                    await self._record(alert)
                continue
            for context in contexts:
                pins[context] = Pin(arm, override)
        await self._resolve_runnable(bad)
        return pins

    async def _judge_override_pools(self, pins: Mapping[Context, Pin], now: float) -> None:
        """``SpecpilotOverridePoolDown`` for each override in force whose pool has no
        instance up: in routing mode the pool running the pinned arm, in push mode the
        pools of the contexts it pins (``controller.override_pools``)."""
        if self.instances is None or not self.instances.probed:
            return
        running = pool_arms(self.settings)
        pools: dict[str, set[str]] = {}
        for context, pin in pins.items():
            serving = pools.setdefault(pin.override.id, set())
            if self.fleet.routing:
                serving.update(name for name, arm in running.items() if arm == pin.arm)
            else:
                serving.update(self.fleet.pools_for(context.model, context.workload_class))
        pinned = {pin.override.id: pin for pin in pins.values()}
        judged = self._override_pools.judge(
            [
                PinnedPools(i, pin.override.reason, pin.arm, frozenset(pools[i]))
                for i, pin in pinned.items()
            ],
            self.instances.pools_down(),
            now,
        )
        for alert in judged.raised:
            await self._record(alert)
        for alert in judged.firing:  # still holds: Alertmanager's copy must not lapse
            self.notifier.notify(alert)
        for where, why in judged.resolved:
            await self._resolve(OVERRIDE_POOL_DOWN, OVERRIDE_POOL_DOWN_SEVERITY, where, why)

    async def _resolve_runnable(self, bad: set[str]) -> None:
        """``OverrideNotRunnable`` resolves once its override is no longer in force
        (expired or deleted) or runs again; an alert shared by overrides of the same
        scope, once none of them is left."""
        cleared = {i: c for i, c in self._bad_overrides.items() if i not in bad}
        for override_id in cleared:
            del self._bad_overrides[override_id]
        for context in set(cleared.values()):
            if context not in self._bad_overrides.values():
                message = "its override expired, was deleted or runs again"
                await self._resolve(OVERRIDE_NOT_RUNNABLE, "warning", context, message)

    def _tally_routes(self, observations: Sequence[RequestObservation]) -> None:
        """Count where each context's requests went (routing mode): on its arm, or on
        another the policy explored. They were routed before this iteration's decisions,
        so they are held against the arms of the previous one. A request that finished
        before its context's arm last changed is not counted, however late it arrives:
        the gateway hands its observations over in batches, and the share is of the
        requests since the change. A request the gateway failed over to another pool
        (its routed pool could not take it) is a failover, not an exploration: counted
        apart, and logged once per iteration per arm and pool."""
        edges = self.settings.buckets
        failovers: Counter[tuple[str, str]] = Counter()
        for observation in observations:
            served = observation.arm or UNKNOWN
            routed = observation.routed_arm or served
            if routed != served:
                failovers[(routed, observation.pool or UNKNOWN)] += 1
            context = context_of(observation, edges)
            if context not in self._known:
                continue
            finished = observation.finished_at
            if finished is not None and finished <= self.changed_at.get(context, -math.inf):
                continue
            share = self.routes.get(context)
            if share is None:
                share = self.routes[context] = RouteShare()
            share.requests += 1
            if routed != served:
                share.failovers += 1
            elif served != self.arms.get(context):
                share.elsewhere += 1
        for (routed, pool), count in sorted(failovers.items()):
            actions.record(
                Action.FAILOVER,
                f"{count} request(s) routed to {routed} served by pool {pool}: its own pool "
                "could not take them",
                routed_arm=routed,
                served_pool=pool,
                requests=count,
            )

    def _publish_contexts(self) -> None:
        """``specpilot_context_*``: each context's arm (what the gateway routes it to in
        routing mode), the share of its requests served elsewhere, vLLM's acceptance of
        its arm (``controller.acceptance``) and the speed-up the policy estimates for it
        now (no series while there is none: an incumbent without evidence, or another
        arm's figure, would be a false one)."""
        metrics = self.metrics
        for context in self.fleet.contexts:
            arm = self.running_arm(context)
            labels = (context.model, context.workload_class, context.bucket)
            shown = self._published.get(context)
            if shown != arm:
                if shown is not None:
                    _remove(metrics.context_arm, *labels, shown)
                metrics.context_arm.labels(*labels, arm).set(1)
                self._published[context] = arm
            share = self.routes.get(context)
            explored = share.explored if share is not None else None
            if explored is not None:
                metrics.explored.labels(*labels).set(explored)
            else:
                _remove(metrics.explored, *labels)
            failed_over = share.failed_over if share is not None else None
            if failed_over is not None:
                metrics.failed_over.labels(*labels).set(failed_over)
            else:
                _remove(metrics.failed_over, *labels)
            measured = self.alerts.book.of_arm(context.model, context.workload_class, arm)
            if measured.acceptance is not None:
                metrics.context_acceptance.labels(*labels).set(measured.acceptance.ratio)
            else:
                _remove(metrics.context_acceptance, *labels)
            seen_arm, predicted = self._running_prediction.get(context, (arm, None))
            if seen_arm == arm and predicted is not None:
                metrics.predicted_speedup.labels(*labels).set(predicted.predicted_speedup)
            else:
                _remove(metrics.predicted_speedup, *labels)

    def _routed_target(self, context: Context, pin: Pin | None) -> Target:
        """Routing mode: the arm the gateway sends the context's requests to, which is
        the policy's committed arm (``select`` serves it, bar exploration), from the
        moment the policy commits it. The loop only records it: the policy's own dwell
        applies, and freezing stops its learning, not its routing."""
        current = self.arms.get(context, self.fleet.running_arm(context))
        choice = self.policy.decide(context, self.fleet.allowed_arms(context), current)
        arm = self.fleet.routed_arm(choice.arm)
        self._running_prediction[context] = (arm, self._predicted(arm, choice))
        if pin is not None and arm == pin.arm:
            return self._pinned(pin, choice)
        target = self._chosen(context, choice)
        if arm != choice.arm:
            detail = f"policy chose {choice.arm} ({choice.reason}); no pool runs it"
            return Target(arm, Reason.NO_POOL, "policy", None, detail, choice.alternatives)
        return target

    def _pinned(self, pin: Pin, choice: ArmChoice | None = None) -> Target:
        override = pin.override
        alternatives = choice.alternatives if choice is not None else ()
        predicted = choice.prediction(pin.arm) if choice is not None else None
        return Target(
            pin.arm,
            Reason.OVERRIDE,
            "operator",
            predicted.predicted_speedup if predicted else None,
            f"override {override.id}: {override.reason}",
            alternatives,
        )

    def _chosen(self, context: Context, choice: ArmChoice) -> Target:
        """The policy's choice as a target; the first one after a pin ended says so."""
        try:
            reason, detail = Reason(choice.reason), choice.detail
        except ValueError:  # a plugged-in policy's own word
            reason, detail = Reason.PLUGIN, ": ".join(filter(None, (choice.reason, choice.detail)))
        if self.actors.get(context) == "operator":
            self.actors[context] = "policy"
            detail = f"then {reason}" + (f": {detail}" if detail else "")
            reason = Reason.OVERRIDE_ENDED
        return Target(
            choice.arm, reason, "policy", choice.predicted_speedup, detail, choice.alternatives
        )

    def _target(self, context: Context, pin: Pin | None, now: float) -> Target | None:
        """What the context should run now, or None to leave it as it is."""
        if self.fleet.routing:
            return self._routed_target(context, pin)
        if pin is not None:
            return self._pinned(pin)
        current = self.running_arm(context)
        released = self.actors.get(context) == "operator"  # it was pinned; the pin is gone
        allowed = self.fleet.allowed_arms(context)
        if released and not self.frozen:
            # The pinned arm is no baseline: the context goes where evidence says, and
            # without any back to the config its pool runs.
            current = self.fleet.running_arm(context)
        choice = self.policy.decide(context, allowed, current)
        if self.frozen:
            # Nothing moves, but what runs is still predicted (and may be losing).
            self._running_prediction[context] = (current, self._predicted(current, choice))
            if released:
                self.actors[context] = "policy"  # the arm stays while frozen
            return None
        if released and not self._has_evidence(context, choice):
            choice = ArmChoice(
                current,
                Reason.NO_EVIDENCE,
                detail="nothing observed yet: the config its pool runs",
                alternatives=choice.alternatives,
            )
        running = self.running_arm(context)
        self._running_prediction[context] = (running, self._predicted(running, choice))
        if choice.arm not in allowed:
            self.metrics.guard_rail_rejections.labels(rule=NOT_RUNNABLE).inc()
            log.warning("%s: policy chose %s, which its pools cannot run", context, choice.arm)
            return None
        dwell = now - self.changed_at.get(context, -math.inf)
        if choice.arm != current and not released and dwell < self.settings.policy.min_dwell_s:
            self.metrics.guard_rail_rejections.labels(rule=MIN_DWELL).inc()
            return None
        return self._chosen(context, choice)

    def running_arm(self, context: Context) -> str:
        """The arm a context runs: in routing mode the arm the gateway sends it to; in
        push mode the arm its pool runs as vLLM's metrics show it (``self.running``),
        whatever was decided and pushed."""
        if self.fleet.routing:
            return self.arms.get(context, self.fleet.running_arm(context))
        names = self.fleet.pools_for(context.model, context.workload_class)
        return self.running.arm(names[0], context.bucket) if names else OFF

    @staticmethod
    def _predicted(arm: str, choice: ArmChoice) -> Alternative | None:
        """The policy's prediction for ``arm`` in the context it chose for: off is 1 by
        definition; a policy that predicts only its choice gives no interval."""
        if arm == OFF:
            return Alternative(OFF, 1.0, 1.0, 1.0)
        predicted = choice.prediction(arm)
        if predicted is None and choice.arm == arm and choice.predicted_speedup is not None:
            speedup = choice.predicted_speedup
            return Alternative(arm, speedup, speedup, speedup)
        return predicted

    def _has_evidence(self, context: Context, choice: ArmChoice) -> bool:
        """Whether the policy's choice rests on anything it saw: a prediction (made from
        a plan of what it observed), or observations of some arm in this context."""
        if choice.predicted_speedup is not None:
            return True
        return any(estimate.observations > 0 for estimate in self.policy.estimates(context))

    def _decision(self, context: Context, target: Target, now: float) -> DecisionRecord:
        return DecisionRecord(
            ts=now,
            context=context,
            arm=target.arm,
            previous_arm=self.arms.get(context),
            reason=target.reason,
            actor=target.actor,
            predicted_speedup=target.predicted_speedup,
            detail=target.detail,
            alternatives=target.alternatives,
        )

    def _apply(self, decision: DecisionRecord) -> None:
        context = decision.context
        baseline = self._tpot.get((context, decision.previous_arm or ""), _Mean()).value
        for key in [k for k in self._tpot if k[0] == context]:
            del self._tpot[key]
        self._pending.pop(context, None)
        self.routes.pop(context, None)
        if baseline is not None:
            self._pending[context] = _Pending(decision.ts, decision.arm, baseline)
        self.arms[context] = decision.arm
        self.actors[context] = decision.actor
        self.changed_at[context] = decision.ts
        self.metrics.decisions.labels(actor=decision.actor).inc()

    async def _actuate(self, changed: Sequence[Context]) -> None:
        """Hand the changed pools' configs to the actuators. A push can take minutes (a
        managed restart starts and canaries a vLLM), so it runs beside the loop: the
        iteration waits for it up to one interval, then goes on collecting and
        deciding; pools that change meanwhile are pushed when it is done."""
        pools = self.fleet.pools if self._push_all else self.fleet.pools_of(changed)
        self._push_all = False
        self._to_push.update(pools)
        if self._pushing is not None and not self._pushing.done():
            return
        if not self._to_push:
            return
        configs = [self.fleet.pool_config(name, self.arms) for name in sorted(self._to_push)]
        self._to_push.clear()
        self._pushing = asyncio.create_task(self._push(configs))
        await asyncio.wait({self._pushing}, timeout=self.settings.scrape_interval_s)

    async def _actuate_here(self) -> None:
        """Per-pod topology, on a follower: hand every pool's config as the leader
        decided it (read from the store) to the actuators each replica runs, which apply
        it to this pod's vLLM (each push beside the loop, as the leader's)."""
        here = [a for a in self.actuators if wrapped(a, RollingRestarts) is not None]
        if not here or (self._pushing is not None and not self._pushing.done()):
            return
        configs = [self.fleet.pool_config(name, self.arms) for name in sorted(self.fleet.pools)]
        self._pushing = asyncio.create_task(self._push(configs, here))
        await asyncio.wait({self._pushing}, timeout=self.settings.scrape_interval_s)

    def pool_target(self, pool: str) -> PoolConfig:
        """The config ``pool`` should run now, by every context's arm."""
        return self.fleet.pool_config(pool, self.arms)

    async def _push(
        self, configs: Sequence[PoolConfig], actuators: Sequence[Actuator] | None = None
    ) -> None:
        actuators = self.actuators if actuators is None else actuators
        tracer = self.tracer
        if tracer is None:
            await self._push_to_all(configs, actuators, None)
            return
        with tracer.start_as_current_span(
            "specpilot.push", attributes=_push_attributes(configs)
        ) as span:
            await self._push_to_all(configs, actuators, tracer)
            span.set_attribute("specpilot.failed", self._push_all)

    async def _push_to_all(
        self, configs: Sequence[PoolConfig], actuators: Sequence[Actuator], tracer: Tracer | None
    ) -> None:
        handed = False
        for actuator in actuators:
            if tracer is None:
                handed |= await self._push_to(actuator, configs)
                continue
            with tracer.start_as_current_span(
                f"specpilot.actuate {actuator.name}",
                attributes={"specpilot.actuator": actuator.name},
            ):
                handed |= await self._push_to(actuator, configs)
        if handed:
            for config in configs:
                await self._pushed(config)

    async def _pushed(self, config: PoolConfig) -> None:
        """A config an actuator took: pending until vLLM's metrics show it running."""
        push = self.running.pushed(config.pool, config.config, self.clock())
        self.metrics.push_applied.labels(pool=config.pool).set(
            1 if push.state is PushState.CONFIRMED else 0
        )
        if push.state is PushState.CONFIRMED:
            await self._push_settled(config.pool, push)

    async def _settle_pushes(self) -> None:
        """Pushes the evidence now confirms, or that it did not confirm in time."""
        for pool, push in self.running.settle():
            await self._push_settled(pool, push)

    async def _push_settled(self, pool: str, push: Push) -> None:
        self.metrics.push_applied.labels(pool=pool).set(
            1 if push.state is PushState.CONFIRMED else 0
        )
        context = f"pool={pool}"
        if push.state is PushState.CONFIRMED:
            actions.record(
                Action.PUSH_CONFIRMED,
                f"{pool}: vLLM reports {push.arm} running",
                pool=pool,
                arm=push.arm,
            )
            if pool in self._not_applied:
                self._not_applied.discard(pool)
                await self._resolve(PUSH_NOT_APPLIED, "warning", context)
            return
        running = self.running.view(pool).running
        waited = (push.settled_at or self.clock()) - push.at
        message = (
            f"pool {pool}: pushed {push.arm}, running {running} (as vLLM's /metrics show it) "
            f"{waited:.0f} s later; nothing applied the push"
        )
        actions.record(
            Action.PUSH_NOT_APPLIED, message, pool=pool, pushed=push.arm, running=running
        )
        if pool not in self._not_applied:
            self._not_applied.add(pool)
            await self._record(
                AlertRecord(self.clock(), PUSH_NOT_APPLIED, "warning", message, context=context)
            )

    async def _push_to(self, actuator: Actuator, configs: Sequence[PoolConfig]) -> bool:
        """Hand ``configs`` to one actuator; whether it took them."""
        try:
            await actuator.apply(configs)
            self.metrics.actuations.labels(actuator=actuator.name, outcome=PUSH_OK).inc()
            await self._push_succeeded(actuator, configs)
            for config in configs:
                actions.record(
                    Action.PUSH,
                    f"{config.pool}: {_config_text(config.config)} handed to {actuator.name}",
                    pool=config.pool,
                    actuator=actuator.name,
                    config=_config_text(config.config),
                    outcome=PUSH_OK,
                )
            return True
        except Exception as exc:
            log.debug("actuator %s failed", actuator.name, exc_info=True)
            for config in configs:
                actions.record(
                    Action.ROLLBACK,
                    f"{config.pool}: {actuator.name} could not apply "
                    f"{_config_text(config.config)}; the old config serves",
                    pool=config.pool,
                    actuator=actuator.name,
                    config=_config_text(config.config),
                    error=" ".join(str(exc).split())[:500] or type(exc).__name__,
                )
            self.metrics.actuations.labels(actuator=actuator.name, outcome=PUSH_ERROR).inc()
            self._push_all = True  # hand everything over again next time
            span = trace.get_current_span()  # the actuator's span when tracing, else a no-op
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            now = self.clock()
            for broken in exactness_failures(exc):
                await self._record(broken.alert(now))
                self._exactness_refused.add(broken.context)
            context = f"actuator={actuator.name}"
            if context not in self._actuators_failing:
                self._actuators_failing.add(context)
                message = f"{actuator.name}: {exc}"
                await self._record(AlertRecord(now, ACTUATOR_FAILED, "critical", message, context))
            return False

    async def _push_succeeded(self, actuator: Actuator, configs: Sequence[PoolConfig]) -> None:
        """An actuator that pushed resolves its ``ActuatorFailed``; a pool it pushed to
        (the managed actuator canaries exactness first) resolves the ``ExactnessBroken``
        a refused push raised: what the pool serves now passed."""
        context = f"actuator={actuator.name}"
        if context in self._actuators_failing:
            self._actuators_failing.discard(context)
            await self._resolve(ACTUATOR_FAILED, "critical", context)
        for config in configs:
            pool = f"pool={config.pool}"
            if pool in self._exactness_refused:
                self._exactness_refused.discard(pool)
                await self._resolve(EXACTNESS_BROKEN, "critical", pool)

    async def check_exactness(self, now: float) -> None:
        """Every ``canary.interval_s``, the managed pools' greedy output against their
        no-speculation reference: ``ExactnessBroken`` while a pool differs, resolved by
        the next check it passes (``controller.exactness``)."""
        for checker in self._exactness_checkers():
            for result in await checker.check_due(now):
                context = result.context
                if result.broken is not None:
                    await self._record(result.broken.alert(now))
                    self._exactness_firing.add(context)
                elif context in self._exactness_firing:
                    self._exactness_firing.discard(context)
                    await self._resolve(EXACTNESS_BROKEN, "critical", context)

    def _exactness_checkers(self) -> list[ExactnessChecker]:
        kind: Any = ExactnessChecker  # a runtime-checkable Protocol
        found = (wrapped(actuator, kind) for actuator in self.actuators)
        return [checker for checker in found if checker is not None]

    async def _measure(self, now: float) -> None:
        wait = self.settings.policy.measure_after_s
        for context, pending in list(self._pending.items()):
            if now - pending.decided_at < wait:
                continue
            mean = self._tpot.get((context, pending.arm))
            if mean is None or mean.count < MIN_MEASURED_REQUESTS or not mean.value:
                continue
            speedup = pending.baseline_tpot_s / mean.value
            del self._pending[context]
            await self._write(Store.set_measured_speedup, context, pending.decided_at, speedup)

    async def _snapshot(self, now: float) -> None:
        if now - self._snapshot_ts < self.settings.store.snapshot_interval_s:
            return
        self._snapshot_ts = now
        state = await self._think(self.policy.state_dict)
        await self._write(Store.save_snapshot, now, state, droppable=True, key=SNAPSHOT_WRITE)

    async def _housekeeping(self, now: float) -> None:
        if now - self._housekeeping_at < HOUSEKEEPING_EVERY_S:
            return
        self._housekeeping_at = now
        store = self.settings.store

        def clean() -> None:
            for _ in range(MAX_ROLLUP_BATCHES):  # bounded work per pass; the rest next time
                moved = self.store.roll_up(
                    now, store.observation_retention_s, store.rollup_period_s
                )
                if moved < ROLLUP_BATCH:
                    break
            self.store.purge_window_stats(now - store.observation_retention_s)
            self.store.purge_handed_over(now - store.observation_retention_s)

        await self._read(clean, None)


def _start_counters(metrics: ServiceMetrics, actuators: Sequence[Actuator]) -> None:
    """Every labelled counter the loop knows the labels of, at 0: a series born at 1 shows
    no ``increase()`` in Prometheus (the first alert, decision or push would be missed),
    and a panel of events that have not happened shows 0 rather than nothing."""
    for name in ALERT_NAMES:
        metrics.alerts.labels(alert=name)
    for actor in get_args(Actor):
        metrics.decisions.labels(actor=actor)
    for rule in (NOT_RUNNABLE, MIN_DWELL):
        metrics.guard_rail_rejections.labels(rule=rule)
    for actuator in actuators:
        for outcome in (PUSH_OK, PUSH_ERROR):
            metrics.actuations.labels(actuator=actuator.name, outcome=outcome)


def _remove(gauge: Any, *labels: str) -> None:
    """Drop one labelled series, if it is there (a context no longer showing it)."""
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


def _config_text(config: Mapping[str, Any] | None) -> str:
    return "off" if config is None else json.dumps(config, sort_keys=True, separators=(",", ":"))


def _push_attributes(configs: Sequence[PoolConfig]) -> dict[str, str | Sequence[str]]:
    return {
        "specpilot.pools": [c.pool for c in configs],
        "specpilot.configs": [_config_text(c.config) for c in configs],
    }
