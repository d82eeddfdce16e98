"""How a batch of sequences with mixed arms turns into step time and goodput.

One home for the cost model shared by the simulator (as its physics), the oracle (with
the true parameters) and specpilot's bandit (with learned ones).

A decode step verifies ``γ + 1`` positions for every speculating sequence and one for
every plain one. It costs ``step_s`` while decode is memory-bound and grows linearly
once the batch verifies more than ``knee_tokens`` positions (compute-bound):
``step_s × max(1, T / knee_tokens)``. Each proposer in use adds its drafting: one
draft forward per draft position, ``draft_cost × step_s`` each, for as many positions
as the deepest γ among its sequences (drafts are small, so they stay memory-bound).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.arms import OFF, Arm


@dataclass(frozen=True, slots=True)
class CostParams:
    """Step-time model of one engine. Times in seconds, costs relative to ``step_s``."""

    step_s: float
    """A plain decode step while memory-bound (batch 1)."""
    knee_tokens: float
    """Verified positions per step beyond which a step becomes compute-bound."""
    draft_cost: Mapping[str, float]
    """Per proposer: one draft position's time as a fraction of ``step_s``."""

    def step_time(self, verify_tokens: float, draft_depth: Mapping[str, int]) -> float:
        """Seconds for one step verifying ``verify_tokens`` positions in all.

        ``draft_depth`` maps each proposer in use to the largest γ among its sequences.
        """
        verify = self.step_s * max(1.0, verify_tokens / self.knee_tokens)
        drafting = sum(
            self.draft_cost.get(p, 0.0) * self.step_s * depth for p, depth in draft_depth.items()
        )
        return verify + drafting

    def batch_step_time(self, arms: Iterable[Arm]) -> float:
        """Step time of a batch given every sequence's arm."""
        verify = 0
        depth: dict[str, int] = {}
        for arm in arms:
            verify += arm.verify_tokens
            if arm.proposer is not None:
                depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
        return self.step_time(verify, depth)


TokensPerStep = Callable[[str, Arm], float]
"""Expected tokens one step emits for a class under an arm (1 for off)."""

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CostDraws:
    """Several plausible :class:`CostParams` at once (posterior draws), as arrays."""

    step_s: FloatArray
    knee_tokens: FloatArray
    draft_cost: Mapping[str, FloatArray]

    @classmethod
    def stack(cls, draws: Sequence[CostParams]) -> CostDraws:
        proposers = sorted({p for d in draws for p in d.draft_cost})
        return cls(
            np.array([d.step_s for d in draws]),
            np.array([d.knee_tokens for d in draws]),
            {p: np.array([d.draft_cost.get(p, 0.0) for d in draws]) for p in proposers},
        )

    def step_time(self, verify_tokens: float, draft_depth: Mapping[str, int]) -> FloatArray:
        verify: FloatArray = self.step_s * np.maximum(1.0, verify_tokens / self.knee_tokens)
        for proposer, depth in draft_depth.items():
            if proposer in self.draft_cost:
                verify = verify + self.draft_cost[proposer] * self.step_s * depth
        return verify


def steady_state_draws(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens: Mapping[tuple[str, Arm], FloatArray],
    assignment: Mapping[str, Arm],
    cost: CostDraws,
) -> tuple[FloatArray, FloatArray]:
    """(tokens per second, seconds per step) per draw of a closed loop of streams.

    ``tokens[(class, arm)]`` holds each draw's expected tokens per step (off is 1).
    ``token_shares`` is each class's share of the generated tokens it asks for (its
    request share × its mean output length). In steady state a class occupies batch
    slots in proportion to the steps its tokens need (Little's law), i.e. share / E;
    all slots then advance one step per step time.
    """
    size = len(cost.step_s)
    slots = np.zeros(size)
    verify = np.zeros(size)
    total_share = 0.0
    depth: dict[str, int] = {}
    for cls, share in token_shares.items():
        if share <= 0:
            continue
        arm = assignment.get(cls, OFF)
        weight = share / tokens[(cls, arm)] if arm.proposer is not None else np.full(size, share)
        slots = slots + weight
        verify = verify + weight * arm.verify_tokens
        total_share += share
        if arm.proposer is not None:
            depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
    if total_share <= 0 or concurrency <= 0:
        return np.zeros(size), cost.step_time(0.0, {})
    step = cost.step_s * np.maximum(1.0, concurrency * verify / slots / cost.knee_tokens)
    for proposer, deepest in depth.items():
        if proposer in cost.draft_cost:
            step = step + cost.draft_cost[proposer] * cost.step_s * deepest
    return concurrency * total_share / slots / step, step


