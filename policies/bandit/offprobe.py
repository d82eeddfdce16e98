"""Push mode's way back from off: a context committed to off tries speculation again now
and then, for a bounded time, at a spacing its predicted cost prices.

In routing mode a context on off keeps learning: probes and the Thompson arm send a
share of its requests to the proposers (``policies.bandit.exploration``). In push mode
a decision is a config its pool runs: while it runs off, no proposer drafts for the
context, its acceptance is never measured again, and the evidence that turned it off
(say a minute of prose n-gram could not draft) would hold it there for good. So every
``push_probe_every_s`` at the least, or as much longer as the probe's predicted cost
needs for probes to cost at most ``push_probe_budget`` of the context's goodput, the
context runs its most promising proposer's smallest γ for ``push_probe_s``; then the
evidence that probe gathered decides as any other does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from policies.arms import Arm, Context
from policies.bandit.config import ArmFit, BanditConfig, Prediction
from policies.reasons import Reason

if TYPE_CHECKING:
    from policies.bandit.commitment import _Commitment


class OffProbes:
    """When each context on off may probe next, and the probe to run then."""

    def __init__(self, config: BanditConfig, gammas: Mapping[str, list[int]]) -> None:
        self.config = config
        self.gammas = gammas
        self.next_at: dict[Context, float] = {}
        """Per context on off: when it may probe next (the policy's clock)."""

    def spacing(self, cost: float) -> float:
        """Seconds from one probe's start to the next: at least ``push_probe_every_s``,
        and long enough that a probe costing ``cost`` of its goodput while it runs
        costs at most ``push_probe_budget`` of it on average."""
        config = self.config
        priced = config.push_probe_s * max(cost, 0.0) / max(config.push_probe_budget, 1e-9)
        return max(config.push_probe_every_s, priced)

    def due(
        self,
        context: Context,
        commitment: _Commitment,
        predictions: Mapping[Arm, Prediction],
        now: float,
    ) -> tuple[Arm, Prediction | None] | None:
        """The probe ``context`` should start now, with what its bucket's plan predicts
        for it (``predictions``; none yet: no probe), or None. A context that is not on
        off forgets its schedule; one that just went off waits ``push_probe_every_s``
        first. A probe's cost is what the plan predicts it takes from the context's own
        goodput while it runs (1 − its predicted speed-up); one costing more than
        ``push_probe_max_cost`` never runs."""
        if not commitment.arm.is_off or commitment.reason == Reason.OVERRIDE:
            self.next_at.pop(context, None)
            return None
        first = self.next_at.setdefault(context, now + self.config.push_probe_every_s)
        if now < first or not predictions:
            return None
        candidates = [
            (arm, predicted)
            for arm in (Arm(p, min(gammas)) for p, gammas in sorted(self.gammas.items()))
            if (predicted := predictions.get(arm)) is not None
            and 1.0 - predicted.speedup <= self.config.push_probe_max_cost
        ]
        if not candidates:
            self.next_at[context] = now + self.config.push_probe_every_s
            return None
        # The proposer that may do best here (its predicted interval's top).
        arm, predicted = max(candidates, key=lambda c: c[1].interval[1])
        self.next_at[context] = now + self.spacing(1.0 - predicted.speedup)
        return arm, predicted

    # -- persistence ---------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "next_at": [
                [[c.model, c.workload_class, c.bucket], at]
                for c, at in sorted(self.next_at.items())
            ]
        }

    def load_state(self, state: Mapping[str, Any], fit: ArmFit) -> None:
        del fit  # the schedule names no arm
        self.next_at = {Context(c[0], c[1], c[2]): float(at) for c, at in state["next_at"]}
