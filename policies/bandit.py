"""specpilot's policy: a structured, discounted Thompson-sampling bandit with guard rails.

What it learns, and where each piece is shared:

* acceptance per model × workload class × proposer (:class:`AcceptanceModel`), shared
  across γ — per-position counts from a run at γ inform every γ' ≤ γ — and across
  concurrency buckets;
* step cost per model (:class:`StepCostModel`): plain step time, compute knee and
  each proposer's drafting cost, from which the cost of every proposer × γ × bucket
  follows; it is fed with the batch composition the policy itself assigned;
* the traffic mix per model (each class's share of generated tokens).

The reward of an arm for a context is the per-token latency speed-up of that class
relative to no speculation at the same concurrency, as the fleet model predicts it;
because classes share a batch, the arms of all classes in a bucket are chosen jointly
(:func:`policies.fleet.best_assignment`). Thompson sampling draws plausible acceptances
from their posteriors and explores the arm that world prefers (at the mean step cost:
see ``_plan``); evidence is discounted with a
half-life so the bandit keeps adapting, and a CUSUM change detector per class ×
proposer resets acceptance that went stale. The step cost's knee can only be seen by
running past it: where every batch so far stayed below it, the cost model puts it at the
edge of what was seen, and knee trials (``_start_trial``) now and then run a bucket one
knee cell bolder, within a bounded worst-case loss, so the estimate can rise.

Guard rails: a class speculates only while the lower confidence bound (a posterior
quantile) of its effect on the bucket's goodput is at least 1; a committed decision
changes only after ``dwell_s`` and when the new arm is predicted better by
``hysteresis`` (pushes can cost restarts), except that safety (turning off) never waits;
exploration is capped to ``explore_cap`` of requests; operator overrides always win.

The API the controller uses:

* ``context(model, workload_class, concurrency) -> Context``: bucket a request;
* ``select(context) -> Arm`` (or ``choose`` for the full :class:`Decision`): per request,
  may explore within the cap;
* ``decide(context) -> Decision``: the committed arm for a context, with the reason and
  the predicted speed-up and its interval;
* ``observe(observation)``: learn from a finished request;
* ``set_override`` / ``clear_override``: operator overrides by scope with ``*`` wildcards;
* ``estimates()``: a JSON-able read-out for ``GET /v1/policy``;
* ``state_dict()`` / ``load_state_dict()``: JSON-able persistence.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from policies.arms import OFF, Arm, ConcurrencyBuckets, Context, sorted_arms
from policies.base import Clock
from policies.estimators import (
    KNEE_CELL,
    AcceptanceModel,
    BatchTracker,
    ChangeDetector,
    ChangeEvent,
    StepCostModel,
)
from policies.fleet import (
    CostDraws,
    CostParams,
    FloatArray,
    TokensPerStep,
    Topology,
    best_assignment,
    engine_of,
    steady_goodput,
    steady_state,
    steady_state_draws,
)

DEFAULT_MODEL = "default"
# Selections over which the exploration rate is averaged.
_EXPLORE_WINDOW = 200.0
_OVERHEAD_WINDOW = 64
"""Requests whose time outside vLLM's decode sets the median that caps it."""
_OVERHEAD_MIN_SEEN = 3
_OVERHEAD_CAP = 4.0
"""A request's time outside decode counts up to this many times the recent median."""
DEFAULT_CLASS = "default"
# The pseudo-class of a class's exploring requests while exploration is weighed.
_EXPLORING = "\x00exploring"
WILDCARD = "*"


