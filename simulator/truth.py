"""The true figures of a scenario at a moment, for the oracle."""

from __future__ import annotations

import bisect
from functools import cache

from policies.arms import Arm
from policies.base import Clock
from policies.baselines import Truth
from simulator.scenario import Scenario


def expected_tokens_per_step(
    mean_alpha: float, gamma: int, position_decay: float, concentration: float
) -> float:
    """E_γ under the simulator's acceptance model, averaged over requests.

    A request's α ~ Beta(κ·ᾱ, κ·(1-ᾱ)) and position k of its draft survives with
    α^k · decay^(k(k-1)/2), so E_γ = 1 + Σ_k E[α^k] · decay^(k(k-1)/2), with the Beta
    moments E[α^k] = Π_{j<k} (a + j) / (a + b + j).
    """
    if mean_alpha <= 0.0:
        return 1.0
    a = concentration * mean_alpha
    b = concentration * (1.0 - mean_alpha)
    total, moment = 1.0, 1.0
    for k in range(1, gamma + 1):
        moment *= (a + k - 1) / (a + b + k - 1) if mean_alpha < 1.0 else 1.0
        total += moment * position_decay ** (k * (k - 1) / 2)
    return total


class ScenarioTruth:
    """Callable giving the scenario's truth at the clock's time (cached per phase × drift)."""

    def __init__(self, scenario: Scenario, clock: Clock) -> None:
        self._scenario = scenario
        self._clock = clock
        self._drift_times = sorted(d.at_s for d in scenario.drift)
        self._cache: dict[tuple[int, int], Truth] = {}

    def __call__(self) -> Truth:
        t = self._clock()
        key = (self._scenario.phase_at(t), bisect.bisect_right(self._drift_times, t))
        truth = self._cache.get(key)
        if truth is None:
            truth = self._cache[key] = self._build(key, t)
        return truth

    def _build(self, key: tuple[int, int], t: float) -> Truth:
        scenario = self._scenario
        model = scenario.model
        alphas = {
            (cls, p): scenario.acceptance_at(cls, p, t)
            for cls in scenario.classes
            for p in scenario.proposers
        }

        @cache
        def tokens(cls: str, arm: Arm) -> float:
            if arm.proposer is None:
                return 1.0
            return expected_tokens_per_step(
                alphas[(cls, arm.proposer)],
                arm.gamma,
                model.position_decay,
                model.acceptance_concentration,
            )

        shares = {c: s.share * s.output_tokens for c, s in scenario.classes.items()}
        concurrency = scenario.phases[key[0]].concurrency
        return Truth(key, concurrency, shares, tokens, scenario.cost)
