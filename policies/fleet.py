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


def steady_state(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
) -> tuple[float, float]:
    """(tokens per second, seconds per step) of a closed loop of ``concurrency`` streams.

    ``token_shares`` is each class's share of the generated tokens it asks for (its
    request share × its mean output length). In steady state a class occupies batch
    slots in proportion to the steps its tokens need (Little's law), i.e. share / E;
    all slots then advance one step per step time.
    """
    slots: dict[str, float] = {}
    for cls, share in token_shares.items():
        if share > 0:
            slots[cls] = share / tokens_per_step(cls, assignment.get(cls, OFF))
    total = sum(slots.values())
    if total <= 0 or concurrency <= 0:
        return 0.0, cost.step_time(0.0, {})
    verify = 0.0
    emitted = 0.0
    depth: dict[str, int] = {}
    for cls, weight in slots.items():
        fraction = weight / total
        arm = assignment.get(cls, OFF)
        verify += concurrency * fraction * arm.verify_tokens
        emitted += concurrency * fraction * tokens_per_step(cls, arm)
        if arm.proposer is not None:
            depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
    step = cost.step_time(verify, depth)
    return emitted / step, step


def steady_goodput(
    concurrency: float,
    token_shares: Mapping[str, float],
    tokens_per_step: TokensPerStep,
    assignment: Mapping[str, Arm],
    cost: CostParams,
) -> float:
    """Generated tokens per second in steady state (see :func:`steady_state`)."""
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
    """The per-class arms that maximise :func:`steady_goodput` (coordinate ascent).

    Classes share a batch, so one class's arm changes what the others pay; each round
    re-picks every class's best arm given the rest until nothing changes. Starting
    from the current decisions keeps the answer stable when several are equally good.
    """
    classes = sorted(c for c, s in token_shares.items() if s > 0)
    current = {c: (start or {}).get(c, OFF) for c in classes}
    for _ in range(max_rounds):
        changed = False
        for cls in classes:
            best_arm = current[cls]
            best_value = steady_goodput(concurrency, token_shares, tokens_per_step, current, cost)
            for arm in arms:
                if arm == current[cls]:
                    continue
                trial = {**current, cls: arm}
                value = steady_goodput(concurrency, token_shares, tokens_per_step, trial, cost)
                if value > best_value * (1 + 1e-9):
                    best_arm, best_value = arm, value
            if best_arm != current[cls]:
                current[cls] = best_arm
                changed = True
        if not changed:
            break
    return current
