"""Commitment: the arm each context is committed to, and how it moves towards the
plan within dwell and hysteresis (turning off for safety never waits)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.arms import OFF, Arm, Context
from policies.bandit.config import ArmFit, BanditConfig, Prediction, _quantile
from policies.bandit.learning import Learning
from policies.fleet import (
    CostDraws,
    CostParams,
    FloatArray,
    TokensPerStep,
    steady_state,
    steady_state_draws,
)


@dataclass(slots=True)
class _Commitment:
    arm: Arm
    since: float
    reason: str
    speedup: float | None = None
    interval: tuple[float, float] | None = None
    until: float | None = None
    """A push-mode probe holds until then (``policies.bandit.offprobe``)."""


class Commitments:
    """The committed arm per context, with its reason and predicted speed-up."""

    def __init__(self, config: BanditConfig, learning: Learning) -> None:
        self.config = config
        self.learning = learning
        self.commitments: dict[Context, _Commitment] = {}

    def adopt(self, context: Context, running: Arm) -> bool:
        """Start an uncommitted context on the arm its pool runs, as the incumbent;
        True where it was uncommitted."""
        if context in self.commitments:
            return False
        self.commitments[context] = _Commitment(running, -math.inf, "incumbent")
        return True

    def probe(self, context: Context, arm: Arm, prediction: Prediction | None, now: float) -> None:
        """Run ``arm`` for ``context`` for ``push_probe_s`` whatever the plans say."""
        self.commitments[context] = _Commitment(
            arm,
            now,
            "probe",
            prediction.speedup if prediction else None,
            prediction.interval if prediction else None,
            now + self.config.push_probe_s,
        )

    def release(self, model: str, workload_class: str | None = None) -> None:
        """Let the model's (or one class's) commitments move at once, past their dwell."""
        for context, commitment in self.commitments.items():
            if context.model == model and workload_class in (None, context.workload_class):
                commitment.since = -math.inf

    def commit(
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
        drawn_e: Mapping[tuple[str, Arm], FloatArray],
        worlds: CostDraws,
    ) -> None:
        """Move a context's committed arm towards the plan, within dwell and hysteresis.

        A switch happens when the whole plan beats the live assignment by the margin
        (classes move together: one class alone may gain too little to move while all
        of them together gain a lot), or when this class's own speed-up gains the
        margin without the bucket losing. Turning off for safety never waits.
        """
        candidate = guarded[cls]
        current = self.commitments.get(context)
        if current is not None and current.until is not None:
            if now < current.until:
                return  # a probe runs its time: its evidence is what it is for
            current.until = None
            if not self.learning.mature(context, current.arm):
                # It gathered too little to judge by: back to off, as before it.
                self.commitments[context] = _Commitment(OFF, now, "learning")
                return
        if current is None:
            self.commitments[context] = _Commitment(
                candidate, now, "guard_off" if cls in unsafe else "best"
            )
            return
        if candidate == current.arm:
            current.reason = "guard_off" if cls in unsafe else "best"
            return
        if self.config.moves_need_evidence:
            # A move is a push: it must rest on the running arm's own evidence, here:
            # its acceptance, and traffic at this concurrency (the cost of a batch size
            # never seen is only the model's guess).
            if (context.model, context.bucket) not in self.learning.bucket_concurrency or not (
                self.learning.mature(context, current.arm)
            ):
                current.reason = "incumbent"
                return
            if cls in unsafe and not current.arm.is_off and candidate.is_off:
                self.commitments[context] = _Commitment(OFF, now, "guard_off")
                return
            if not self.learning.mature(context, candidate):
                current.reason = "incumbent"
                return
            moved = {**live, cls: candidate}
            new_draws, _ = steady_state_draws(
                concurrency, shares, drawn_e, moved, worlds, self.config.topology
            )
            old_draws, _ = steady_state_draws(
                concurrency, shares, drawn_e, live, worlds, self.config.topology
            )
            ratios = new_draws / np.maximum(old_draws, 1e-12)
            if _quantile(ratios, self.config.guard_quantile) < 1.0:
                current.reason = "hysteresis"
                return
        elif cls in unsafe and not current.arm.is_off and candidate.is_off:
            self.commitments[context] = _Commitment(OFF, now, "guard_off")
            return
        if not (
            self.learning.mature(context, current.arm) and self.learning.mature(context, candidate)
        ):
            # Dwell and hysteresis protect decisions made on evidence; while the
            # posteriors are still mostly prior, following the plan is how they mature.
            self.commitments[context] = _Commitment(candidate, now, "learning")
            return
        if now - current.since < self.config.dwell_s:
            current.reason = "dwell"
            return
        margin = 1.0 + self.config.hysteresis
        if plan_gain >= margin:
            self.commitments[context] = _Commitment(candidate, now, "best")
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
            self.commitments[context] = _Commitment(candidate, now, "best")
        else:
            current.reason = "hysteresis"

    # -- persistence ---------------------------------------------------------------

    def to_state(self) -> list[Any]:
        def finite(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return [
            [
                [c.model, c.workload_class, c.bucket],
                {
                    "arm": str(m.arm),
                    "since": finite(m.since),
                    "reason": m.reason,
                    "speedup": m.speedup,
                    "interval": list(m.interval) if m.interval else None,
                    "until": m.until,
                },
            ]
            for c, m in sorted(self.commitments.items())
        ]

    def load_state(self, state: list[Any], fit: ArmFit) -> None:
        """Restore; for other arms, the commitments whose arms remain."""
        self.commitments = {
            Context(c[0], c[1], c[2]): _Commitment(
                Arm.parse(m["arm"]),
                -math.inf if m["since"] is None else m["since"],
                m["reason"],
                m["speedup"],
                (m["interval"][0], m["interval"][1]) if m["interval"] else None,
                m.get("until"),
            )
            for c, m in state
            if fit.same or fit.valid(m["arm"])
        }
