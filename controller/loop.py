"""The control loop: every interval, collect → learn → decide → override and guard → act → record.

One iteration (``tick``) on the leader:

1. collect what the collectors saw since the last iteration, and store it (buffered:
   observations are the one thing a crash or a long outage may lose);
2. unless frozen, let the policy learn from the new observations;
3. for every context, take the operator's pin if an override covers it, else the
   policy's choice, subject to the guard rails (the arm must be runnable on every pool
   serving the context; a context changes arm at most once per ``min_dwell_s``);
4. record every change as a decision — synchronously, before anything is pushed, so a
   crash can never have acted on a decision the audit log does not have;
5. hand the pools whose effective config changed to the actuators;
6. measure what earlier decisions bought (mean time per output token under the
   previous arm over the one under the new arm, once ``measure_after_s`` has passed),
   snapshot the learned state, and roll old observations up.

A follower only reloads state from the store (the newest snapshot, decisions, the
freeze flag), so its API serves fresh reads and a take-over starts warm.

Store calls run in worker threads so the API shares the event loop undisturbed. A
store that cannot be reached does not stop the loop: reads fall back to what was last
read, writes wait in the bounded ``BufferedWriter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from collectors.observations import RequestObservation
from controller.actuators.base import Actuator
from controller.contexts import Context, bucket_of
from controller.fleet import Fleet
from controller.ports import ControlPolicy, ObservationSource
from controller.settings import Settings
from controller.specconfig import SpecConfigError
from controller.store.buffer import BufferedWriter
from controller.store.db import ROLLUP_BATCH, Store, is_unavailable
from controller.store.journal import Journal
from controller.store.leader import Leadership
from controller.store.records import (
    Actor,
    AlertRecord,
    DecisionRecord,
    ObservationRecord,
    OverrideRecord,
)
from controller.telemetry import ServiceMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
Clock = Callable[[], float]

FROZEN_KEY = "frozen"
UNKNOWN = "unknown"
HOUSEKEEPING_EVERY_S = 60.0
MAX_ROLLUP_BATCHES = 20
MIN_MEASURED_REQUESTS = 3
"""Requests under a new arm before its speed-up is taken as measured."""


@dataclass(frozen=True, slots=True)
class Target:
    arm: str
    reason: str
    actor: Actor
    predicted_speedup: float | None = None


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
        self._known = frozenset(fleet.contexts)
        # What the API reads (this replica's view).
        self.arms: dict[Context, str] = {}
        self.actors: dict[Context, Actor] = {}
        self.changed_at: dict[Context, float] = {}
        self.frozen = False
        self.is_leader = False
        self.overrides: list[OverrideRecord] = []
        self.last_tick_at: float | None = None
        self.store_reachable = True
        # Bookkeeping of the leader.
        self._tpot: dict[tuple[Context, str], _Mean] = {}
        self._pending: dict[Context, _Pending] = {}
        self._bad_overrides: set[str] = set()
        self._snapshot_ts = -math.inf
        self._loaded_snapshot_ts = -math.inf
        self._housekeeping_at = -math.inf
        self._push_all = True
        self._wake = asyncio.Event()
        self._acting_as_leader = False
        """Whether the previous iteration ran as leader (a change means: take over)."""

    # -- store access that survives outages ---------------------------------------------

    async def _read(self, read: Callable[[], T], fallback: T) -> T:
        """Run a store read in a thread; on an outage return ``fallback``."""
        try:
            value = await asyncio.to_thread(read)
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
    ) -> None:
        """``method(store, *args)`` now, or buffered if the store is away."""
        reached = await asyncio.to_thread(
            self.writer.write,
            lambda store: method(store, *args),
            records=records,
            droppable=droppable,
        )
        self._note_store(reached)

    async def _record(self, record: DecisionRecord | AlertRecord) -> None:
        """Store a decision or alert before acting on it; if the store is away, also
        journal it on local disk so that not even a crash during the outage loses it."""
        if isinstance(record, DecisionRecord):
            await self._write(Store.record_decision, record)
        else:
            await self._write(Store.record_alert, record)
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
        await asyncio.to_thread(self._load)
        self.metrics.frozen.set(1 if self.frozen else 0)

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
            state, now = self.policy.state_dict(), self.clock()
            await self._write(Store.save_snapshot, now, state)
        await self._flush()
        await self.source.aclose()
        for actuator in self.actuators:
            close = getattr(actuator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing actuator %s failed", actuator.name)
        await asyncio.to_thread(self.leadership.release)
        self.is_leader = False

    # -- one iteration -------------------------------------------------------------------

    async def tick(self) -> None:
        now = self.clock()
        was_leader = self._acting_as_leader
        self._acting_as_leader = await self._check_leadership()
        if not self.is_leader:
            await self._read(self._load, None)
            await self._hand_over(now)
            self.last_tick_at = now
            return
        if not was_leader:
            await self._read(self._load, None)  # take-over: continue from the store
            self._push_all = True
        await self._flush()

        collected = await self.source.collect()
        observations = [*collected.observations, *await self._handed_over()]
        await self._store_collected(observations, collected.windows, now)
        self.frozen = await self._read(
            lambda: bool(self.store.get_state(FROZEN_KEY, False)), self.frozen
        )
        self.metrics.frozen.set(1 if self.frozen else 0)
        if not self.frozen:
            for observation in observations:
                self.policy.observe(observation)

        self.overrides = await self._read(lambda: self.store.active_overrides(now), self.overrides)
        self.overrides = [o for o in self.overrides if o.active(now)]
        self.metrics.overrides_active.set(len(self.overrides))
        pins = await self._pins(self.overrides, now)
        self.policy.set_pins({context: pin.arm for context, pin in pins.items()})

        decisions = []
        for context in self.fleet.contexts:
            target = self._target(context, pins.get(context), now)
            if target is not None and target.arm != self.arms.get(context):
                decisions.append(self._decision(context, target, now))
        for decision in decisions:
            await self._record(decision)
            self._apply(decision)
        await self._actuate([d.context for d in decisions])

        await self._measure(now)
        await self._snapshot(now)
        await self._housekeeping(now)
        self.last_tick_at = now

    async def _hand_over(self, now: float) -> None:
        """A follower whose source only it sees (its own gateway's requests) hands what
        it collected to the leader through the store; without this, every request a
        follower's gateway served would be lost to the policy. A source every replica
        sees alike (scraping the fleet) is left to the leader, which reads it itself."""
        if not self._source_is_exclusive:
            return
        collected = await self.source.collect()
        if collected.observations:
            handed = [o.to_json() for o in collected.observations]
            await self._write(Store.hand_over, handed, now, records=len(handed), droppable=True)

    @property
    def _source_is_exclusive(self) -> bool:
        """See ``controller.ports.ObservationSource``: replicas share the settings, so
        where the leader's source is not exclusive, no follower hands anything over."""
        return bool(getattr(self.source, "exclusive", False))

    async def _handed_over(self) -> list[RequestObservation]:
        """What followers handed over since the last iteration (see ``_hand_over``)."""
        if not self._source_is_exclusive:
            return []
        none: list[dict[str, Any]] = []
        taken = await self._read(lambda: self.store.take_handed_over(), none)
        observations = []
        for data in taken:
            try:
                observations.append(RequestObservation.from_json(data))
            except (TypeError, ValueError):
                log.warning("dropped a handed-over observation that does not parse: %r", data)
        return observations

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

    async def _pins(self, overrides: Sequence[OverrideRecord], now: float) -> dict[Context, Pin]:
        """Which contexts operators pinned: the most specific override wins, then the newest."""
        pins: dict[Context, Pin] = {}
        for override in sorted(overrides, key=lambda o: (o.scope.specificity, o.created_at)):
            contexts = [c for c in self.fleet.contexts if override.scope.matches(c)]
            try:
                arm = self.fleet.resolve_override(override.config, contexts)
            except SpecConfigError as exc:
                # Valid when made, but the fleet settings changed since: say so once.
                if override.id not in self._bad_overrides:
                    self._bad_overrides.add(override.id)
                    alert = AlertRecord(
                        now,
                        "OverrideNotRunnable",
                        "warning",
                        f"override {override.id} ({override.reason}) is ignored: {exc}",
                    )
                    await self._record(alert)
                continue
            for context in contexts:
                pins[context] = Pin(arm, override)
        return pins

    def _target(self, context: Context, pin: Pin | None, now: float) -> Target | None:
        """What the context should run now, or None to leave it as it is."""
        if pin is not None:
            return Target(pin.arm, f"override {pin.override.id}: {pin.override.reason}", "operator")
        current = self.arms.get(context, self.fleet.running_arm(context))
        released = self.actors.get(context) == "operator"  # it was pinned; the pin is gone
        if self.frozen:
            if released:
                self.actors[context] = "policy"  # the arm stays while frozen
            return None
        allowed = self.fleet.allowed_arms(context)
        choice = self.policy.decide(context, allowed, current)
        if choice.arm not in allowed:
            self.metrics.guard_rail_rejections.labels(rule="not_runnable").inc()
            log.warning("%s: policy chose %s, which its pools cannot run", context, choice.arm)
            return None
        dwell = now - self.changed_at.get(context, -math.inf)
        if choice.arm != current and not released and dwell < self.settings.policy.min_dwell_s:
            self.metrics.guard_rail_rejections.labels(rule="min_dwell").inc()
            return None
        reason = choice.reason
        if released:
            reason = f"operator override ended; {reason}"
            self.actors[context] = "policy"
        return Target(choice.arm, reason, "policy", choice.predicted_speedup)

    def _decision(self, context: Context, target: Target, now: float) -> DecisionRecord:
        return DecisionRecord(
            ts=now,
            context=context,
            arm=target.arm,
            previous_arm=self.arms.get(context),
            reason=target.reason,
            actor=target.actor,
            predicted_speedup=target.predicted_speedup,
        )

    def _apply(self, decision: DecisionRecord) -> None:
        context = decision.context
        baseline = self._tpot.get((context, decision.previous_arm or ""), _Mean()).value
        for key in [k for k in self._tpot if k[0] == context]:
            del self._tpot[key]
        self._pending.pop(context, None)
        if baseline is not None:
            self._pending[context] = _Pending(decision.ts, decision.arm, baseline)
        self.arms[context] = decision.arm
        self.actors[context] = decision.actor
        self.changed_at[context] = decision.ts
        self.metrics.decisions.labels(actor=decision.actor).inc()
        if decision.predicted_speedup is not None:
            labels = (context.model, context.workload_class, context.bucket)
            self.metrics.predicted_speedup.labels(*labels).set(decision.predicted_speedup)

    async def _actuate(self, changed: Sequence[Context]) -> None:
        pools = self.fleet.pools if self._push_all else self.fleet.pools_of(changed)
        configs = [self.fleet.pool_config(name, self.arms) for name in sorted(pools)]
        if not configs:
            return
        self._push_all = False
        for actuator in self.actuators:
            try:
                await actuator.apply(configs)
                self.metrics.actuations.labels(actuator=actuator.name, outcome="ok").inc()
            except Exception as exc:
                log.exception("actuator %s failed", actuator.name)
                self.metrics.actuations.labels(actuator=actuator.name, outcome="error").inc()
                self._push_all = True  # hand everything over again next time
                alert = AlertRecord(
                    self.clock(), "ActuatorFailed", "critical", f"{actuator.name}: {exc}"
                )
                await self._record(alert)

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
        state = self.policy.state_dict()
        await self._write(Store.save_snapshot, now, state, droppable=True)

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