def _quantile(values: FloatArray, q: float) -> float:
    """Linear-interpolated quantile of a small sample (``np.quantile`` costs 50× more)."""
    ordered = np.sort(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


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


@dataclass(frozen=True, slots=True)
class BanditConfig:
    """Tuning of the bandit; times in seconds of the injected clock."""

    buckets: ConcurrencyBuckets = field(default_factory=ConcurrencyBuckets)
    half_life_s: float = 1800.0
    """Evidence loses half its weight in this time."""
    dwell_s: float = 60.0
    """A context keeps a committed arm at least this long (unless turning off)."""
    hysteresis: float = 0.02
    """A new arm replaces a committed one when predicted to raise the bucket's goodput
    by this much (relative), or its class's own speed-up by this much without lowering
    the bucket's goodput."""
    explore_cap: float = 0.08
    """At most this share of requests is served by an arm other than the committed one."""
    guard_quantile: float = 0.1
    """A class speculates only if this posterior quantile of its goodput effect is >= 1."""
    posterior_draws: int = 16
    refresh_observations: int = 40
    """Re-plan a bucket after this many new observations of its model…"""
    refresh_s: float = 60.0
    """…or after this long, whichever comes first."""
    probe_every: int = 25
    """Serve a class with an unused proposer (its smallest γ) after this many of the
    class's requests went by without it, so drifts of idle proposers get noticed."""
    probe_budget: float = 0.0
    """Share of goodput probes may cost on average. A probe is priced at admission by
    what it is predicted to cost its batch's goodput while it runs (see
    ``_probe_cost``); one that pays for itself runs whenever due. Each admitted request
    adds ``probe_budget / n`` to its class's budget (n sequences in flight: one request
    is about 1/n of the batch's work while it runs), and a costly probe of the class
    runs only once the budget holds its cost. Per class, because a drift is caught
    within so many requests of its class: a rare class earns as much per request as a
    frequent one. 0 by default: probing only where it pays keeps every goodput ratio
    of ``bench policy``, while catching the drift of a proposer nobody uses at high
    load within 200 requests of its class can cost more than 2 % of goodput there
    (e.g. one EAGLE-3 probe costs a 24-stream batch about 4 % while it runs)."""
    probe_burst: float = 4.0
    """The probe budget saves up to what this many requests of a full batch earn
    (``probe_budget × probe_burst``): a probe or two at once, while a burst after a
    quiet stretch costs at most a few requests' worth of the batch's time."""
    explore_max_loss: float = 0.01
    """Exploring a class's Thompson arm (on the share of its requests the cap lets
    explore) may cost the bucket at most this much goodput where the knee is lowest."""
    trial_max_loss: float = 0.1
    """A knee trial (see ``SpecPilotPolicy._start_trial``) runs only if, should the
    knee sit right at the edge of the batches seen so far, the trial's assignment
    costs the bucket at most this much goodput while it lasts."""
    trials_per_request: float = 20.0
    min_evidence_requests: float = 8.0
    """Dwell and hysteresis only hold arms whose class × proposer acceptance rests on at
    least this many (discounted) requests."""
    topology: Topology = "shared"
    """``shared``: a model's arms share one batch (one engine serves every config, as in
    the simulator's fast mode). ``per_arm``: each arm runs in its own engine (routing
    mode: a pool per speculative config), so a request's step time depends only on the
    requests in its own pool and streams split between pools."""


@dataclass(frozen=True, slots=True)
class Decision:
    """An arm for a context and why.

    ``predicted_speedup`` is the class's per-token speed-up over no speculation at the
    bucket's concurrency; ``interval`` its posterior 10–90 % range. ``explored`` is
    True when this request is served by an arm other than the committed one.
    """

    context: Context
    arm: Arm
    reason: str
    """``override``, ``best``, ``guard_off``, ``dwell``, ``hysteresis``, ``learning``,
    ``explore`` or ``probe``."""
    predicted_speedup: float | None = None
    interval: tuple[float, float] | None = None
    explored: bool = False


@dataclass(frozen=True, slots=True)
class Override:
    """Operator override: every context matching the scope is served with ``arm``."""

    model: str
    workload_class: str
    bucket: str
    arm: Arm

    def matches(self, context: Context) -> bool:
        return all(
            pattern in (WILDCARD, value)
            for pattern, value in (
                (self.model, context.model),
                (self.workload_class, context.workload_class),
                (self.bucket, context.bucket),
            )
        )

    @property
    def specificity(self) -> int:
        return sum(p != WILDCARD for p in (self.model, self.workload_class, self.bucket))


@dataclass(slots=True)
class _Commitment:
    arm: Arm
    since: float
    reason: str
    speedup: float | None = None
    interval: tuple[float, float] | None = None


@dataclass(slots=True)
class _Trial:
    """A bucket serving one batch's worth of requests a plan one knee cell bolder."""

    assignment: dict[str, Arm]
    remaining: int


@dataclass(slots=True)
class _Plan:
    """One bucket's latest joint plan."""

    at: float
    observations: int
    thompson: dict[str, Arm]
    concurrency: float = 0.0
    """The bucket's concurrency the plan was made for."""
    worlds: CostDraws | None = None
    """Cost draws (knee blurred within its grid cell) that price probes; not saved:
    a restored plan prices no probes until the bucket is re-planned."""
    tokens: dict[tuple[str, Arm], float] = field(default_factory=dict)
    """Posterior mean tokens per step of every class × speculating arm."""
    shares: dict[str, float] = field(default_factory=dict)
    knee_pinned: bool = False
    """The cost data tells the knee from the next grid knee above it (a batch ran past
    it), or there is none: what is left of its uncertainty lies within its grid cell,
    which no data resolves. Not saved, like ``worlds``."""


class SpecPilotPolicy:
    """The structured bandit. See the module docstring for what it learns and guards."""

    name = "specpilot"

    def __init__(
        self,
        arms: Sequence[Arm],
        *,
        clock: Clock,
        rng: np.random.Generator,
        config: BanditConfig | None = None,
    ) -> None:
        self.config = config or BanditConfig()
        self.arms: tuple[Arm, ...] = sorted_arms([*arms, OFF])
        self.clock = clock
        self.rng = rng
        self._gammas: dict[str, list[int]] = {}
        for arm in self.arms:
            if arm.proposer is not None:
                self._gammas.setdefault(arm.proposer, []).append(arm.gamma)
        self.proposers = tuple(sorted(self._gammas))
        self._acceptance: dict[tuple[str, str, str], AcceptanceModel] = {}
        self._detectors: dict[tuple[str, str, str], ChangeDetector] = {}
        self._cost: dict[str, StepCostModel] = {}
        self._trackers: dict[tuple[str, str], BatchTracker] = {}
        """Per (model, engine): the batch composition the policy assigned."""
        self._token_shares: dict[str, dict[str, float]] = {}
        self._shares_at: dict[str, float] = {}
        self._overheads: dict[str, deque[float]] = {}
        """Per model: recent requests' end-to-end time outside vLLM's decode (seconds)."""
        self._bucket_concurrency: dict[tuple[str, str], float] = {}
        self._pending_concurrency: dict[str, tuple[float, list[str]]] = {}
        """Per model: buckets of requests served at one instant, whose concurrency is
        read once time moves on (see ``_settle_concurrency``)."""
        self._observations: dict[str, int] = {}
        self._plans: dict[tuple[str, str], _Plan] = {}
        self._commitments: dict[Context, _Commitment] = {}
        self._class_requests: dict[tuple[str, str], int] = {}
        self._last_served: dict[tuple[str, str, str], int] = {}
        self._probe_budget: dict[tuple[str, str], float] = {}
        """Per (model, class): what its probes may still spend (see ``probe_budget``)."""
        self._overrides: list[Override] = []
        self._trials: dict[tuple[str, str], _Trial] = {}
        self._knee_seen: dict[str, float] = {}
        """Per model: the knee estimate the latest plan used."""
        self._bucket_requests: dict[tuple[str, str], int] = {}
        self._next_trial: dict[tuple[str, str], tuple[int, float]] = {}
        """Per (model, bucket): requests served; the count from which a new knee trial
        may start (trials take at most ``explore_cap`` of a bucket's requests) and the
        knee estimate when the last one started."""
        self.selected = 0
        self.explored = 0
        self._explore_rate = 0.0
        self.change_events: list[ChangeEvent] = []

    # -- the controller's API ------------------------------------------------------

    def context(self, model: str, workload_class: str, concurrency: int) -> Context:
        """The context of a request, bucketed with this policy's bucket edges."""
        return Context(model, workload_class, self.config.buckets.bucket(concurrency))

    def select(self, context: Context) -> Arm:
        """The arm for one request of ``context`` (may explore, within the cap)."""
        return self.choose(context).arm

    def best_guess(self, context: Context) -> Arm:
        return self.decide(context).arm

    def choose(self, context: Context) -> Decision:
        """Per-request decision: the committed arm, or an exploration arm."""
        decision = self.decide(context)
        class_key = (context.model, context.workload_class)
        count = self._class_requests.get(class_key, 0) + 1
        self._class_requests[class_key] = count
        self._save_probe_budget(class_key)
        trial = self._trial_arm(context, decision)
        if trial is not None:
            decision = trial
        elif decision.reason != "override" and self._may_explore():
            candidate = self._exploration_arm(context, decision.arm, count)
            if candidate is not None:
                arm, reason = candidate
                decision = Decision(context, arm, reason, explored=True)
        self._count_selection(decision.explored)
        self._serve(context, decision.arm, count)
        return decision

    def decide(self, context: Context) -> Decision:
        """The committed arm for a context (no exploration), with its reason."""
        override = self._override_for(context)
        if override is not None:
            return Decision(context, override.arm, "override")
        self._plan_if_due(context.model, context.bucket)
        commitment = self._commitments.get(context)
        if commitment is None:
            return Decision(context, OFF, "learning")
        return Decision(
            context, commitment.arm, commitment.reason, commitment.speedup, commitment.interval
        )

    def observe(self, observation: RequestObservation) -> None:
        """Learn from one finished request (acceptance, cost, mix, drift)."""
        now = self.clock()
        model = observation.model or DEFAULT_MODEL
        cls = observation.workload_class or DEFAULT_CLASS
        try:
            arm = Arm.parse(observation.arm) if observation.arm else OFF
        except ValueError:
            return
        self._settle_concurrency(model, now)
        tracker = self._tracker(model, arm)
        tracker.remove(arm, now)
        self._learn_cost(model, arm, observation, tracker, now)
        self._learn_mix(model, cls, observation, now)
        self._observations[model] = self._observations.get(model, 0) + 1
        spec = observation.spec
        if (
            arm.proposer is not None
            and spec is not None
            and spec.num_drafts
            and spec.accepted_per_position is not None
        ):
            # The chances to draft: every step but the prefill's (where that is a step).
            taken = steps_taken(spec, observation.output_tokens)
            steps = spec.num_drafts if taken is None else max(spec.num_drafts, taken - 1)
            self._learn_acceptance(model, cls, arm.proposer, spec.accepted_per_position, steps, now)

    def set_override(
        self,
        arm: Arm,
        *,
        model: str = WILDCARD,
        workload_class: str = WILDCARD,
        bucket: str = WILDCARD,
    ) -> Override:
        """Serve every context in the scope with ``arm``; the most specific scope wins."""
        if arm not in self.arms:
            raise ValueError(
                f"arm {arm} is not available (available: {', '.join(map(str, self.arms))})"
            )
        self.clear_override(model=model, workload_class=workload_class, bucket=bucket)
        override = Override(model, workload_class, bucket, arm)
        self._overrides.append(override)
        return override

    def clear_override(
        self, *, model: str = WILDCARD, workload_class: str = WILDCARD, bucket: str = WILDCARD
    ) -> bool:
        before = len(self._overrides)
        self._overrides = [
            o
            for o in self._overrides
            if (o.model, o.workload_class, o.bucket) != (model, workload_class, bucket)
        ]
        return len(self._overrides) != before

    @property
    def overrides(self) -> tuple[Override, ...]:
        return tuple(self._overrides)

    @property
    def explore_fraction(self) -> float:
        return self.explored / self.selected if self.selected else 0.0

    # -- exploration ---------------------------------------------------------------

    def _may_explore(self) -> bool:
        # A moving rate, not a lifetime count: a quiet stretch must not bank budget
        # that is then spent in one burst.
        return self._explore_rate < self.config.explore_cap

    def _count_selection(self, explored: bool) -> None:
        self.selected += 1
        self.explored += explored
        self._explore_rate += (float(explored) - self._explore_rate) / _EXPLORE_WINDOW

    def _exploration_arm(
        self, context: Context, committed: Arm, count: int
    ) -> tuple[Arm, str] | None:
        plan = self._plans.get((context.model, context.bucket))
        if plan is not None:
            sampled = plan.thompson.get(context.workload_class)
            if sampled is not None and sampled != committed:
                return sampled, "explore"
        if plan is None or plan.worlds is None:
            return None
        # Probes keep the acceptance of proposers a class does not use fresh, so their
        # drifts get noticed: the stalest first, each if the budget affords it now.
        due = []
        for proposer in self.proposers:
            if proposer == committed.proposer:
                continue
            last = self._last_served.get((context.model, context.workload_class, proposer), 0)
            if count - last >= self.config.probe_every:
                due.append((last, proposer))
        class_key = (context.model, context.workload_class)
        budget = self._probe_budget.get(class_key, 0.0)
        for _, proposer in sorted(due):
            probe = Arm(proposer, min(self._gammas[proposer]))
            cost = self._probe_cost(context, committed, probe, plan)
            if cost <= budget:
                self._probe_budget[class_key] = budget - max(cost, 0.0)
                return probe, "probe"
        return None

    def _trial_arm(self, context: Context, decision: Decision) -> Decision | None:
        """The arm of a running knee trial for this request, if one runs in its bucket."""
        key = (context.model, context.bucket)
        served = self._bucket_requests.get(key, 0) + 1
        self._bucket_requests[key] = served
        trial = self._trials.get(key)
        if trial is None or decision.reason == "override":
            return None
        trial.remaining -= 1
        if trial.remaining <= 0:
            del self._trials[key]
        arm = trial.assignment.get(context.workload_class, decision.arm)
        if arm == decision.arm:
            return None
        return Decision(context, arm, "trial", explored=True)

    def _start_trial(
        self,
        model: str,
        bucket: str,
        concurrency: float,
        shares: Mapping[str, float],
        served: Mapping[str, Arm],
        mean_e: Mapping[tuple[str, Arm], float],
        drawn_e: Mapping[tuple[str, Arm], FloatArray],
        worlds: CostDraws,
        cost_model: StepCostModel,
    ) -> None:
        """Start a knee trial in a bucket when the knee estimate holds its plan back.

        While no batch has yet run past the knee, the mean cost puts the knee at the
        edge of the largest batch seen, and every plan stays within it: the data that
        would show the knee to be higher never comes. Per-request exploration cannot
        bring it either: in a shared batch, a few sequences drafting deeper make every
        sequence wait for the deeper drafting. So, now and then, the whole bucket runs
        for one batch's worth of requests the plan made with the knee one grid cell
        higher (what the data cannot rule out), if that plan is predicted to gain there
        and, were the knee right at the edge, would cost at most ``trial_max_loss``
        while it lasts. Its requests count as exploration; trials take at most
        ``explore_cap`` of the bucket's requests. What the trial's batches show moves
        the knee estimate, and the ordinary plan follows.
        """
        key = (model, bucket)
        if key in self._trials:
            return
        knee = cost_model.mean_params().knee_tokens
        due, knee_then = self._next_trial.get(key, (0, math.inf))
        # A trial that moved the knee estimate up paid for itself (the plan now follows
        # it): the next step may follow at once. One that did not waits its turn.
        if self._bucket_requests.get(key, 0) < due and knee <= knee_then:
            return
        bolder = cost_model.next_knee_params()
        if bolder is None:
            return
        topology = self.config.topology

        def mean_tokens(cls: str, arm: Arm) -> float:
            return 1.0 if arm.proposer is None else mean_e[(cls, arm)]

        proposal = best_assignment(
            concurrency, shares, mean_tokens, self.arms, bolder, served, topology=topology
        )
        proposal, _ = self._guard(concurrency, shares, proposal, drawn_e, worlds)
        if all(proposal.get(c, OFF) == served.get(c, OFF) for c in shares):
            return
        gain = steady_goodput(concurrency, shares, mean_tokens, proposal, bolder, topology) / max(
            steady_goodput(concurrency, shares, mean_tokens, served, bolder, topology), 1e-12
        )
        if gain < 1.0 + self.config.hysteresis:
            return
        # The worst the data allows: the knee right at the edge of the batches seen.
        edge = cost_model.edge_params()
        worst = steady_goodput(concurrency, shares, mean_tokens, proposal, edge, topology) / max(
            steady_goodput(concurrency, shares, mean_tokens, served, edge, topology), 1e-12
        )
        if worst < 1.0 - self.config.trial_max_loss:
            return
        length = max(1, math.ceil(concurrency))
        self._trials[key] = _Trial(dict(proposal), length)
        spacing = math.ceil(length * (1.0 / self.config.explore_cap - 1.0))
        self._next_trial[key] = (self._bucket_requests.get(key, 0) + length + spacing, knee)

    def _save_probe_budget(self, class_key: tuple[str, str]) -> None:
        """One admitted request is about 1/n of an n-sequence batch's work while it
        runs: it earns its class's probes ``probe_budget`` of that (see
        ``BanditConfig``)."""
        share = self.config.probe_budget / (self._in_flight(class_key[0]) + 1)
        saved = self._probe_budget.get(class_key, 0.0) + share
        cap = self.config.probe_budget * self.config.probe_burst
        self._probe_budget[class_key] = min(saved, cap)

    def _probe_cost(self, context: Context, committed: Arm, probe: Arm, plan: _Plan) -> float:
        """Share of its engine's goodput a probe is predicted to cost while it runs
        (negative: it pays for itself) against serving the request with the committed
        arm: the mean over the plan's cost draws, as the budget bounds an average;
        where the knee is pinned to its grid cell, what it surely costs at most (in all
        but ``guard_quantile`` of the draws).

        The draws place the knee anywhere within its cell. While the knee estimate
        sits at the edge of the batches seen, a probe that runs the batch past it is
        also evidence on the knee, and the mean is a fair price. Once a batch ran past
        the knee, what is left is the cell's width, which no data resolves: at the
        mean, a probe that costs its batch if the knee lies low in the cell would pass
        for one that pays for itself, and with no budget at all run every
        ``probe_every`` requests of its class in a batch at the knee, for as long as it
        stays there. There the probe is priced as the guard and exploration price
        what they risk.

        Priced in the batch as it is now. Past the compute knee every verified
        position slows every sequence, and the probe's own accepted tokens are what
        pays that back. Drafting is paid once per step by every sequence of the batch,
        as long as any sequence drafts with the proposer: a probe pays its own drafting
        in full when nobody else drafts with its proposer, and shares it with the
        sequences that do (1/(users + 1) of it), so probes that run together share it
        without each one passing for free (the next probe only rides on the first for
        part of its life).
        """
        assert plan.worlds is not None
        worlds, cls = plan.worlds, context.workload_class
        tracker = self._tracker(context.model, probe)
        if self.config.topology == "per_arm":
            # The probe runs in its own pool: it slows only the requests there.
            if tracker.in_flight == 0:
                return 0.0
            before = worlds.step_time(*tracker.composition())
            slowdown = worlds.step_time(*tracker.composition(probe)) / before - 1.0
            return self._price(slowdown, plan)

        def tokens(arm: Arm, of_class: str | None = None) -> float:
            if arm.proposer is None:
                return 1.0
            if of_class is not None:
                return plan.tokens.get((of_class, arm), 1.0)
            # A sequence in flight, class unknown: the traffic mix's mean.
            total = sum(plan.shares.values())
            if total <= 0:
                return 1.0
            return sum(s * plan.tokens.get((c, arm), 1.0) for c, s in plan.shares.items()) / total

        batch = sum(count * tokens(arm) for arm, count in tracker.counts.items() if count > 0)
        served = batch + tokens(committed, cls)
        probed = batch + tokens(probe, cls)
        served_verify, served_depth = tracker.composition(committed)
        probed_verify, probed_depth = tracker.composition(probe)
        served_step = worlds.step_time(served_verify, served_depth)
        probed_step = worlds.step_time(probed_verify, probed_depth)
        users = sum(n for arm, n in tracker.counts.items() if arm.proposer == probe.proposer)
        drafting = worlds.draft_cost.get(str(probe.proposer))
        if users > 0 and drafting is not None:
            alone = worlds.step_time(probed_verify, served_depth) + (
                drafting * worlds.step_s * probe.gamma
            )
            probed_step = probed_step + (alone - probed_step) / (users + 1)
        ratio = (probed / probed_step) / (served / served_step)
        return self._price(1.0 - ratio, plan)

    def _price(self, costs: FloatArray, plan: _Plan) -> float:
        """A probe's price from its cost in each of the plan's draws (see
        ``_probe_cost``)."""
        if plan.knee_pinned:
            return _quantile(costs, 1.0 - self.config.guard_quantile)
        return float(np.mean(costs))

    def _affordable_exploration(
        self,
        model: str,
        concurrency: float,
        shares: Mapping[str, float],
        guarded: Mapping[str, Arm],
        thompson: dict[str, Arm],
        drawn_e: Mapping[tuple[str, Arm], FloatArray],
        worlds: CostDraws,
    ) -> dict[str, Arm]:
        """Keep a class's Thompson arm only if, in the sampled acceptance world,
        exploring it costs the bucket at most ``explore_max_loss`` of its goodput in
        all but ``guard_quantile`` of ``worlds`` (the mean cost with its knee anywhere
        within its grid cell).

        Thompson sampling explores acceptance at the mean cost. When the batch runs
        right at the compute knee, whether a knee just above the operating point or
        just below is true decides whether any speculation pays, and exploring there
        slows every sequence of the batch; acceptance (shared across buckets) is
        learned as well at lower load.

        What is weighed is the exploration itself, not the class switching over: only
        the share of the class's requests the exploration cap lets through runs the
        Thompson arm. Requiring a full switch to pay in every plausible world would
        forbid ever running a batch a little past the highest load where the knee has
        been seen not to bind, so a knee estimate stuck at the edge of what was seen
        could never rise; exploring a small share there costs little even if the knee
        is right at that edge.
        """
        size = len(worlds.step_s)
        first = {key: np.full(size, values[0]) for key, values in drawn_e.items()}
        topology = self.config.topology
        base, _ = steady_state_draws(concurrency, shares, first, guarded, worlds, topology)
        counts = {c: n for (m, c), n in self._class_requests.items() if m == model}
        total = sum(counts.get(c, 0) for c in shares)
        out = dict(thompson)
        for cls in sorted(thompson):
            if thompson[cls] == guarded.get(cls, OFF):
                continue
            requests = counts.get(cls, 0) / total if total > 0 else 1.0
            explored = min(1.0, self.config.explore_cap / max(requests, 1e-9))
            # The exploring requests as a class of their own on the Thompson arm.
            share = shares[cls]
            split = {**shares, cls: share * (1.0 - explored), _EXPLORING: share * explored}
            tokens = dict(first)
            if thompson[cls].proposer is not None:
                tokens[(_EXPLORING, thompson[cls])] = first[(cls, thompson[cls])]
            assignment = {**guarded, _EXPLORING: thompson[cls]}
            moved, _ = steady_state_draws(concurrency, split, tokens, assignment, worlds, topology)
            ratios = moved / np.maximum(base, 1e-12)
            if _quantile(ratios, self.config.guard_quantile) < 1.0 - self.config.explore_max_loss:
                out[cls] = guarded.get(cls, OFF)
        return out

    def _serve(self, context: Context, arm: Arm, count: int) -> None:
        now = self.clock()
        self._settle_concurrency(context.model, now)
        self._tracker(context.model, arm).add(arm, now)
        if arm.proposer is not None:
            self._last_served[(context.model, context.workload_class, arm.proposer)] = count
        pending = self._pending_concurrency.setdefault(context.model, (now, []))
        pending[1].append(context.bucket)

    def _settle_concurrency(self, model: str, now: float) -> None:
        """Record the concurrency the requests served at an earlier instant started with.

        Requests that start together see each other in flight: a burst served one by
        one at one instant (a closed loop's concurrency stepping up) must not read 7,
        8, …, 48 in flight when all 48 run together. So a served request's bucket is
        sampled at the next event after its instant, before that event changes the
        batch. Each sample is clipped to its bucket's range (the caller bucketed the
        request by its own count of what is in flight, which is authoritative), and a
        bucket whose estimate moves by more than 10 % is re-planned.
        """
        pending = self._pending_concurrency.get(model)
        if pending is None or now <= pending[0]:
            return
        del self._pending_concurrency[model]
        in_flight = float(self._in_flight(model))
        edges = self.config.buckets.lower_edges
        for bucket in pending[1]:
            index = self.config.buckets.labels.index(bucket)
            high = edges[index + 1] - 1 if index + 1 < len(edges) else math.inf
            sample = min(max(in_flight, float(edges[index])), high)
            key = (model, bucket)
            previous = self._bucket_concurrency.get(key)
            estimate = sample if previous is None else 0.98 * previous + 0.02 * sample
            self._bucket_concurrency[key] = estimate
            planned = self._plans.get(key)
            if planned is not None and abs(estimate - planned.concurrency) > 0.1 * estimate:
                del self._plans[key]

    # -- learning ------------------------------------------------------------------

    def _cost_model(self, model: str) -> StepCostModel:
        cost = self._cost.get(model)
        if cost is None:
            cost = self._cost[model] = StepCostModel(
                self.proposers, half_life_s=self.config.half_life_s
            )
        return cost

    def _tracker(self, model: str, arm: Arm) -> BatchTracker:
        """The batch a request of ``model`` on ``arm`` joins (see ``topology``)."""
        key = (model, engine_of(arm, self.config.topology))
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = self._trackers[key] = BatchTracker(self._cost_model(model))
        return tracker

    def _in_flight(self, model: str) -> int:
        return sum(t.in_flight for (m, _), t in self._trackers.items() if m == model)

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
        self._cost_model(model).update(rows, per_step, now)

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
        recent = self._overheads.setdefault(model, deque(maxlen=_OVERHEAD_WINDOW))
        cap = (
            _OVERHEAD_CAP * statistics.median(recent)
            if len(recent) >= _OVERHEAD_MIN_SEEN
            else math.inf
        )
        recent.append(overhead)
        return decode + min(overhead, cap)

    def _learn_mix(self, model: str, cls: str, observation: RequestObservation, now: float) -> None:
        shares = self._token_shares.setdefault(model, {})
        last = self._shares_at.get(model)
        if last is not None:
            factor = 0.5 ** ((now - last) / self.config.half_life_s) if now > last else 1.0
            for key in shares:
                shares[key] *= factor
        self._shares_at[model] = now
        shares[cls] = shares.get(cls, 0.0) + float(observation.output_tokens or 1)

    def _learn_acceptance(
        self,
        model: str,
        cls: str,
        proposer: str,
        per_position: Sequence[int],
        num_drafts: int,
        now: float,
    ) -> None:
        key = (model, cls, proposer)
        acceptance = self._acceptance_model(key)
        detector = self._detectors.setdefault(key, ChangeDetector())
        first = per_position[0] / num_drafts if per_position else 0.0
        if detector.update(first):
            self.change_events.append(
                ChangeEvent(
                    now,
                    model,
                    cls,
                    proposer,
                    float(detector.baseline or 0.0),
                    float(detector.recent or first),
                )
            )
            acceptance.reset()
            detector.reset()
            # Re-plan every bucket of the model now; commitments of this class may move.
            for plan_key in [k for k in self._plans if k[0] == model]:
                del self._plans[plan_key]
            for context, commitment in self._commitments.items():
                if context.model == model and context.workload_class == cls:
                    commitment.since = -math.inf
        acceptance.update(per_position, num_drafts, now)

    def _acceptance_model(self, key: tuple[str, str, str]) -> AcceptanceModel:
        model = self._acceptance.get(key)
        if model is None:
            model = self._acceptance[key] = AcceptanceModel(
                max(self._gammas[key[2]]),
                half_life_s=self.config.half_life_s,
                trials_per_request=self.config.trials_per_request,
            )
        return model

    # -- planning ------------------------------------------------------------------

    def _plan_if_due(self, model: str, bucket: str) -> None:
        now = self.clock()
        plan = self._plans.get((model, bucket))
        observations = self._observations.get(model, 0)
        # Early on every observation changes the picture a lot: re-plan more often.
        every = min(self.config.refresh_observations, max(4, observations // 4))
        if plan is not None and (
            observations - plan.observations < every and now - plan.at < self.config.refresh_s
        ):
            return
        self._plan(model, bucket, now, observations)

    def _concurrency(self, model: str, bucket: str) -> float:
        observed = self._bucket_concurrency.get((model, bucket))
        return observed if observed is not None else self.config.buckets.representative(bucket)

    def _plan(self, model: str, bucket: str, now: float, observations: int) -> None:
        """Re-plan one bucket: draw worlds, pick arms jointly, guard, commit."""
        shares = {c: v for c, v in self._token_shares.get(model, {}).items() if v > 0}
        cost_model = self._cost.get(model)
        if not shares or cost_model is None or not cost_model.ready:
            self._plans[(model, bucket)] = _Plan(
                now, observations, {}, concurrency=self._concurrency(model, bucket)
            )
            return
        draws = self.config.posterior_draws
        classes = sorted(shares)
        # Expected tokens per step for every class × arm: posterior means and draws.
        mean_e: dict[tuple[str, Arm], float] = {}
        drawn_e: dict[tuple[str, Arm], FloatArray] = {}
        for cls in classes:
            for proposer in self.proposers:
                acceptance = self._acceptance_model((model, cls, proposer))
                means = AcceptanceModel.expected_tokens(acceptance.mean_conditionals())
                drawn = AcceptanceModel.expected_tokens(
                    acceptance.sample_conditionals(self.rng, draws)
                )
                for gamma in self._gammas[proposer]:
                    mean_e[(cls, Arm(proposer, gamma))] = float(means[gamma])
                    drawn_e[(cls, Arm(proposer, gamma))] = drawn[:, gamma]

        def mean_tokens(cls: str, arm: Arm) -> float:
            return 1.0 if arm.proposer is None else mean_e[(cls, arm)]

        def first_draw_tokens(cls: str, arm: Arm) -> float:
            return 1.0 if arm.proposer is None else float(drawn_e[(cls, arm)][0])

        concurrency = self._concurrency(model, bucket)
        mean_cost = cost_model.mean_params()
        if self._knee_seen.get(model, mean_cost.knee_tokens) != mean_cost.knee_tokens:
            # New evidence on the knee (typically a knee trial's batches): decisions
            # held back by the old estimate may move now, as after a drift.
            for context, commitment in self._commitments.items():
                if context.model == model:
                    commitment.since = -math.inf
        self._knee_seen[model] = mean_cost.knee_tokens
        cost_draws = cost_model.sample_params(self.rng, draws)
        worlds = CostDraws.stack(cost_draws)
        committed = {
            cls: c.arm
            for cls in classes
            if (c := self._commitments.get(Context(model, cls, bucket))) is not None
        }
        topology = self.config.topology
        best = best_assignment(
            concurrency, shares, mean_tokens, self.arms, mean_cost, committed, topology=topology
        )
        guarded, unsafe = self._guard(concurrency, shares, best, drawn_e, worlds)
        # Exploration samples acceptance only. Sampling the cost model too would send
        # requests, at high load, to worlds where the knee is far above anything seen,
        # and every such request slows the whole batch; the cost model learns from
        # every request anyway, and the guard still uses its posterior draws.
        thompson = best_assignment(
            concurrency, shares, first_draw_tokens, self.arms, mean_cost, guarded, topology=topology
        )
        # Exploring is allowed only where being wrong about the cost is cheap. The
        # knee is known to a grid cell at best: the data cannot tell a knee just above
        # the batch's operating point from one just below, so these checks place each
        # draw's knee anywhere within its cell.
        cell = KNEE_CELL ** self.rng.uniform(-0.5, 0.5, len(worlds.knee_tokens))
        blurred = dataclasses.replace(worlds, knee_tokens=worlds.knee_tokens * cell)
        mean_world = CostDraws.stack([mean_cost] * len(cell))
        blurred_mean = dataclasses.replace(mean_world, knee_tokens=mean_world.knee_tokens * cell)
        thompson = self._affordable_exploration(
            model, concurrency, shares, guarded, thompson, drawn_e, blurred_mean
        )
        self._plans[(model, bucket)] = _Plan(
            now,
            observations,
            thompson,
            concurrency,
            blurred,
            mean_e,
            shares,
            knee_pinned=cost_model.next_knee_params() is None,
        )
        # The live assignment is guarded too: a committed class whose speculation no
        # longer surely pays turns off now, whatever its dwell time.
        live = {cls: committed.get(cls, guarded[cls]) for cls in classes}
        _, unsafe_live = self._guard(concurrency, shares, live, drawn_e, worlds)
        plan_gain = steady_goodput(
            concurrency, shares, mean_tokens, guarded, mean_cost, topology
        ) / max(steady_goodput(concurrency, shares, mean_tokens, live, mean_cost, topology), 1e-12)
        for cls in classes:
            self._commit(
                Context(model, cls, bucket),
                cls,
                guarded,
                unsafe | unsafe_live,
                live,
                plan_gain,
                concurrency,
                shares,
                mean_tokens,
                mean_cost,
                now,
            )
        served = {c: self._commitments[Context(model, c, bucket)].arm for c in classes}
        _, step = steady_state_draws(concurrency, shares, drawn_e, served, worlds, topology)
        _, plain = steady_state_draws(concurrency, shares, drawn_e, {}, worlds, topology)
        for cls, arm in served.items():
            # Per-token speed-up of the class over everything off at this concurrency.
            tokens = drawn_e[(cls, arm)] if arm.proposer is not None else 1.0
            values = tokens * plain[cls] / step[cls]
            commitment = self._commitments[Context(model, cls, bucket)]
            commitment.speedup = float(np.mean(values))
            commitment.interval = (_quantile(values, 0.1), _quantile(values, 0.9))
        self._start_trial(
            model,
            bucket,
            concurrency,
            shares,
            served,
            mean_e,
            drawn_e,
            worlds,
            cost_model,
        )

    def _guard(
        self,
        concurrency: float,
        shares: Mapping[str, float],
        assignment: Mapping[str, Arm],
        drawn_e: Mapping[tuple[str, Arm], FloatArray],
        worlds: CostDraws,
    ) -> tuple[dict[str, Arm], set[str]]:
        """Turn off every class whose speculation does not surely pay for the bucket:
        the ``guard_quantile`` of its effect on goodput over posterior draws must be ≥ 1."""
        guarded = dict(assignment)
        unsafe: set[str] = set()
        topology = self.config.topology
        current, _ = steady_state_draws(concurrency, shares, drawn_e, guarded, worlds, topology)
        for cls in sorted(assignment):
            if guarded[cls].is_off:
                continue
            without_cls = {**guarded, cls: OFF}
            without, _ = steady_state_draws(
                concurrency, shares, drawn_e, without_cls, worlds, topology
            )
            ratios = current / np.maximum(without, 1e-12)
            if _quantile(ratios, self.config.guard_quantile) < 1.0:
                guarded = without_cls
                current = without
                unsafe.add(cls)
        return guarded, unsafe

    def _mature(self, context: Context, arm: Arm) -> bool:
        if arm.proposer is None:
            return True
        key = (context.model, context.workload_class, arm.proposer)
        model = self._acceptance.get(key)
        return model is not None and model.requests >= self.config.min_evidence_requests

    def _commit(
        self,
        context: Context,
        cls: str,
        guarded: Mapping[str, Arm],
        unsafe: set[str],
        live: Mapping[str, Arm],
        plan_gain: float,
        concurrency: float,
        shares: Mapping[str, float],
        mean_tokens: TokensPerStep,
        mean_cost: CostParams,
        now: float,
    ) -> None:
        """Move a context's committed arm towards the plan, within dwell and hysteresis.

        A switch happens when the whole plan beats the live assignment by the margin
        (classes move together: one class alone may gain too little to move while all
        of them together gain a lot), or when this class's own speed-up gains the
        margin without the bucket losing. Turning off for safety never waits.
        """
        candidate = guarded[cls]
        current = self._commitments.get(context)
        if current is None:
            self._commitments[context] = _Commitment(
                candidate, now, "guard_off" if cls in unsafe else "best"
            )
            return
        if cls in unsafe and not current.arm.is_off and candidate.is_off:
            self._commitments[context] = _Commitment(OFF, now, "guard_off")
            return
        if candidate == current.arm:
            current.reason = "guard_off" if cls in unsafe else "best"
            return
        if not (self._mature(context, current.arm) and self._mature(context, candidate)):
            # Dwell and hysteresis protect decisions made on evidence; while the
            # posteriors are still mostly prior, following the plan is how they mature.
            self._commitments[context] = _Commitment(candidate, now, "learning")
            return
        if now - current.since < self.config.dwell_s:
            current.reason = "dwell"
            return
        margin = 1.0 + self.config.hysteresis
        if plan_gain >= margin:
            self._commitments[context] = _Commitment(candidate, now, "best")
            return
        moved = {**live, cls: candidate}
        topology = self.config.topology
        new_goodput, new_step = steady_state(
            concurrency, shares, mean_tokens, moved, mean_cost, topology
        )
        old_goodput, old_step = steady_state(
            concurrency, shares, mean_tokens, live, mean_cost, topology
        )
        own_gain = (mean_tokens(cls, candidate) / new_step[cls]) / (
            mean_tokens(cls, current.arm) / old_step[cls]
        )
        if new_goodput >= old_goodput * margin or (
            own_gain >= margin and new_goodput >= old_goodput
        ):
            self._commitments[context] = _Commitment(candidate, now, "best")
        else:
            current.reason = "hysteresis"

    def _override_for(self, context: Context) -> Override | None:
        best: Override | None = None
        for override in self._overrides:  # later entries win ties
            if override.matches(context) and (
                best is None or override.specificity >= best.specificity
            ):
                best = override
        return best

    # -- read-out and persistence --------------------------------------------------

    def estimates(self) -> dict[str, Any]:
        """What the policy believes, JSON-able, for ``GET /v1/policy``."""
        contexts = [
            {
                "model": ctx.model,
                "workload_class": ctx.workload_class,
                "bucket": ctx.bucket,
                "arm": str(c.arm),
                "reason": c.reason,
                "since_s": c.since if math.isfinite(c.since) else None,
                "predicted_speedup": c.speedup,
                "interval": list(c.interval) if c.interval else None,
            }
            for ctx, c in sorted(self._commitments.items())
        ]
        acceptance = []
        for (model, cls, proposer), estimate in sorted(self._acceptance.items()):
            conditionals = estimate.mean_conditionals()
            expected = AcceptanceModel.expected_tokens(conditionals)
            acceptance.append(
                {
                    "model": model,
                    "workload_class": cls,
                    "proposer": proposer,
                    "first_position_acceptance": float(conditionals[0]),
                    "expected_tokens": {str(g): float(expected[g]) for g in self._gammas[proposer]},
                    "requests": estimate.requests,
                }
            )
        costs = []
        for model, cost_model in sorted(self._cost.items()):
            if not cost_model.ready:
                continue
            params = cost_model.mean_params()
            relative: dict[str, dict[str, float]] = {}
            for bucket in self.config.buckets.labels:
                n = self._concurrency(model, bucket)
                plain = params.step_time(n, {})
                relative[bucket] = {
                    str(arm): params.step_time(
                        n * arm.verify_tokens, {arm.proposer: arm.gamma} if arm.proposer else {}
                    )
                    / plain
                    for arm in self.arms
                }
            costs.append(
                {
                    "model": model,
                    "step_s": params.step_s,
                    "knee_tokens": params.knee_tokens,
                    "draft_cost": dict(params.draft_cost),
                    "relative_step_cost": relative,
                }
            )
        return {
            "contexts": contexts,
            "acceptance": acceptance,
            "cost": costs,
            "overrides": [
                {
                    "model": o.model,
                    "workload_class": o.workload_class,
                    "bucket": o.bucket,
                    "arm": str(o.arm),
                }
                for o in self._overrides
            ],
            "change_events": [asdict(e) for e in self.change_events],
            "explore_fraction": self.explore_fraction,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything learned and committed, JSON-able (RNG and clock stay injected).

        The time-integrated batch history that attributes step times to requests is
        not saved: requests in flight across a restore teach acceptance, not cost.
        """

        def finite(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return {
            "version": 1,
            "arms": [str(a) for a in self.arms],
            "acceptance": [[list(k), m.to_state()] for k, m in sorted(self._acceptance.items())],
            "detectors": [[list(k), d.to_state()] for k, d in sorted(self._detectors.items())],
            "cost": {m: c.to_state() for m, c in sorted(self._cost.items())},
            "in_flight": self._in_flight_state(),
            "token_shares": {m: dict(s) for m, s in sorted(self._token_shares.items())},
            "shares_at": dict(self._shares_at),
            "overheads": {m: list(o) for m, o in sorted(self._overheads.items())},
            "bucket_concurrency": [
                [list(k), v] for k, v in sorted(self._bucket_concurrency.items())
            ],
            "observations": dict(self._observations),
            "plans": [
                [
                    list(k),
                    {
                        "at": p.at,
                        "observations": p.observations,
                        "thompson": {c: str(a) for c, a in sorted(p.thompson.items())},
                        "concurrency": p.concurrency,
                    },
                ]
                for k, p in sorted(self._plans.items())
            ],
            "commitments": [
                [
                    [c.model, c.workload_class, c.bucket],
                    {
                        "arm": str(m.arm),
                        "since": finite(m.since),
                        "reason": m.reason,
                        "speedup": m.speedup,
                        "interval": list(m.interval) if m.interval else None,
                    },
                ]
                for c, m in sorted(self._commitments.items())
            ],
            "class_requests": [[list(k), v] for k, v in sorted(self._class_requests.items())],
            "last_served": [[list(k), v] for k, v in sorted(self._last_served.items())],
            "probe_budget": [[list(k), v] for k, v in sorted(self._probe_budget.items())],
            "overrides": [
                [o.model, o.workload_class, o.bucket, str(o.arm)] for o in self._overrides
            ],
            "selected": self.selected,
            "explored": self.explored,
            "explore_rate": self._explore_rate,
            "knee_seen": dict(self._knee_seen),
            "trials": [
                [
                    list(k),
                    {
                        "assignment": {c: str(a) for c, a in t.assignment.items()},
                        "remaining": t.remaining,
                    },
                ]
                for k, t in sorted(self._trials.items())
            ],
            "bucket_requests": [[list(k), v] for k, v in sorted(self._bucket_requests.items())],
            "next_trial": [[list(k), list(v)] for k, v in sorted(self._next_trial.items())],
            "change_events": [asdict(e) for e in self.change_events],
        }

    def _in_flight_state(self) -> dict[str, dict[str, int]]:
        """Requests in flight per model and arm, whatever engines they sit in."""
        out: dict[str, dict[str, int]] = {}
        for (model, _), tracker in sorted(self._trackers.items()):
            for arm, count in tracker.counts.items():
                if count > 0:
                    out.setdefault(model, {})[str(arm)] = count
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (the arms must be the same)."""
        if state.get("version") != 1:
            raise ValueError(f"unsupported policy state version {state.get('version')!r}")
        if [str(a) for a in self.arms] != list(state["arms"]):
            raise ValueError("policy state was saved for different arms")
        self._acceptance = {}
        for key, value in state["acceptance"]:
            model = self._acceptance_model((key[0], key[1], key[2]))
            model.load_state(value)
        self._detectors = {}
        for key, value in state["detectors"]:
            detector = self._detectors[(key[0], key[1], key[2])] = ChangeDetector()
            detector.load_state(value)
        self._cost = {}
        for model_name, value in state["cost"].items():
            cost = self._cost[model_name] = StepCostModel(
                self.proposers, half_life_s=self.config.half_life_s
            )
            cost.load_state(value)
        self._trackers = {}
        for model_name, counts in state["in_flight"].items():
            for text, count in counts.items():
                arm = Arm.parse(text)
                self._tracker(model_name, arm).counts[arm] = int(count)
        self._token_shares = {m: dict(s) for m, s in state["token_shares"].items()}
        self._shares_at = dict(state["shares_at"])
        self._overheads = {
            m: deque(map(float, o), maxlen=_OVERHEAD_WINDOW)
            for m, o in state.get("overheads", {}).items()
        }
        self._bucket_concurrency = {(k[0], k[1]): v for k, v in state["bucket_concurrency"]}
        self._observations = dict(state["observations"])
        self._plans = {
            (k[0], k[1]): _Plan(
                p["at"],
                p["observations"],
                {c: Arm.parse(a) for c, a in p["thompson"].items()},
                float(p.get("concurrency", 0.0)),
            )
            for k, p in state["plans"]
        }
        self._commitments = {
            Context(c[0], c[1], c[2]): _Commitment(
                Arm.parse(m["arm"]),
                -math.inf if m["since"] is None else m["since"],
                m["reason"],
                m["speedup"],
                (m["interval"][0], m["interval"][1]) if m["interval"] else None,
            )
            for c, m in state["commitments"]
        }
        self._class_requests = {(k[0], k[1]): v for k, v in state["class_requests"]}
        self._last_served = {(k[0], k[1], k[2]): v for k, v in state["last_served"]}
        self._probe_budget = {(k[0], k[1]): float(v) for k, v in state.get("probe_budget", [])}
        self._overrides = [Override(o[0], o[1], o[2], Arm.parse(o[3])) for o in state["overrides"]]
        self.selected = int(state["selected"])
        self.explored = int(state["explored"])
        self._explore_rate = float(state["explore_rate"])
        self._knee_seen = {m: float(k) for m, k in state.get("knee_seen", {}).items()}
        # States saved before knee trials existed start without any.
        self._trials = {
            (k[0], k[1]): _Trial(
                {c: Arm.parse(a) for c, a in t["assignment"].items()}, int(t["remaining"])
            )
            for k, t in state.get("trials", [])
        }
        self._bucket_requests = {(k[0], k[1]): int(v) for k, v in state.get("bucket_requests", [])}
        self._next_trial = {
            (k[0], k[1]): (int(v[0]), float(v[1])) for k, v in state.get("next_trial", [])
        }
        self.change_events = [ChangeEvent(**e) for e in state["change_events"]]
