"""The speed-up model of speculative decoding, and its counterfactual.

With γ draft tokens per step and a per-token acceptance α (each draft position accepted
with probability α given that every earlier one was), one verify step emits

    E_γ = 1 + α + α² + … + α^γ = (1 - α^(γ+1)) / (1 - α)

tokens (the accepted prefix plus the target's own token). The measured speed-up over
plain decoding is ``S = E_γ / (d_γ + v_γ + h_γ)`` where d, v and h are the draft, verify
and overhead time of one step, each in units of one plain decode step.

Acceptance is a prefix: draft position i can only be accepted when positions 0..i-1
were. So the per-position accepted counts vLLM reports while running γ say exactly how
many tokens each step would have emitted with any shorter γ' ≤ γ — that is the
counterfactual the bandit uses to learn every γ' from one observation.
"""

from __future__ import annotations

from collections.abc import Sequence

# Below this distance from 1 the closed form loses precision; the limit is γ + 1.
_ALPHA_ONE_TOLERANCE = 1e-9


def expected_tokens(alpha: float, gamma: int) -> float:
    """E_γ: expected tokens emitted per verify step at constant per-token acceptance α.

    ``gamma = 0`` (no speculation) gives 1. α must lie in [0, 1]; at α = 1 every draft
    is accepted and the step emits γ + 1 tokens.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if 1.0 - alpha < _ALPHA_ONE_TOLERANCE:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(
    expected_tokens_per_step: float, draft: float, verify: float, overhead: float = 0.0
) -> float:
    """S = E_γ / (d_γ + v_γ + h_γ), the three costs in units of one plain decode step.

    S > 1 means speculation generates tokens faster than plain decoding would.
    """
    cost = draft + verify + overhead
    if cost <= 0.0:
        raise ValueError(f"step cost must be positive, got {cost}")
    return expected_tokens_per_step / cost


def counterfactual_expected_tokens(
    accepted_per_position: Sequence[float], num_drafts: float
) -> tuple[float, ...]:
    """Expected tokens per step for every γ' = 0..γ, from one run at γ.

    ``accepted_per_position[i]`` counts the steps whose draft position i was accepted
    (vLLM's ``accepted_per_position``), ``num_drafts`` the steps. Because acceptance is a
    prefix, a step that accepted L drafts at γ would have accepted min(L, γ') at γ', so
    E_γ' = 1 + Σ_{i<γ'} accepted_per_position[i] / num_drafts exactly. Element γ' of
    the result is E_γ'; element 0 is 1 (no speculation).
    """
    if num_drafts <= 0:
        raise ValueError(f"num_drafts must be positive, got {num_drafts}")
    previous = num_drafts
    totals = [1.0]
    running = 1.0
    for position, accepted in enumerate(accepted_per_position):
        if accepted < 0 or accepted > previous:
            raise ValueError(
                f"accepted_per_position[{position}] = {accepted} is not a prefix count "
                f"(must lie in [0, {previous}])"
            )
        previous = accepted
        running += accepted / num_drafts
        totals.append(running)
    return tuple(totals)


def conditional_acceptance(
    accepted_per_position: Sequence[float], num_drafts: float
) -> tuple[tuple[float, float], ...]:
    """Per-position (successes, trials) of acceptance given every earlier position passed.

    Position 0 is tried on every step; position i only on the steps that accepted
    position i-1. These are the Bernoulli counts a per-position Beta posterior consumes;
    they do not depend on which γ ≥ i+1 produced them.
    """
    counterfactual_expected_tokens(accepted_per_position, num_drafts)  # validates
    pairs: list[tuple[float, float]] = []
    trials = num_drafts
    for accepted in accepted_per_position:
        pairs.append((accepted, trials))
        trials = accepted
    return tuple(pairs)


def expected_tokens_from_conditionals(conditionals: Sequence[float]) -> float:
    """E_γ for per-position conditional acceptances q_0..q_{γ-1}: 1 + Σ_k Π_{i<k} q_i.

    The general form of :func:`expected_tokens` when acceptance decays with position.
    """
    total = 1.0
    survival = 1.0
    for q in conditionals:
        survival *= q
        total += survival
    return total
