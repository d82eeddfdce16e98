"""Exploration: the Thompson arm within the exploration cap, probes that keep idle
proposers' acceptance fresh (priced against a per-class budget), and knee trials that
run a bucket one knee cell bolder now and then.

All of it is settled when a bucket is planned, as the share of each context's requests
that goes to each exploring arm (:class:`~policies.bandit.config.Route`); a request
only takes its turn (:meth:`Exploration.pick`), so nothing is priced on the request
path."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.arms import OFF, Arm, Context
from policies.bandit.config import ArmFit, BanditConfig, Route, _quantile
from policies.bandit.learning import Learning
from policies.estimators import StepCostModel, composition
from policies.fleet import (
    CostDraws,
    FloatArray,
    best_assignment,
    steady_goodput,
    steady_state_draws,
)

if TYPE_CHECKING:
    from policies.bandit.planning import _Plan

# Selections over which the exploration rate is averaged.
_EXPLORE_WINDOW = 200.0
# The pseudo-class of a class's exploring requests while exploration is weighed.
_EXPLORING = "\x00exploring"

Guard = Callable[
    [
        float,
        Mapping[str, float],
        Mapping[str, Arm],
        Mapping[tuple[str, Arm], FloatArray],
        CostDraws,
    ],
    tuple[dict[str, Arm], set[str]],
]
"""The planner's guard rail (see ``Planner.guard``)."""


@dataclass(slots=True)
class _Trial:
    """A bucket serving one batch's worth of requests a plan one knee cell bolder."""

    assignment: dict[str, Arm]
    remaining: int


