"""The policies specpilot is measured against.

* :class:`StaticPolicy` — one ``--speculative-config`` for everything (``off`` included);
* :class:`BatchSizeTable` — γ by concurrency bucket for one proposer, like vLLM's
  ``num_speculative_tokens_per_batch_size``;
* :class:`EpsilonGreedy` and :class:`UCB1` — textbook bandits over the flat arm list
  per context, rewarded with the request's own generation speed (tokens per second);
* :class:`OraclePolicy` — knows the true figures and serves each class the arm of the
  best joint assignment under the fluid model (:func:`policies.fleet.best_assignment`)
  at the concurrency its truth names. Not an upper bound: the fluid model averages the
  batch, and a phase's nominal concurrency is not what every request starts at (the
  benchmark's bound is :class:`simulator.oracle.BatchOracle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm, Context
from policies.fleet import CostParams, TokensPerStep, best_assignment


class StaticPolicy:
    def __init__(self, arm: Arm, name: str | None = None) -> None:
        self.arm = arm
        self.name = name or f"static:{arm}"

    def select(self, context: Context) -> Arm:
        return self.arm

    def best_guess(self, context: Context) -> Arm:
        return self.arm

    def observe(self, observation: RequestObservation) -> None:
        pass


class BatchSizeTable:
    """A fixed γ per concurrency bucket for one proposer (γ = 0: off)."""

    name = "batch_size_table"

    def __init__(self, proposer: str, gamma_by_bucket: Mapping[str, int]) -> None:
        self.proposer = proposer
        self.gamma_by_bucket = dict(gamma_by_bucket)

    @classmethod
    def tapering(
        cls, proposer: str, gammas: Sequence[int], labels: Sequence[str]
    ) -> BatchSizeTable:
        """The table an operator would write: the longest γ when alone, shorter as the
        batch grows, off in the last two buckets (where verification is compute-bound)."""
        ordered = sorted(set(gammas), reverse=True)
        table: dict[str, int] = {}
        speculating = max(1, len(labels) - 2)
        for i, label in enumerate(labels):
            if i >= speculating:
                table[label] = 0
            else:
                position = round(i * (len(ordered) - 1) / max(1, speculating - 1))
                table[label] = ordered[position]
        return cls(proposer, table)

    def _arm(self, context: Context) -> Arm:
        gamma = self.gamma_by_bucket.get(context.bucket, 0)
        return OFF if gamma <= 0 else Arm(self.proposer, gamma)

    def select(self, context: Context) -> Arm:
        return self._arm(context)

    def best_guess(self, context: Context) -> Arm:
        return self._arm(context)

    def observe(self, observation: RequestObservation) -> None:
        pass


def _key(model: str | None, cls: str | None, bucket: str) -> tuple[str, str, str]:
    return (model or "default", cls or "default", bucket)


class _FlatBandit:
    """Per-context mean reward per arm; reward = a request's generated tokens per second."""

    name = "flat"

    def __init__(self, arms: Sequence[Arm], bucket_of: Callable[[int], str]) -> None:
        self.arms = tuple(arms)
        self._bucket_of = bucket_of
        self.counts: dict[tuple[str, str, str], np.ndarray] = {}
        self.sums: dict[tuple[str, str, str], np.ndarray] = {}

    def _stats(self, key: tuple[str, str, str]) -> tuple[np.ndarray, np.ndarray]:
        if key not in self.counts:
            self.counts[key] = np.zeros(len(self.arms))
            self.sums[key] = np.zeros(len(self.arms))
        return self.counts[key], self.sums[key]

    def best_guess(self, context: Context) -> Arm:
        counts, sums = self._stats(_key(context.model, context.workload_class, context.bucket))
        means = np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)
        return self.arms[int(np.argmax(means))] if counts.any() else OFF

    def observe(self, observation: RequestObservation) -> None:
        if observation.arm is None or not observation.generation_time_s:
            return
        arm = Arm.parse(observation.arm)
        if arm not in self.arms or not observation.output_tokens:
            return
        bucket = self._bucket_of(observation.concurrency or 1)
        counts, sums = self._stats(_key(observation.model, observation.workload_class, bucket))
        index = self.arms.index(arm)
        counts[index] += 1
        sums[index] += observation.output_tokens / observation.generation_time_s


class EpsilonGreedy(_FlatBandit):
    name = "epsilon_greedy"

    def __init__(
        self,
        arms: Sequence[Arm],
        bucket_of: Callable[[int], str],
        rng: np.random.Generator,
        epsilon: float = 0.1,
    ) -> None:
        super().__init__(arms, bucket_of)
        self.rng = rng
        self.epsilon = epsilon

    def select(self, context: Context) -> Arm:
        if self.rng.random() < self.epsilon:
            return self.arms[int(self.rng.integers(len(self.arms)))]
        return self.best_guess(context)


class UCB1(_FlatBandit):
    name = "ucb1"

    def select(self, context: Context) -> Arm:
        counts, sums = self._stats(_key(context.model, context.workload_class, context.bucket))
        untried = np.flatnonzero(counts == 0)
        if untried.size:
            return self.arms[int(untried[0])]
        means = sums / counts
        scale = max(float(means.max()), 1e-9)  # rewards normalised to [0, 1]
        bonus = np.sqrt(2.0 * math.log(counts.sum()) / counts)
        return self.arms[int(np.argmax(means / scale + bonus))]


@dataclass(frozen=True, slots=True)
class Truth:
    """What the oracle knows at one moment."""

    key: tuple[object, ...]
    """Changes whenever anything below changes (phase, drift epoch)."""
    concurrency: float
    token_shares: Mapping[str, float]
    tokens_per_step: TokensPerStep
    cost: CostParams


class OraclePolicy:
    """Serves each class its arm in the best joint assignment under the true figures
    and the fluid model."""

    def __init__(
        self, arms: Sequence[Arm], truth: Callable[[], Truth], name: str = "oracle"
    ) -> None:
        self.name = name
        self.arms = tuple(arms)
        self._truth = truth
        self._cache: dict[tuple[object, ...], dict[str, Arm]] = {}

    def _assignment(self) -> dict[str, Arm]:
        truth = self._truth()
        assignment = self._cache.get(truth.key)
        if assignment is None:
            assignment = best_assignment(
                truth.concurrency, truth.token_shares, truth.tokens_per_step, self.arms, truth.cost
            )
            self._cache[truth.key] = assignment
        return assignment

    def select(self, context: Context) -> Arm:
        return self._assignment().get(context.workload_class, OFF)

    def best_guess(self, context: Context) -> Arm:
        return self.select(context)

    def observe(self, observation: RequestObservation) -> None:
        pass
