"""What the bandit learns from finished requests and ``/metrics`` windows: acceptance
per model × class × proposer with its change detector, the step cost per model with
the batch composition it is fitted on, the traffic mix, the time outside decode, and
the concurrency each bucket runs at."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from collectors.observations import RequestObservation, SpecDecodeRequestStats, WindowObservation
from policies.arms import OFF, Arm, Context
from policies.bandit.config import DEFAULT_CLASS, DEFAULT_MODEL, ArmFit, BanditConfig
from policies.estimators import (
    AcceptanceModel,
    BatchTracker,
    ChangeDetector,
    ChangeEvent,
    StepCostModel,
)
from policies.fleet import engine_of

_OVERHEAD_WINDOW = 64
"""Requests whose time outside vLLM's decode sets the median that caps it."""
_OVERHEAD_MIN_SEEN = 3
_OVERHEAD_CAP = 4.0
"""A request's time outside decode counts up to this many times the recent median."""

_SERVED_BACKLOG = 4096
"""Served requests queued at most before the request path accounts for them itself."""

Moved = list[tuple[tuple[str, str], float]]
"""(model, bucket) and its new concurrency estimate, in the order they were made."""


def steps_taken(spec: SpecDecodeRequestStats, output_tokens: int | None) -> int | None:
    """The engine steps that emitted a speculating request's tokens, the first included.

    vLLM's ``num_drafts`` counts only the verify steps that carried drafts; an n-gram
    proposer finds none where the text so far has no earlier match, and such a step
    emits one token at one position's cost. Every step emits 1 + its accepted tokens
    (the prefill's, which makes the first token, accepts none), so a request took
    ``output - accepted`` of them, as an unspeculated one took ``output``. Counting
    drafted steps alone spreads its time over too few steps (its step cost looks
    dearer) and its acceptance over too few chances (it looks higher): on the
    testbed's code prompts 11 of a request's 17 decode steps drafted. Never fewer than
    ``num_drafts``: an engine whose first step drafts too (the simulator) or that
    counts accepted tokens past the request's end gives less. None where vLLM did not
    say."""
    if spec.num_drafts is None or output_tokens is None:
        return None
    accepted = spec.num_accepted_tokens
    if accepted is None and spec.accepted_per_position is not None:
        accepted = sum(spec.accepted_per_position)
    if accepted is None:
        return None
    return max(spec.num_drafts, output_tokens - accepted)


def _parsed(arm: str | None) -> Arm | None:
    try:
        return Arm.parse(arm) if arm else None
    except ValueError:
        return None