class Exploration:
    """What is explored, probed and trialled, and the counts and budgets that bound it."""

    def __init__(
        self,
        config: BanditConfig,
        arms: tuple[Arm, ...],
        gammas: dict[str, list[int]],
        learning: Learning,
    ) -> None:
        self.config = config
        self.arms = arms
        self.gammas = gammas
        self.proposers = tuple(sorted(gammas))
        self.learning = learning
        self.class_requests: dict[tuple[str, str], int] = {}
        self.credits: dict[tuple[Context, Arm], float] = {}
        """Per context × exploring arm: the requests' worth of its share not taken yet
        (see :meth:`pick`)."""
        self.trials: dict[tuple[str, str], _Trial] = {}
        self.bucket_requests: dict[tuple[str, str], int] = {}
        self.next_trial: dict[tuple[str, str], tuple[int, float]] = {}
        """Per (model, bucket): requests served; the count from which a new knee trial
        may start (trials take at most ``explore_cap`` of a bucket's requests) and the
        knee estimate when the last one started."""
        self.selected = 0
        self.explored = 0
        self.explore_rate = 0.0

    def count_request(self, class_key: tuple[str, str]) -> None:
        self.class_requests[class_key] = self.class_requests.get(class_key, 0) + 1

    def may_explore(self) -> bool:
        # A moving rate, not a lifetime count: a quiet stretch must not bank budget
        # that is then spent in one burst.
        return self.explore_rate < self.config.explore_cap

    def count_selection(self, explored: bool) -> None:
        self.selected += 1
        self.explored += explored
        self.explore_rate += (float(explored) - self.explore_rate) / _EXPLORE_WINDOW

    def pick(self, context: Context, route: Route) -> tuple[Arm, str, bool]:
        """(arm, reason, explored) for one request of ``context``: its route's arm, or
        the exploring arm whose share's turn it is.

        A running knee trial serves every request of its bucket. Otherwise, while the
        moving exploration rate is below the cap, each exploring arm earns its share
        of a request per request, and one that has earned a whole request serves this
        one: shares are served evenly and exactly, with no random draw."""
        explore = route.explore
        if not explore:
            return route.arm, route.reason, False
        if explore[0][2] == "trial":
            if (context.model, context.bucket) in self.trials:
                return explore[0][0], "trial", True
            # The trial ended on this request path; the bucket's routes are
            # re-published off it, at the next observation.
            return route.arm, route.reason, False
        if route.reason == "override" or not self.may_explore():
            return route.arm, route.reason, False
        credits = self.credits
        chosen: tuple[Arm, str] | None = None
        for arm, share, reason in explore:
            key = (context, arm)
            credit = credits.get(key, 0.0) + share
            # (Shares summed in floating point: 25 × 0.04 may fall short of 1 by 1e-16.)
            if chosen is None and credit >= 1.0 - 1e-9:
                credit -= 1.0
                chosen = (arm, reason)
            credits[key] = credit
        if chosen is None:
            return route.arm, route.reason, False
        return chosen[0], chosen[1], True

    def count_bucket_request(self, key: tuple[str, str]) -> bool:
        """One more request of a bucket; True where that ends its knee trial."""
        self.bucket_requests[key] = self.bucket_requests.get(key, 0) + 1
        trial = self.trials.get(key)
        if trial is None:
            return False
        trial.remaining -= 1
        if trial.remaining > 0:
            return False
        del self.trials[key]
        return True

    def explore_share(self, model: str, workload_class: str) -> float:
        """The share of a class's requests its Thompson arm takes in the long run: the
        cap's share of all requests, as a share of the class's (all of them for a rare
        class)."""
        counts = [n for (m, _), n in self.class_requests.items() if m == model]
        total = sum(counts)
        if total <= 0:
            return 1.0
        requests = self.class_requests.get((model, workload_class), 0) / total
        return min(1.0, self.config.explore_cap / max(requests, 1e-9))

    def entries(
        self, context: Context, committed: Arm, plan: _Plan | None
    ) -> tuple[tuple[Arm, float, str], ...]:
        """What a context's route explores, by the bucket's plan and trial: the trial's
        arm (share 1 while the trial runs), else the Thompson arm and probes."""
        key = (context.model, context.bucket)
        cls = context.workload_class
        trial = self.trials.get(key)
        if trial is not None:
            arm = trial.assignment.get(cls, committed)
            return ((arm, 1.0, "trial"),) if arm != committed else ()
        if plan is None:
            return ()
        out: list[tuple[Arm, float, str]] = []
        sampled = plan.thompson.get(cls)
        if sampled is not None and sampled != committed:
            # Every request the cap lets through: the first ones after a plan, while
            # the posterior is widest, explore most.
            out.append((sampled, 1.0, "explore"))
        # Probes keep the acceptance of proposers a class does not use fresh, so their
        # drifts get noticed: one request in ``probe_every`` of the class each, where
        # it pays for itself, else as often as the class's budget affords.
        used = {committed.proposer, sampled.proposer if sampled is not None else None}
        priced = [
            (proposer, cost)
            for (of_class, proposer), cost in sorted(plan.probe_costs.items())
            if of_class == cls and proposer not in used
        ]
        costly = sum(1 for _, cost in priced if cost > 0.0)
        every = 1.0 / self.config.probe_every
        budget = self.config.probe_budget
        # One admitted request is about 1/n of an n-sequence batch's work while it
        # runs: it earns its class's probes ``probe_budget`` of that, shared by them.
        earned = budget / max(plan.concurrency, 1.0)
        for proposer, cost in priced:
            probe = Arm(proposer, min(self.gammas[proposer]))
            if self.unseen(context.model, cls, proposer) and (
                cost <= self.config.first_probe_max_cost
            ):
                out.append((probe, max(every, self.config.first_probe_share), "probe"))
            elif cost <= 0.0:
                out.append((probe, every, "probe"))
            elif cost <= budget * self.config.probe_burst:
                out.append((probe, min(every, earned / (costly * cost)), "probe"))
        return tuple(out)

    def unseen(self, model: str, workload_class: str, proposer: str) -> bool:
        """Whether a class × proposer acceptance still rests on fewer requests than
        ``BanditConfig.first_probes``: its price is the prior's guess, not evidence."""
        estimate = self.learning.acceptance.get((model, workload_class, proposer))
        return estimate is None or estimate.requests < self.config.first_probes

    def start_trial(
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
        guard: Guard,
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
        while it lasts (else the same plan for fewer of its classes, as many as that
        bound allows). Its requests count as exploration; trials take at most
        ``explore_cap`` of the bucket's requests. What the trial's batches show moves
        the knee estimate, and the ordinary plan follows.
        """
        key = (model, bucket)
        if key in self.trials:
            return
        knee = cost_model.mean_params().knee_tokens
        due, knee_then = self.next_trial.get(key, (0, math.inf))
        # A trial that moved the knee estimate up paid for itself (the plan now follows
        # it): the next step may follow at once. One that did not waits its turn.
        if self.bucket_requests.get(key, 0) < due and knee <= knee_then:
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
        proposal, _ = guard(concurrency, shares, proposal, drawn_e, worlds)
        if all(proposal.get(c, OFF) == served.get(c, OFF) for c in shares):
            return
        gain = steady_goodput(concurrency, shares, mean_tokens, proposal, bolder, topology) / max(
            steady_goodput(concurrency, shares, mean_tokens, served, bolder, topology), 1e-12
        )
        if gain < 1.0 + self.config.hysteresis:
            return
        # The worst the data allows: the knee right at the edge of the batches seen.
        edge = cost_model.edge_params()
        at_edge = steady_goodput(concurrency, shares, mean_tokens, served, edge, topology)

        def worst(assignment: Mapping[str, Arm]) -> float:
            moved = steady_goodput(concurrency, shares, mean_tokens, assignment, edge, topology)
            return moved / max(at_edge, 1e-12)

        floor = 1.0 - self.config.trial_max_loss
        # Where moving every class at once could cost too much, fewer classes move: the
        # batch then runs only partly past the edge, which is evidence on the knee all
        # the same (else a plan two γ steps bolder than the batches seen would never be
        # tried, and the knee estimate would stay where it is). Classes go back to
        # their arm one at a time, the one whose return lessens the worst case most
        # first.
        moving = sorted(c for c in shares if proposal.get(c, OFF) != served.get(c, OFF))
        while worst(proposal) < floor:
            if len(moving) <= 1:
                return
            back = max(moving, key=lambda c: worst({**proposal, c: served.get(c, OFF)}))
            proposal = {**proposal, back: served.get(back, OFF)}
            moving.remove(back)
        length = max(1, math.ceil(concurrency))
        self.trials[key] = _Trial(dict(proposal), length)
        spacing = math.ceil(length * (1.0 / self.config.explore_cap - 1.0))
        self.next_trial[key] = (self.bucket_requests.get(key, 0) + length + spacing, knee)

    def price_probes(self, model: str, plan: _Plan, served: Mapping[str, Arm]) -> None:
        """Price, into ``plan.probe_costs``, a probe of every proposer each class of the
        plan does not serve with, in the batch the plan expects (``plan.batch``)."""
        if plan.worlds is None:
            return
        for cls in sorted(plan.shares):
            committed = served.get(cls, OFF)
            context = Context(model, cls, "")
            for proposer in self.proposers:
                if proposer != committed.proposer:
                    probe = Arm(proposer, min(self.gammas[proposer]))
                    plan.probe_costs[(cls, proposer)] = self.probe_cost(
                        context, committed, probe, plan, plan.batch
                    )

    def probe_cost(
        self,
        context: Context,
        committed: Arm,
        probe: Arm,
        plan: _Plan,
        batch: Mapping[Arm, float],
    ) -> float:
        """Share of its engine's goodput a probe is predicted to cost while it runs
        (negative: it pays for itself) against serving the request with the committed
        arm, beside ``batch`` (the other sequences in flight, per arm): the mean over
        the plan's cost draws, as the budget bounds an average; where the knee is
        pinned to its grid cell, what it surely costs at most (in all but
        ``guard_quantile`` of the draws).

        The draws place the knee anywhere within its cell. While the knee estimate
        sits at the edge of the batches seen, a probe that runs the batch past it is
        also evidence on the knee, and the mean is a fair price. Once a batch ran past
        the knee, what is left is the cell's width, which no data resolves: at the
        mean, a probe that costs its batch if the knee lies low in the cell would pass
        for one that pays for itself, and with no budget at all run every
        ``probe_every`` requests of its class in a batch at the knee, for as long as it
        stays there. There the probe is priced as the guard and exploration price
        what they risk.

        Past the compute knee every verified position slows every sequence, and the
        probe's own accepted tokens are what pays that back. Drafting is paid once per
        step by every sequence of the batch, as long as any sequence drafts with the
        proposer: a probe pays its own drafting in full when nobody else drafts with
        its proposer, and shares it with the sequences that do (1/(users + 1) of it),
        so probes that run together share it without each one passing for free (the
        next probe only rides on the first for part of its life).
        """
        assert plan.worlds is not None
        worlds, cls = plan.worlds, context.workload_class
        if self.config.topology == "per_arm":
            # The probe runs in its own pool: it slows only the requests there.
            pool = {arm: n for arm, n in batch.items() if arm == probe and n > 0}
            if not pool:
                return 0.0
            before = worlds.step_time(*composition(pool))
            slowdown = worlds.step_time(*composition(pool, probe)) / before - 1.0
            return self.price(slowdown, plan)

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

        emitted = sum(count * tokens(arm) for arm, count in batch.items() if count > 0)
        served = emitted + tokens(committed, cls)
        probed = emitted + tokens(probe, cls)
        served_verify, served_depth = composition(batch, committed)
        probed_verify, probed_depth = composition(batch, probe)
        served_step = worlds.step_time(served_verify, served_depth)
        probed_step = worlds.step_time(probed_verify, probed_depth)
        users = sum(n for arm, n in batch.items() if arm.proposer == probe.proposer and n > 0)
        drafting = worlds.draft_cost.get(str(probe.proposer))
        if users > 0 and drafting is not None:
            alone = worlds.step_time(probed_verify, served_depth) + (
                drafting * worlds.step_s * probe.gamma
            )
            probed_step = probed_step + (alone - probed_step) / (users + 1)
        ratio = (probed / probed_step) / (served / served_step)
        return self.price(1.0 - ratio, plan)

    def price(self, costs: FloatArray, plan: _Plan) -> float:
        """A probe's price from its cost in each of the plan's draws (see
        :meth:`probe_cost`)."""
        if plan.knee_pinned:
            return _quantile(costs, 1.0 - self.config.guard_quantile)
        return float(np.mean(costs))

    def affordable_exploration(
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
        out = dict(thompson)
        for cls in sorted(thompson):
            if thompson[cls] == guarded.get(cls, OFF):
                continue
            explored = self.explore_share(model, cls)
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

    # -- persistence ---------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "class_requests": [[list(k), v] for k, v in sorted(self.class_requests.items())],
            "credits": sorted(
                [[c.model, c.workload_class, c.bucket, str(a)], v]
                for (c, a), v in self.credits.items()
            ),
            "selected": self.selected,
            "explored": self.explored,
            "explore_rate": self.explore_rate,
            "trials": [
                [
                    list(k),
                    {
                        "assignment": {c: str(a) for c, a in t.assignment.items()},
                        "remaining": t.remaining,
                    },
                ]
                for k, t in sorted(self.trials.items())
            ],
            "bucket_requests": [[list(k), v] for k, v in sorted(self.bucket_requests.items())],
            "next_trial": [[list(k), list(v)] for k, v in sorted(self.next_trial.items())],
        }

    @staticmethod
    def still_valid(state: dict[str, Any], fit: ArmFit) -> dict[str, Any]:
        """For other arms: credits and trials whose arms remain."""
        kept = dict(state)
        kept["credits"] = [[k, v] for k, v in state["credits"] if fit.valid(k[3])]
        kept["trials"] = [
            [k, t]
            for k, t in state["trials"]
            if all(fit.valid(a) for a in t["assignment"].values())
        ]
        return kept

    def load_state(self, state: dict[str, Any], fit: ArmFit) -> None:
        if not fit.same:
            state = self.still_valid(state, fit)
        self.class_requests = {(k[0], k[1]): v for k, v in state["class_requests"]}
        self.credits = {
            (Context(k[0], k[1], k[2]), Arm.parse(k[3])): float(v) for k, v in state["credits"]
        }
        self.selected = int(state["selected"])
        self.explored = int(state["explored"])
        self.explore_rate = float(state["explore_rate"])
        self.trials = {
            (k[0], k[1]): _Trial(
                {c: Arm.parse(a) for c, a in t["assignment"].items()}, int(t["remaining"])
            )
            for k, t in state["trials"]
        }
        self.bucket_requests = {(k[0], k[1]): int(v) for k, v in state["bucket_requests"]}
        self.next_trial = {(k[0], k[1]): (int(v[0]), float(v[1])) for k, v in state["next_trial"]}
