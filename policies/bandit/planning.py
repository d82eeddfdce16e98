"""Planning and guard rails: per bucket, draw plausible worlds, pick every class's arm
jointly, turn off what does not surely pay, and move the commitments."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.arms import OFF, Arm, Context
from policies.bandit.commitment import Commitments
from policies.bandit.config import ArmFit, BanditConfig, Prediction, _quantile
from policies.bandit.exploration import Exploration
from policies.bandit.learning import Learning, Moved
from policies.estimators import KNEE_CELL, AcceptanceModel
from policies.fleet import (
    CostDraws,
    FloatArray,
    best_assignment,
    steady_batch,
    steady_goodput,
    steady_state_draws,
)


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
    batch: dict[Arm, float] = field(default_factory=dict)
    """The other sequences a request of the bucket finds in flight, per arm, in the
    steady state of the committed arms (see :func:`policies.fleet.steady_batch`)."""
    probe_costs: dict[tuple[str, str], float] = field(default_factory=dict)
    """Per class × proposer it does not serve with: what a probe costs in ``batch``
    (``Exploration.probe_cost``). Not saved, like ``worlds``."""
    basis: _Basis | None = None
    """What the plan's predictions are made from (see :meth:`Planner.predictions`).
    Not saved, like ``worlds``."""
    predictions: dict[str, dict[Arm, Prediction]] = field(default_factory=dict)
    """Per class, once asked: what each arm would do for it, the others as served."""


@dataclass(frozen=True, slots=True)
class _Basis:
    """A plan's posterior draws and assignment, from which an arm's prediction for a
    class is made on demand: a bucket is re-planned far more often than anyone asks."""

    concurrency: float
    shares: Mapping[str, float]
    drawn_e: Mapping[tuple[str, Arm], FloatArray]
    served: Mapping[str, Arm]
    worlds: CostDraws


class Planner:
    """Each bucket's latest plan, and the knee estimate the latest plan of a model used."""

    def __init__(
        self,
        config: BanditConfig,
        arms: tuple[Arm, ...],
        gammas: dict[str, list[int]],
        learning: Learning,
        exploration: Exploration,
        commitments: Commitments,
    ) -> None:
        self.config = config
        self.arms = arms
        self.gammas = gammas
        self.proposers = tuple(sorted(gammas))
        self.learning = learning
        self.exploration = exploration
        self.commitments = commitments
        self.plans: dict[tuple[str, str], _Plan] = {}
        self.knee_seen: dict[str, float] = {}
        """Per model: the knee estimate the latest plan used."""

    def concurrency_moved(self, moved: Moved) -> None:
        """Drop the plan of every bucket whose concurrency moved by more than 10 %."""
        for key, estimate in moved:
            planned = self.plans.get(key)
            if planned is not None and abs(estimate - planned.concurrency) > 0.1 * estimate:
                del self.plans[key]

    def drop_model(self, model: str) -> None:
        """Re-plan every bucket of the model at its next decision."""
        for plan_key in [k for k in self.plans if k[0] == model]:
            del self.plans[plan_key]

    def plan_if_due(self, model: str, bucket: str, now: float, rng: np.random.Generator) -> bool:
        """Re-plan the bucket if its plan is missing or stale; True where it did."""
        plan = self.plans.get((model, bucket))
        observations = self.learning.observations.get(model, 0)
        # Early on every observation changes the picture a lot: re-plan more often.
        every = min(self.config.refresh_observations, max(4, observations // 4))
        if (
            plan is not None
            and observations - plan.observations < every
            and now - plan.at < self.config.refresh_s
            and not self._lacks_a_class(model, plan)
        ):
            return False
        self.plan(model, bucket, now, observations, rng)
        return True

    def _lacks_a_class(self, model: str, plan: _Plan) -> bool:
        """Whether a class finished its first requests since the plan was made: until
        a plan has it, the class gets no probes and runs off (or cold), which costs most
        for the long requests that finish last."""
        shares = self.learning.token_shares.get(model, {})
        # ``thompson`` has an arm for every class the plan weighed, and is saved.
        return any(v > 0 and c not in plan.thompson for c, v in shares.items())

    def plan(
        self, model: str, bucket: str, now: float, observations: int, rng: np.random.Generator
    ) -> None:
        """Re-plan one bucket: draw worlds, pick arms jointly, guard, commit."""
        shares = {c: v for c, v in self.learning.token_shares.get(model, {}).items() if v > 0}
        cost_model = self.learning.cost.get(model)
        if not shares or cost_model is None or not cost_model.ready:
            self.plans[(model, bucket)] = _Plan(
                now, observations, {}, concurrency=self.learning.concurrency(model, bucket)
            )
            return
        draws = self.config.posterior_draws
        classes = sorted(shares)
        # Expected tokens per step for every class × arm: posterior means and draws.
        mean_e: dict[tuple[str, Arm], float] = {}
        drawn_e: dict[tuple[str, Arm], FloatArray] = {}
        for cls in classes:
            for proposer in self.proposers:
                acceptance = self.learning.acceptance_model((model, cls, proposer))
                means = AcceptanceModel.expected_tokens(acceptance.mean_conditionals())
                drawn = AcceptanceModel.expected_tokens(acceptance.sample_conditionals(rng, draws))
                for gamma in self.gammas[proposer]:
                    mean_e[(cls, Arm(proposer, gamma))] = float(means[gamma])
                    drawn_e[(cls, Arm(proposer, gamma))] = drawn[:, gamma]

        def mean_tokens(cls: str, arm: Arm) -> float:
            return 1.0 if arm.proposer is None else mean_e[(cls, arm)]

        def first_draw_tokens(cls: str, arm: Arm) -> float:
            return 1.0 if arm.proposer is None else float(drawn_e[(cls, arm)][0])

        concurrency = self.learning.concurrency(model, bucket)
        mean_cost = cost_model.mean_params()
        if self.knee_seen.get(model, mean_cost.knee_tokens) != mean_cost.knee_tokens:
            # New evidence on the knee (typically a knee trial's batches): decisions
            # held back by the old estimate may move now, as after a drift.
            self.commitments.release(model)
        self.knee_seen[model] = mean_cost.knee_tokens
        cost_draws = cost_model.sample_params(rng, draws)
        worlds = CostDraws.stack(cost_draws)
        committed = {
            cls: c.arm
            for cls in classes
            if (c := self.commitments.commitments.get(Context(model, cls, bucket))) is not None
        }
        topology = self.config.topology
        best = best_assignment(
            concurrency, shares, mean_tokens, self.arms, mean_cost, committed, topology=topology
        )
        guarded, unsafe = self.guard(concurrency, shares, best, drawn_e, worlds)
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
        cell = KNEE_CELL ** rng.uniform(-0.5, 0.5, len(worlds.knee_tokens))
        blurred = dataclasses.replace(worlds, knee_tokens=worlds.knee_tokens * cell)
        mean_world = CostDraws.stack([mean_cost] * len(cell))
        blurred_mean = dataclasses.replace(mean_world, knee_tokens=mean_world.knee_tokens * cell)
        thompson = self.exploration.affordable_exploration(
            model, concurrency, shares, guarded, thompson, drawn_e, blurred_mean
        )
        plan = self.plans[(model, bucket)] = _Plan(
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
        _, unsafe_live = self.guard(concurrency, shares, live, drawn_e, worlds)
        plan_gain = steady_goodput(
            concurrency, shares, mean_tokens, guarded, mean_cost, topology
        ) / max(steady_goodput(concurrency, shares, mean_tokens, live, mean_cost, topology), 1e-12)
        for cls in classes:
            self.commitments.commit(
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
                drawn_e,
                worlds,
            )
        served = {c: self.commitments.commitments[Context(model, c, bucket)].arm for c in classes}
        plan.batch = steady_batch(concurrency, shares, mean_tokens, served, mean_cost, topology)
        self.exploration.price_probes(model, plan, served)
        plan.basis = _Basis(concurrency, shares, drawn_e, served, worlds)
        for cls, arm in served.items():
            commitment = self.commitments.commitments[Context(model, cls, bucket)]
            predicted = self.predict(plan.basis, cls, [arm])[arm]
            commitment.speedup, commitment.interval = predicted.speedup, predicted.interval
        self.exploration.start_trial(
            model,
            bucket,
            concurrency,
            shares,
            served,
            mean_e,
            drawn_e,
            worlds,
            cost_model,
            self.guard,
        )

    def predictions(self, plan: _Plan, cls: str) -> dict[Arm, Prediction]:
        """What each arm would do for ``cls`` by ``plan`` (made once, when first asked);
        empty for a plan that priced nothing (no cost model yet, or restored)."""
        if cls not in plan.predictions:
            if plan.basis is None or cls not in plan.basis.served:
                return {}
            plan.predictions[cls] = self.predict(plan.basis, cls, self.arms)
        return plan.predictions[cls]

    def predict(self, basis: _Basis, cls: str, arms: Sequence[Arm]) -> dict[Arm, Prediction]:
        """What each of ``arms`` would do for ``cls`` while the other classes run what
        they are served: the class's tokens per second on that arm over its tokens per
        second off, per posterior draw (so off is exactly 1, and an arm that slows the
        batch more than its accepted tokens gain is below 1): the draws' median, which
        lies within their 10–90 % range as a skewed posterior's mean may not."""
        topology = self.config.topology
        shares, drawn_e, served = basis.shares, basis.drawn_e, basis.served
        _, off_step = steady_state_draws(
            basis.concurrency, shares, drawn_e, {**served, cls: OFF}, basis.worlds, topology
        )
        out: dict[Arm, Prediction] = {}
        for arm in arms:
            if arm.proposer is None:
                out[arm] = Prediction(1.0, (1.0, 1.0))
                continue
            _, step = steady_state_draws(
                basis.concurrency, shares, drawn_e, {**served, cls: arm}, basis.worlds, topology
            )
            values = drawn_e[(cls, arm)] * off_step[cls] / step[cls]
            out[arm] = Prediction(
                float(np.median(values)), (_quantile(values, 0.1), _quantile(values, 0.9))
            )
        return out

    def guard(
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

    # -- persistence ---------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The plans' schedule and Thompson arms; their cost draws are not saved: a
        restored plan prices no probes until the bucket is re-planned."""
        return {
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
                for k, p in sorted(self.plans.items())
            ],
            "knee_seen": dict(self.knee_seen),
        }

    def load_state(self, state: dict[str, Any], fit: ArmFit) -> None:
        """Restore; for other arms, the plans whose arms all remain."""
        self.plans = {
            (k[0], k[1]): _Plan(
                p["at"],
                p["observations"],
                {c: Arm.parse(a) for c, a in p["thompson"].items()},
                float(p["concurrency"]),
            )
            for k, p in state["plans"]
            if fit.same or all(fit.valid(a) for a in p["thompson"].values())
        }
        self.knee_seen = {m: float(k) for m, k in state["knee_seen"].items()}