class Learning:
    """Everything learned from evidence, with the bookkeeping that attributes it."""

    def __init__(self, config: BanditConfig, gammas: dict[str, list[int]]) -> None:
        self.config = config
        self.gammas = gammas
        self.proposers = tuple(sorted(gammas))
        self.acceptance: dict[tuple[str, str, str], AcceptanceModel] = {}
        self.detectors: dict[tuple[str, str, str], ChangeDetector] = {}
        """Per model × class × proposer: position-0 acceptance per chance to draft."""
        self.drift_detectors: dict[tuple[str, str, str], ChangeDetector] = {}
        """Per model × class × proposer: position-0 acceptance per drafted step (the
        drifts reported as ``change_events``)."""
        self.cost: dict[str, StepCostModel] = {}
        self.trackers: dict[tuple[str, str], BatchTracker] = {}
        """Per (model, engine): the batch composition the policy assigned."""
        self.token_shares: dict[str, dict[str, float]] = {}
        self.shares_at: dict[str, float] = {}
        self.overheads: dict[str, deque[float]] = {}
        """Per model: recent requests' end-to-end time outside vLLM's decode (seconds)."""
        self.bucket_concurrency: dict[tuple[str, str], float] = {}
        self.pending_concurrency: dict[str, tuple[float, list[str]]] = {}
        """Per model: buckets of requests served at one instant, whose concurrency is
        read once time moves on (see ``settle_concurrency``)."""
        self.observations: dict[str, int] = {}
        self.change_events: list[ChangeEvent] = []
        self.served: list[tuple[Context, Arm, float]] = []
        """Requests served and not yet accounted for (see :meth:`serve`)."""

    # -- evidence ------------------------------------------------------------------

    def observe(
        self, observation: RequestObservation, now: float
    ) -> tuple[Moved, tuple[str, str] | None] | None:
        """Learn from one finished request. None where its arm does not parse; else the
        buckets whose concurrency moved and the (model, class) whose acceptance changed."""
        model = observation.model or DEFAULT_MODEL
        cls = observation.workload_class or DEFAULT_CLASS
        try:
            arm = Arm.parse(observation.arm) if observation.arm else OFF
        except ValueError:
            return None
        # The request left its batch when it finished, not when its observation
        # arrived: a gateway hands observations over in batches, up to a loop interval
        # later, and counting a request in flight until then inflates every batch the
        # policy believes it saw (in the demo's routing mode, a 40-stream rush read as
        # 130 in flight and the knee as eight times higher than the engines' own). So
        # the requests served before it finished are accounted for first, the ones
        # served after it later.
        end = now
        if observation.finished_at is not None and observation.finished_at < now:
            end = observation.finished_at
        moved = self.catch_up(until=end) + self.settle_concurrency(model, end)
        # A request a gateway failed over was counted on the arm it was routed to.
        routed = _parsed(observation.routed_arm)
        counted = routed if routed is not None else arm
        self.tracker(model, counted).remove(counted, end)
        tracker = self.tracker(model, arm)
        self._learn_cost(model, arm, observation, tracker, now)
        self._learn_mix(model, cls, observation, now)
        self.observations[model] = self.observations.get(model, 0) + 1
        spec = observation.spec
        changed = None
        if (
            arm.proposer is not None
            and spec is not None
            and spec.num_drafts
            and spec.accepted_per_position is not None
        ):
            # The chances to draft: every step but the prefill's (where that is a step).
            taken = steps_taken(spec, observation.output_tokens)
            steps = spec.num_drafts if taken is None else max(spec.num_drafts, taken - 1)
            if self.learn_acceptance(
                model,
                cls,
                arm.proposer,
                spec.accepted_per_position,
                steps,
                now,
                drafted=spec.num_drafts,
            ):
                changed = (model, cls)
        return moved, changed

    def observe_window(
        self, window: WindowObservation, arms: Sequence[Arm], now: float
    ) -> tuple[Moved, tuple[str, str] | None] | None:
        """Learn from a worker's ``/metrics`` window: acceptance, step cost, mix and
        drift as from its requests, weighted as the requests it covers.

        The batch composition comes from the window itself (its mean running requests
        on the arm its config runs), not from requests this policy served: a worker
        whose clients reach it directly was never asked.
        """
        model = window.model or DEFAULT_MODEL
        cls = window.workload_class or DEFAULT_CLASS
        try:
            arm = Arm.parse(window.arm) if window.arm else OFF
        except ValueError:
            return None
        if arm not in arms:
            return None
        weight = max(window.requests, 1.0)
        moved = self.catch_up() + self.learn_window_concurrency(model, window.running, weight)
        if window.step_s is not None and window.step_s > 0 and window.running:
            cost = self.cost_model(model)
            depth = {} if arm.proposer is None else {arm.proposer: arm.gamma}
            rows = cost.features(max(window.running, 1.0) * arm.verify_tokens, depth)
            cost.update(rows, window.step_s, now, weight=weight)
        shares = self.token_shares.setdefault(model, {})
        last = self.shares_at.get(model)
        if last is not None and now > last:
            factor = 0.5 ** ((now - last) / self.config.half_life_s)
            for key in shares:
                shares[key] *= factor
        self.shares_at[model] = now
        shares[cls] = shares.get(cls, 0.0) + window.generation_tokens
        self.observations[model] = self.observations.get(model, 0) + max(1, round(weight))
        # The chances to draft: every step but each request's prefill step. A window
        # that drafted nothing (n-gram found no match in sampled text) is evidence too:
        # no token accepted in all those chances, which is what its traffic gets.
        chances = max(window.drafts, window.steps - window.requests)
        changed = None
        if (
            arm.proposer is not None
            and chances > 0
            and window.accepted_per_position
            and self.learn_acceptance(
                model,
                cls,
                arm.proposer,
                window.accepted_per_position,
                chances,
                now,
                requests=weight,
                drafted=window.drafts,
            )
        ):
            changed = (model, cls)
        return moved, changed

    def learn_window_concurrency(self, model: str, running: float | None, weight: float) -> Moved:
        """A window's mean batch, as ``weight`` requests' samples of their bucket."""
        if running is None or running <= 0:
            return []
        bucket = self.config.buckets.bucket(max(1, round(running)))
        key = (model, bucket)
        previous = self.bucket_concurrency.get(key)
        keep = 0.98**weight
        estimate = running if previous is None else keep * previous + (1 - keep) * running
        self.bucket_concurrency[key] = estimate
        return [(key, estimate)]

    def serve(self, context: Context, arm: Arm, now: float) -> Moved:
        """A request of ``context`` starts on ``arm`` now. Queued: :meth:`catch_up`
        accounts for it (batch composition, concurrency) before anything reads them,
        in the order events happened, so the request path does none of that work.
        Only a backlog of ``_SERVED_BACKLOG`` is accounted for here."""
        self.served.append((context, arm, now))
        return self.catch_up() if len(self.served) >= _SERVED_BACKLOG else []

    def catch_up(self, until: float | None = None) -> Moved:
        """Account for the requests served since last time, in order (``until``: only
        those served by then; the rest stay queued)."""
        moved: Moved = []
        served, self.served = self.served, []
        if until is not None and any(at > until for _, _, at in served):
            self.served = [event for event in served if event[2] > until]
            served = [event for event in served if event[2] <= until]
        for context, arm, at in served:
            moved += self.settle_concurrency(context.model, at)
            self.tracker(context.model, arm).add(arm, at)
            pending = self.pending_concurrency.setdefault(context.model, (at, []))
            pending[1].append(context.bucket)
        return moved

    def settle_concurrency(self, model: str, now: float) -> Moved:
        """Record the concurrency the requests served at an earlier instant started with.

        Requests that start together see each other in flight: a burst served one by
        one at one instant (a closed loop's concurrency stepping up) must not read 7,
        8, …, 48 in flight when all 48 run together. So a served request's bucket is
        sampled at the next event after its instant, before that event changes the
        batch. Each sample is clipped to its bucket's range (the caller bucketed the
        request by its own count of what is in flight, which is authoritative), and a
        bucket whose estimate moves by more than 10 % is re-planned (by the caller).
        """
        pending = self.pending_concurrency.get(model)
        if pending is None or now <= pending[0]:
            return []
        del self.pending_concurrency[model]
        moved: Moved = []
        in_flight = float(self.in_flight(model))
        edges = self.config.buckets.lower_edges
        for bucket in pending[1]:
            index = self.config.buckets.labels.index(bucket)
            high = edges[index + 1] - 1 if index + 1 < len(edges) else math.inf
            sample = min(max(in_flight, float(edges[index])), high)
            key = (model, bucket)
            previous = self.bucket_concurrency.get(key)
            estimate = sample if previous is None else 0.98 * previous + 0.02 * sample
            self.bucket_concurrency[key] = estimate
            moved.append((key, estimate))
        return moved

    def concurrency(self, model: str, bucket: str) -> float:
        observed = self.bucket_concurrency.get((model, bucket))
        return observed if observed is not None else self.config.buckets.representative(bucket)

    # -- models --------------------------------------------------------------------

    def cost_model(self, model: str) -> StepCostModel:
        cost = self.cost.get(model)
        if cost is None:
            cost = self.cost[model] = self._new_cost_model()
        return cost

    def _new_cost_model(self) -> StepCostModel:
        return StepCostModel(
            self.proposers,
            half_life_s=self.config.half_life_s,
            draft_cost_prior=self.config.draft_cost_prior,
        )

    def tracker(self, model: str, arm: Arm) -> BatchTracker:
        """The batch a request of ``model`` on ``arm`` joins (see ``topology``)."""
        key = (model, engine_of(arm, self.config.topology))
        tracker = self.trackers.get(key)
        if tracker is None:
            tracker = self.trackers[key] = BatchTracker(self.cost_model(model))
        return tracker

    def in_flight(self, model: str) -> int:
        return sum(t.in_flight for (m, _), t in self.trackers.items() if m == model)

    def acceptance_model(self, key: tuple[str, str, str]) -> AcceptanceModel:
        model = self.acceptance.get(key)
        if model is None:
            model = self.acceptance[key] = AcceptanceModel(
                max(self.gammas[key[2]]),
                half_life_s=self.config.half_life_s,
                trials_per_request=self.config.trials_per_request,
            )
        return model

    def mature(self, context: Context, arm: Arm) -> bool:
        """Whether the class × proposer acceptance of ``arm`` rests on enough requests."""
        if arm.proposer is None:
            return True
        key = (context.model, context.workload_class, arm.proposer)
        model = self.acceptance.get(key)
        return model is not None and model.requests >= self.config.min_evidence_requests

    def _learn_cost(
        self,
        model: str,
        arm: Arm,
        observation: RequestObservation,
        tracker: BatchTracker,
        now: float,
    ) -> None:
        spec = observation.spec
        steps = observation.output_tokens
        if arm.proposer is not None and spec is not None:
            steps = steps_taken(spec, observation.output_tokens) or spec.num_drafts
        if not steps or steps < 2:
            return
        # A gateway's end-to-end time is what the client paid, queueing and prefill
        # included (where an engine is past its capacity, waiting is the cost); vLLM's
        # own decode time per step is the fallback.
        if observation.e2e_s is not None and observation.e2e_s > 0:
            duration = observation.e2e_s
            per_step = self._charged_e2e(model, observation) / steps
        elif observation.generation_time_s is not None and observation.generation_time_s > 0:
            duration = observation.generation_time_s
            per_step = duration / (steps - 1)
        else:
            return
        end = observation.finished_at if observation.finished_at is not None else now
        rows = tracker.mean_rows(end - duration, end)
        if rows is None:
            return
        self.cost_model(model).update(rows, per_step, now)

    def _charged_e2e(self, model: str, observation: RequestObservation) -> float:
        """A request's end-to-end time with its part outside vLLM's decode capped at
        ``_OVERHEAD_CAP`` times the median of the model's last ``_OVERHEAD_WINDOW``.

        That part (queueing, prefill, the hops to and from the engine) is charged
        because past an engine's capacity it is where speculation's cost shows, and it
        moves with load for every request alike. But it also holds one-off costs that
        belong to no arm, and a request divides it by its own steps, few for a
        speculating arm: on the real testbed the first request to a fresh n-gram engine
        waited 1.8 s for its kernels to compile (40 ms otherwise), and that one
        request, spread over 16 verify steps, outweighed twenty normal ones in the
        step-cost fit and kept a 1.7× faster arm off (tests/e2e/test_loop_vllm.py).
        """
        e2e_s = observation.e2e_s
        assert e2e_s is not None
        decode = observation.generation_time_s
        if decode is None or not 0.0 < decode <= e2e_s:
            return e2e_s
        overhead = e2e_s - decode
        recent = self.overheads.setdefault(model, deque(maxlen=_OVERHEAD_WINDOW))
        cap = (
            _OVERHEAD_CAP * statistics.median(recent)
            if len(recent) >= _OVERHEAD_MIN_SEEN
            else math.inf
        )
        recent.append(overhead)
        return decode + min(overhead, cap)

    def _learn_mix(self, model: str, cls: str, observation: RequestObservation, now: float) -> None:
        shares = self.token_shares.setdefault(model, {})
        last = self.shares_at.get(model)
        if last is not None:
            factor = 0.5 ** ((now - last) / self.config.half_life_s) if now > last else 1.0
            for key in shares:
                shares[key] *= factor
        self.shares_at[model] = now
        shares[cls] = shares.get(cls, 0.0) + float(observation.output_tokens or 1)

    def learn_acceptance(
        self,
        model: str,
        cls: str,
        proposer: str,
        per_position: Sequence[float],
        num_drafts: float,
        now: float,
        *,
        requests: float = 1.0,
        drafted: float | None = None,
    ) -> bool:
        """Learn acceptance; True where a change detector fired (the caller re-plans
        the model's buckets and lets the class's commitments move).

        ``num_drafts`` counts the chances to draft (steps that drafted nothing too);
        ``drafted`` the steps that did (vLLM's ``num_drafts``; ``num_drafts`` when not
        given). Two detectors read position 0:

        - per chance (``detectors``): what the speed-up model rests on, so when it
          moves, drafting or acceptance, what was learned is dropped and relearned;
        - per drafted step (``drift_detectors``): vLLM's position-0 acceptance, the
          drift. Evidence that drafted nothing (n-gram finds no match in prose) says
          nothing about acceptance: it neither feeds nor fires this one, so a fall of
          drafting is never reported as a fall of acceptance (``change_events``).
        """
        key = (model, cls, proposer)
        acceptance = self.acceptance_model(key)
        drafted = num_drafts if drafted is None else drafted
        drifted = False
        if drafted > 0 and per_position:
            drift = self.drift_detectors.setdefault(key, ChangeDetector())
            first_drafted = min(1.0, per_position[0] / drafted)
            drifted = drift.update(first_drafted)
            if drifted:
                self.change_events.append(
                    ChangeEvent(
                        now,
                        model,
                        cls,
                        proposer,
                        float(drift.baseline or 0.0),
                        float(drift.recent or first_drafted),
                    )
                )
                drift.reset()
        detector = self.detectors.setdefault(key, ChangeDetector())
        first = per_position[0] / num_drafts if per_position else 0.0
        moved = detector.update(first)
        if moved or drifted:
            acceptance.reset()
            detector.reset()
        acceptance.update(per_position, num_drafts, now, requests=requests)
        return moved or drifted

    # -- persistence ---------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """What was learned, JSON-able. The time-integrated batch history that
        attributes step times to requests is not saved: requests in flight across a
        restore teach acceptance, not cost."""
        return {
            "acceptance": [[list(k), m.to_state()] for k, m in sorted(self.acceptance.items())],
            "detectors": [[list(k), d.to_state()] for k, d in sorted(self.detectors.items())],
            "drift_detectors": [
                [list(k), d.to_state()] for k, d in sorted(self.drift_detectors.items())
            ],
            "cost": {m: c.to_state() for m, c in sorted(self.cost.items())},
            "in_flight": self._in_flight_state(),
            "token_shares": {m: dict(s) for m, s in sorted(self.token_shares.items())},
            "shares_at": dict(self.shares_at),
            "overheads": {m: list(o) for m, o in sorted(self.overheads.items())},
            "bucket_concurrency": [
                [list(k), v] for k, v in sorted(self.bucket_concurrency.items())
            ],
            "observations": dict(self.observations),
            "change_events": [asdict(e) for e in self.change_events],
        }

    def _in_flight_state(self) -> dict[str, dict[str, int]]:
        """Requests in flight per model and arm, whatever engines they sit in."""
        out: dict[str, dict[str, int]] = {}
        for (model, _), tracker in sorted(self.trackers.items()):
            for arm, count in tracker.counts.items():
                if count > 0:
                    out.setdefault(model, {})[str(arm)] = count
        return out

    @staticmethod
    def still_valid(state: dict[str, Any], fit: ArmFit) -> dict[str, Any]:
        """What holds for other arms: acceptance and drift of proposers that remain
        (per position, so a wider γ range learns only its new positions), the traffic
        mix and concurrency. The step-cost fit is kept only if the proposers are the
        same (its features are one column per proposer); the rest is learned again."""
        proposers = set(fit.proposers)
        kept = dict(state)
        kept["acceptance"] = [[k, v] for k, v in state["acceptance"] if k[2] in proposers]
        kept["detectors"] = [[k, v] for k, v in state["detectors"] if k[2] in proposers]
        kept["drift_detectors"] = [
            [k, v] for k, v in state.get("drift_detectors", []) if k[2] in proposers
        ]
        kept["cost"] = {
            m: c for m, c in state["cost"].items() if tuple(c.get("proposers", ())) == fit.proposers
        }
        kept["in_flight"] = {
            m: {a: n for a, n in counts.items() if fit.valid(a)}
            for m, counts in state["in_flight"].items()
        }
        return kept

    def load_state(self, state: dict[str, Any], fit: ArmFit) -> None:
        if not fit.same:
            state = self.still_valid(state, fit)
        self.acceptance = {}
        for key, value in state["acceptance"]:
            model = self.acceptance_model((key[0], key[1], key[2]))
            model.load_state(value)
        self.detectors = {}
        for key, value in state["detectors"]:
            detector = self.detectors[(key[0], key[1], key[2])] = ChangeDetector()
            detector.load_state(value)
        # States saved before drifts were read per drafted step start those afresh.
        self.drift_detectors = {}
        for key, value in state.get("drift_detectors", []):
            detector = self.drift_detectors[(key[0], key[1], key[2])] = ChangeDetector()
            detector.load_state(value)
        self.cost = {}
        for model_name, value in state["cost"].items():
            cost = self.cost[model_name] = self._new_cost_model()
            cost.load_state(value)
        self.trackers = {}
        self.served = []
        for model_name, counts in state["in_flight"].items():
            for text, count in counts.items():
                arm = Arm.parse(text)
                self.tracker(model_name, arm).counts[arm] = int(count)
        self.token_shares = {m: dict(s) for m, s in state["token_shares"].items()}
        self.shares_at = dict(state["shares_at"])
        self.overheads = {
            m: deque(map(float, o), maxlen=_OVERHEAD_WINDOW) for m, o in state["overheads"].items()
        }
        self.bucket_concurrency = {(k[0], k[1]): v for k, v in state["bucket_concurrency"]}
        self.observations = dict(state["observations"])
        self.change_events = [ChangeEvent(**e) for e in state["change_events"]]