def steady_state(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
) -> tuple[float, float]:
    """(tokens per second, seconds per step) for one set of figures.

    See :func:`steady_state_draws`; this is the single-draw form.
    """
    tokens = {
        (cls, arm): np.array([tokens_per_step(cls, arm)])
        for cls, arm in ((c, assignment.get(c, OFF)) for c in token_shares)
        if arm.proposer is not None
    }
    goodput, step = steady_state_draws(
        concurrency, token_shares, tokens, assignment, CostDraws.stack([cost])
    )
    return float(goodput[0]), float(step[0])


def steady_goodput(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
) -> float:
    """Generated tokens per second in steady state (see :func:`steady_state_draws`)."""
    return steady_state(concurrency, token_shares, tokens_per_step, assignment, cost)[0]


def best_assignment(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    arms: Sequence[Arm],
    cost: CostParams,
    start: Mapping[str, Arm] | None = None,
    max_rounds: int = 4,
) -> dict[str, Arm]:
    """The per-class arms that maximise :func:`steady_goodput`.

    Classes share a batch, so one class's arm changes what the others pay: a proposer
    whose drafting two classes share can look indispensable to each of them alone.
    Coordinate ascent (each round re-picks every class's best arm given the rest until
    nothing changes) therefore runs from the current decisions, which keeps the answer
    stable when several are equally good, and from everything off; the better end
    point wins. The objective is evaluated incrementally (this runs inside every
    re-plan): with the other classes fixed, slots W, verified positions V and drafting
    depths are sums and maxima that one class's arm only adds to.
    """
    classes = sorted(c for c, s in token_shares.items() if s > 0)
    if not classes or concurrency <= 0:
        return {c: (start or {}).get(c, OFF) for c in classes}
    expected = {(c, a): tokens_per_step(c, a) for c in classes for a in arms}
    for cls, arm in (start or {}).items():
        if cls in token_shares:
            expected[(cls, arm)] = tokens_per_step(cls, arm)
    total_share = sum(token_shares[c] for c in classes)
    step_s, knee = cost.step_s, cost.knee_tokens

    def value(slots: float, verify: float, drafting: float) -> float:
        step = step_s * max(1.0, concurrency * verify / slots / knee) + drafting
        return concurrency * total_share / slots / step

    def ascend(current: dict[str, Arm]) -> dict[str, Arm]:
        for _ in range(max_rounds):
            changed = False
            for cls in classes:
                slots = verify = 0.0
                depth: dict[str, int] = {}
                for other in classes:
                    if other == cls:
                        continue
                    arm = current[other]
                    weight = token_shares[other] / expected[(other, arm)]
                    slots += weight
                    verify += weight * arm.verify_tokens
                    if arm.proposer is not None:
                        depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
                drafting = sum(cost.draft_cost.get(p, 0.0) * step_s * d for p, d in depth.items())
                share = token_shares[cls]

                def score(arm: Arm) -> float:
                    weight = share / expected[(cls, arm)]  # noqa: B023 - used at once
                    extra = 0.0
                    if arm.proposer is not None:
                        deeper = arm.gamma - depth.get(arm.proposer, 0)  # noqa: B023
                        if deeper > 0:
                            extra = cost.draft_cost.get(arm.proposer, 0.0) * step_s * deeper
                    return value(
                        slots + weight,  # noqa: B023
                        verify + weight * arm.verify_tokens,  # noqa: B023
                        drafting + extra,  # noqa: B023
                    )

                best_arm = current[cls]
                best_value = score(best_arm)
                for arm in arms:
                    if arm != best_arm:
                        candidate = score(arm)
                        if candidate > best_value * (1 + 1e-9):
                            best_arm, best_value = arm, candidate
                if best_arm != current[cls]:
                    current[cls] = best_arm
                    changed = True
            if not changed:
                break
        return current

    def goodput(assignment: Mapping[str, Arm]) -> float:
        return steady_goodput(concurrency, token_shares, tokens_per_step, assignment, cost)

    best = ascend({c: (start or {}).get(c, OFF) for c in classes})
    if start:
        other = ascend(dict.fromkeys(classes, OFF))
        if goodput(other) > goodput(best) * (1 + 1e-9):
            best = other
    return best
