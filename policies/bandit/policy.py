"""The policy: one object the controller, the simulator and the benchmark talk to,
composed of the parts that each own their state (see the package's docstring)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from collectors.observations import RequestObservation, WindowObservation
from policies.arms import OFF, Arm, Context, sorted_arms
from policies.bandit.commitment import Commitments, _Commitment
from policies.bandit.config import (
    DEFAULT_MODEL,
    WILDCARD,
    ArmFit,
    BanditConfig,
    Decision,
    Override,
    Overrides,
    Prediction,
    Route,
)
from policies.bandit.exploration import Exploration
from policies.bandit.learning import Learning, Moved
from policies.bandit.offprobe import OffProbes
from policies.bandit.planning import Planner
from policies.bandit.state import STATE_VERSION, migrate
from policies.base import Clock
from policies.estimators import AcceptanceModel, ChangeEvent


class SpecPilotPolicy:
    """The structured bandit. See the package docstring for what it learns and guards."""

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
        self.gammas: dict[str, list[int]] = {}
        for arm in self.arms:
            if arm.proposer is not None:
                self.gammas.setdefault(arm.proposer, []).append(arm.gamma)
        self.proposers = tuple(sorted(self.gammas))
        self._overrides = Overrides()
        self.learning = Learning(self.config, self.gammas)
        self.exploration = Exploration(self.config, self.arms, self.gammas, self.learning)
        self.commitment = Commitments(self.config, self.learning)
        self.off_probes = OffProbes(self.config, self.gammas)
        self.planner = Planner(
            self.config, self.arms, self.gammas, self.learning, self.exploration, self.commitment
        )
        self._routes: dict[Context, Route] = {}
        """Per context: how its requests are served until its bucket is re-planned."""
        self._planned: set[tuple[str, str]] = set()
        """(model, bucket)s planned at least once."""
        self._demand: set[tuple[str, str]] = set()
        """(model, bucket)s that served requests since they were last planned."""
        self._trial_ended: set[tuple[str, str]] = set()
        """(model, bucket)s whose knee trial ended since their routes were published."""

    # -- the controller's API ------------------------------------------------------

    def context(self, model: str, workload_class: str, concurrency: int) -> Context:
        """The context of a request, bucketed with this policy's bucket edges."""
        return Context(model, workload_class, self.config.buckets.bucket(concurrency))

    def select(self, context: Context) -> Arm:
        """The arm for one request of ``context`` (may explore, within the cap)."""
        return self._serve(context)[0]

    def best_guess(self, context: Context) -> Arm:
        """The context's arm bar exploration, as its route has it (nothing re-plans)."""
        route = self._routes.get(context)
        return route.arm if route is not None else self._route(context).arm

    def choose(self, context: Context) -> Decision:
        """Per-request decision: the committed arm, or an exploration arm."""
        arm, reason, explored, route = self._serve(context)
        if explored:
            return Decision(context, arm, reason, explored=True)
        return Decision(context, arm, reason, route.speedup, route.interval)

    def _serve(self, context: Context) -> tuple[Arm, str, bool, Route]:
        """The request path: the context's route, its turn of exploration, and the
        bookkeeping that attributes what the request shows when it finishes.

        Nothing here plans or re-publishes: a bucket's first requests go as its
        commitments say (off, learning, where it has none) and the next observation
        plans it; a knee trial that ends here leaves its bucket's routes to be
        re-published there too (``Exploration.pick`` serves the route's arm meanwhile).
        A plan takes milliseconds, a bucket's routes tens of microseconds."""
        route = self._stored_route(context)
        # Picked before counting: a trial's last request is still the trial's.
        arm, reason, explored = self.exploration.pick(context, route)
        trial_over = self._count(context)
        self._account(context, arm, explored, trial_over, self.clock())
        return arm, reason, explored, route

    def route(self, context: Context) -> Route:
        """How ``context``'s requests are served now (see :class:`Route`), for a router
        of its own: off the request path, so its bucket is planned first if it never
        was, and re-published if a knee trial ended since."""
        self._publish_ended_trials(context.model)
        self._plan_new_bucket(context.model, context.bucket)
        return self._stored_route(context)

    def _stored_route(self, context: Context) -> Route:
        """The context's published route, or (none yet) the one its commitments give."""
        route = self._routes.get(context)
        if route is None:
            route = self._routes[context] = self._route(context)
        return route

    def served(self, context: Context, arm: Arm, explored: bool, at: float) -> None:
        """A request of ``context`` that a router of its own sent to ``arm`` by
        :meth:`routes` (``explored``: not to the route's arm), at ``at`` (the policy's
        clock): the bookkeeping ``select`` does for the requests it serves."""
        self._account(context, arm, explored, self._count(context), at)

    def _count(self, context: Context) -> bool:
        """One more request of the context's class and bucket; True where that ends
        the bucket's knee trial."""
        self.exploration.count_request((context.model, context.workload_class))
        return self.exploration.count_bucket_request((context.model, context.bucket))

    def _account(
        self, context: Context, arm: Arm, explored: bool, trial_over: bool, at: float
    ) -> None:
        bucket = (context.model, context.bucket)
        self.exploration.count_selection(explored)
        if trial_over:
            self._trial_ended.add(bucket)
        self._moved(self.learning.serve(context, arm, at))
        self._demand.add(bucket)

    def routes(self) -> dict[Context, Route]:
        """Every context's route as planned so far: the arm its requests get and the
        shares of them that explore (see :class:`Route`). Plain data that pickles, for
        a process that routes requests by itself; ``select`` serves from the same."""
        self._publish_ended_trials()
        return dict(self._routes)

    def decide(self, context: Context, *, running: Arm | None = None) -> Decision:
        """The committed arm for a context (no exploration), with its reason; re-plans
        its bucket first if that is due (this is the control loop's call, not the
        request path's).

        ``running``: the arm the context's pool runs now. Where moves need evidence
        (``BanditConfig.moves_need_evidence``) a context the policy has not committed
        yet starts there, as the incumbent, instead of at off.
        """
        override = self._overrides.for_context(context)
        if override is not None:
            return Decision(context, override.arm, "override")
        self._catch_up()
        adopted = False
        if running is not None and self.config.moves_need_evidence and running in self.arms:
            adopted = self.commitment.adopt(context, running)
        planned = self.planner.plan_if_due(context.model, context.bucket, self.clock(), self.rng)
        if planned or adopted or (context.model, context.bucket) in self._trial_ended:
            self._publish(context.model, context.bucket)
        commitment = self.commitment.commitments.get(context)
        if commitment is None:
            return Decision(context, OFF, "learning")
        if self.config.moves_need_evidence:
            plan = self.planner.plans.get((context.model, context.bucket))
            predictions = self.planner.predictions(plan, context.workload_class) if plan else {}
            probe = self.off_probes.due(context, commitment, predictions, self.clock())
            if probe is not None:
                self.commitment.probe(context, *probe, self.clock())
                self._publish(context.model, context.bucket)
                commitment = self.commitment.commitments[context]
        return Decision(
            context, commitment.arm, commitment.reason, commitment.speedup, commitment.interval
        )

    def predictions(self, context: Context) -> dict[Arm, Prediction]:
        """What each arm would do for ``context`` by its bucket's latest plan (see
        :class:`Prediction`); empty until a plan priced the bucket (a restored plan
        prices nothing until it is made again)."""
        plan = self.planner.plans.get((context.model, context.bucket))
        if plan is None:
            return {}
        return dict(self.planner.predictions(plan, context.workload_class))

    def observe(self, observation: RequestObservation) -> None:
        """Learn from one finished request (acceptance, cost, mix, drift), then re-plan
        the buckets of its model that had requests and are due."""
        self._learned(self.learning.observe(observation, self.clock()))
        self._refresh(observation.model or DEFAULT_MODEL)

    def observe_window(self, window: WindowObservation) -> None:
        """Learn from a worker's ``/metrics`` window: acceptance, step cost, mix and
        drift as from its requests, weighted as the requests it covers.

        The batch composition comes from the window itself (its mean running requests
        on the arm its config runs), not from requests this policy served: a worker
        whose clients reach it directly was never asked.
        """
        self._learned(self.learning.observe_window(window, self.arms, self.clock()))
        self._refresh(window.model or DEFAULT_MODEL)

    def _learned(self, result: tuple[Moved, tuple[str, str] | None] | None) -> None:
        if result is None:
            return
        moved, changed = result
        self._moved(moved)
        if changed is not None:
            # A drift: re-plan every bucket of the model now; the class's commitments
            # may move.
            model, cls = changed
            self.planner.drop_model(model)
            self.commitment.release(model, cls)

    def _moved(self, moved: Moved) -> None:
        self.planner.concurrency_moved(moved)

    def _catch_up(self) -> None:
        """Account for the requests served so far before reading what they change."""
        self._moved(self.learning.catch_up())

    def _refresh(self, model: str) -> None:
        """Re-plan, off the request path, each bucket of ``model`` that served requests
        since it was last planned, if it is due."""
        now = self.clock()
        for key in sorted(k for k in self._demand if k[0] == model):
            if self.planner.plan_if_due(model, key[1], now, self.rng):
                self._demand.discard(key)
                self._publish(*key)
        self._publish_ended_trials(model)

    def _publish_ended_trials(self, model: str | None = None) -> None:
        """Re-publish the buckets (of ``model``, or all) whose knee trial ended."""
        for key in sorted(k for k in self._trial_ended if model in (None, k[0])):
            self._publish(*key)

    def _plan_new_bucket(self, model: str, bucket: str) -> None:
        """Plan a bucket that never was (once per bucket; off the request path)."""
        key = (model, bucket)
        if key in self.planner.plans or key in self._planned:
            return
        self._catch_up()
        self.planner.plan(
            model, bucket, self.clock(), self.learning.observations.get(model, 0), self.rng
        )
        self._publish(*key)

    def _route(self, context: Context) -> Route:
        override = self._overrides.for_context(context)
        if override is not None:
            return Route(override.arm, "override")
        commitment = self.commitment.commitments.get(context)
        if commitment is None:
            return Route(self._cold_arm(context), "learning")
        plan = self.planner.plans.get((context.model, context.bucket))
        return Route(
            commitment.arm,
            commitment.reason,
            commitment.speedup,
            commitment.interval,
            self.exploration.entries(context, commitment.arm, plan),
        )

    def _cold_arm(self, context: Context) -> Arm:
        """The arm of a class before its bucket's plan has it: ``cold_proposer`` at
        its smallest γ where the bucket's batch stays within ``cold_max_positions``
        verified positions a step, else off.

        The blind start bets on the prior's guess at the class's acceptance; a class
        whose own requests already put it below that guess (a new bucket of a class
        seen elsewhere) waits off for its plan instead."""
        proposer = self.config.cold_proposer
        if proposer is None or proposer not in self.gammas:
            return OFF
        key = (context.model, context.workload_class, proposer)
        if not self.exploration.unseen(*key):
            seen = self.learning.acceptance[key]
            if seen.mean_conditionals()[0] < seen.prior_mean:
                return OFF
        gamma = min(self.gammas[proposer])
        most = self.config.buckets.upper(context.bucket)
        if most is None or most * (gamma + 1) > self.config.cold_max_positions:
            return OFF
        return Arm(proposer, gamma)

    def _publish(self, model: str, bucket: str) -> None:
        """Route every context of a bucket as its latest plan and commitments say."""
        self._planned.add((model, bucket))
        self._trial_ended.discard((model, bucket))
        for context in [*self.commitment.commitments, *self._routes]:
            if context.model == model and context.bucket == bucket:
                self._routes[context] = self._route(context)

    def _publish_all(self) -> None:
        self._trial_ended.clear()
        for context in [*self.commitment.commitments, *self._routes]:
            self._routes[context] = self._route(context)

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
        override = Override(model, workload_class, bucket, arm)
        self._overrides.set(override)
        self._publish_all()
        return override

    def clear_override(
        self, *, model: str = WILDCARD, workload_class: str = WILDCARD, bucket: str = WILDCARD
    ) -> bool:
        cleared = self._overrides.clear(model, workload_class, bucket)
        self._publish_all()
        return cleared

    @property
    def overrides(self) -> tuple[Override, ...]:
        return tuple(self._overrides.entries)

    @property
    def change_events(self) -> list[ChangeEvent]:
        return self.learning.change_events

    @property
    def selected(self) -> int:
        return self.exploration.selected

    @property
    def explored(self) -> int:
        return self.exploration.explored

    @property
    def explore_fraction(self) -> float:
        return self.explored / self.selected if self.selected else 0.0

    # -- read-out and persistence --------------------------------------------------

    def estimates(self) -> dict[str, Any]:
        """What the policy believes, JSON-able, for ``GET /v1/policy``."""
        self._catch_up()
        contexts = [
            self._commitment_entry(ctx, c) for ctx, c in sorted(self.commitment.commitments.items())
        ]
        acceptance = [
            self._acceptance_entry(key, estimate)
            for key, estimate in sorted(self.learning.acceptance.items())
        ]
        costs = []
        for model, cost_model in sorted(self.learning.cost.items()):
            if not cost_model.ready:
                continue
            params = cost_model.mean_params()
            relative: dict[str, dict[str, float]] = {}
            for bucket in self.config.buckets.labels:
                n = self.learning.concurrency(model, bucket)
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
                for o in self._overrides.entries
            ],
            "change_events": [asdict(e) for e in self.change_events],
            "explore_fraction": self.explore_fraction,
        }

    @staticmethod
    def _commitment_entry(ctx: Context, c: _Commitment) -> dict[str, Any]:
        return {
            "model": ctx.model,
            "workload_class": ctx.workload_class,
            "bucket": ctx.bucket,
            "arm": str(c.arm),
            "reason": c.reason,
            "since_s": c.since if math.isfinite(c.since) else None,
            "predicted_speedup": c.speedup,
            "interval": list(c.interval) if c.interval else None,
        }

    def _acceptance_entry(
        self, key: tuple[str, str, str], estimate: AcceptanceModel
    ) -> dict[str, Any]:
        model, cls, proposer = key
        conditionals = estimate.mean_conditionals()
        expected = AcceptanceModel.expected_tokens(conditionals)
        return {
            "model": model,
            "workload_class": cls,
            "proposer": proposer,
            "first_position_acceptance": float(conditionals[0]),
            "expected_tokens": {str(g): float(expected[g]) for g in self.gammas[proposer]},
            "requests": estimate.requests,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything learned and committed, JSON-able (RNG and clock stay injected),
        one entry per part; ``load_state_dict`` migrates older versions."""
        self._catch_up()
        return {
            "version": STATE_VERSION,
            "arms": [str(a) for a in self.arms],
            "overrides": self._overrides.to_state(),
            "learning": self.learning.to_state(),
            "planning": self.planner.to_state(),
            "exploration": self.exploration.to_state(),
            "commitment": self.commitment.to_state(),
            "off_probes": self.off_probes.to_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, of this version or an older one.

        A state saved for other arms (the settings widened a γ range, added or removed
        a proposer) keeps what still holds here: acceptance and drift of proposers that
        remain, the traffic mix and concurrency, and commitments, overrides, plans and
        trials whose arms remain; the step-cost fit only if the proposers are the same.
        """
        state = migrate(state)
        arms = [str(a) for a in self.arms]
        fit = ArmFit(frozenset(arms), self.proposers, arms == list(state["arms"]))
        self.learning.load_state(state["learning"], fit)
        self.planner.load_state(state["planning"], fit)
        self.commitment.load_state(state["commitment"], fit)
        self.exploration.load_state(state["exploration"], fit)
        self.off_probes.load_state(state["off_probes"], fit)
        self._overrides.load_state(state["overrides"], fit)
        self._routes = {}
        self._trial_ended = set()
        self._planned = {(c.model, c.bucket) for c in self.commitment.commitments}
        self._demand = set(self._planned)
        self._publish_all()
