"""The benchmark's upper bound: the best per-class arms for the batch as it actually runs.

:class:`BatchOracle` knows what the simulator knows — every class's true acceptance
(after each drift), its output lengths, the cost model — and is asked once per request
with the exact concurrency that request starts at (it gets one concurrency bucket per
level, see :func:`oracle_buckets`). For each drift epoch × concurrency it serves every
class the arm of the assignment that maximises the simulator's *exact* stationary
goodput at that concurrency, not a fluid approximation of it:

- Steps per request. A request of class c under arm a takes S(c, a) steps on average,
  computed from the simulator's own acceptance model: per-request α over the class's
  Beta quantile table, a step emitting ``1 + L`` tokens with P(L ≥ k) = α^k ·
  decay^(k(k-1)/2) for k ≤ γ, and the exact expected number of steps to emit a
  request's length (a renewal recursion), averaged over the length distribution. Using
  E_γ at the mean α instead (as the fluid model does) undercounts steps (Jensen).
- The batch. With N streams in one closed loop every stream advances one step per
  engine step, and how many steps a request takes does not depend on the others; so in
  the step-index domain the streams are independent renewal processes, and at a random
  step each one is in a request of class c with probability p_c = q_c S_c / Σ q S (q:
  request shares). Tokens per step are N · Σ q n̄ / Σ q S and the step time is the
  cost model's at the batch's composition, whose law is N independent draws from p:
  the verified positions V are a sum of N draws (their distribution by FFT), and each
  proposer's drafting depth is the largest γ among its draws. The long-run goodput is
  then E[tokens per step] / E[step time], exactly, for a fixed assignment.

The assignment is the best of all per-class combinations where they are few (three
classes over the simulator's 17 arms); beyond, it is searched by coordinate ascent with
group moves (all classes on one arm moving together, since sharing a proposer shares
its drafting) and pair moves (:func:`policies.fleet.climb`), started from the best "one
arm for all" assignments (so it is never worse than the best static config at that
concurrency, under the exact model), from the fluid model's answer and from each
class's best arm alone.

In the simulator's closed loop a request starts at its phase's level except while the
streams of a falling load retire (0.4 % of mixed-day's requests); those are planned for
the level the batch settles to, where they spend most of their life.

What it does not model: transients (a phase's first requests, that drain, requests
admitted before a drift) are served as if the batch were already stationary; and it
serves one arm per class, not a mix (mixing adds variance to the verified positions and
deepens drafting, both of which cost here). It is an upper bound by construction only
in steady state; ``tests/simulator/test_oracle.py`` checks that no policy of ``bench
policy`` beats it on every shipped scenario and twenty random ones, beyond the path
noise of one run (``bench.policy.PATH_NOISE``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm, ConcurrencyBuckets, Context
from policies.base import Clock
from policies.fleet import best_assignment, climb
from simulator.engine import _beta_inverse_cdf
from simulator.scenario import Scenario
from simulator.truth import expected_tokens_per_step

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Per-request α: the simulator draws one of this many equally likely quantiles of the
# class's Beta. The oracle takes the ``_ALPHA_EDGE`` lowest and highest one by one
# (the lowest is α ≈ 0: a request that never gains) and the rest in blocks of
# ``_ALPHA_BLOCK`` at their middle: steps per request within 1e-4 of all 1000.
_ALPHA_POINTS = 1000
_ALPHA_EDGE = 10
_ALPHA_BLOCK = 10
# Output lengths: their distribution is read off this many evenly spaced uniforms.
_LENGTH_POINTS = 4096
_MAX_ROUNDS = 8
# Up to this many per-class arm combinations (three classes over 17 arms) all are
# scored; beyond, the search climbs from several starts.
_EXHAUSTIVE_LIMIT = 5000


def oracle_buckets(scenario: Scenario) -> ConcurrencyBuckets:
    """One bucket per concurrency level the scenario can reach: contexts carry the
    exact concurrency a request starts at (its bucket label is the number)."""
    top = max(p.concurrency for p in scenario.phases)
    return ConcurrencyBuckets(tuple(range(1, max(top, 1) + 2)))


def _length_weights(mean: int, spread: float) -> tuple[IntArray, FloatArray]:
    """Output lengths a class's requests take and their probabilities (as the
    simulator draws them: ``max(2, int(mean · (1 + spread · (2u - 1)) + 0.5))``)."""
    u = (np.arange(_LENGTH_POINTS) + 0.5) / _LENGTH_POINTS
    lengths = np.maximum(2, (mean * (1.0 + spread * (2.0 * u - 1.0)) + 0.5).astype(np.int64))
    values, counts = np.unique(lengths, return_counts=True)
    return values, counts / counts.sum()


def _alphas(mean: float, concentration: float) -> tuple[FloatArray, FloatArray]:
    """Representative per-request acceptances of a class × proposer, with weights."""
    if not 0.0 < mean < 1.0:
        return np.array([mean]), np.array([1.0])
    table = _beta_inverse_cdf(concentration * mean, concentration * (1.0 - mean))
    # The simulator draws table[i] for i uniform in 0 … _ALPHA_POINTS - 1.
    positions: list[float] = [float(i) for i in range(_ALPHA_EDGE)]
    counts: list[int] = [1] * _ALPHA_EDGE
    for start in range(_ALPHA_EDGE, _ALPHA_POINTS - _ALPHA_EDGE, _ALPHA_BLOCK):
        end = min(start + _ALPHA_BLOCK, _ALPHA_POINTS - _ALPHA_EDGE)
        positions.append((start + end - 1) / 2.0)
        counts.append(end - start)
    positions += [float(i) for i in range(_ALPHA_POINTS - _ALPHA_EDGE, _ALPHA_POINTS)]
    counts += [1] * _ALPHA_EDGE
    values = np.interp(positions, np.arange(len(table)), table)
    return np.asarray(values, dtype=np.float64), np.array(counts) / _ALPHA_POINTS


def mean_steps(
    alphas: FloatArray,
    alpha_weights: FloatArray,
    gammas: Sequence[int],
    position_decay: float,
    lengths: IntArray,
    weights: FloatArray,
) -> FloatArray:
    """Expected steps per request for each γ, averaged over ``alphas`` and lengths
    (each with its weights).

    f(m), the expected steps to emit at least m tokens, follows f(m) = 1 +
    Σ_j P(emit j) f(m - j) with f(m ≤ 0) = 0 — the simulator's rule that a request
    finishes at the first step whose cumulative output reaches its length.
    """
    top = max(gammas)
    k = np.arange(top + 2, dtype=np.float64)
    # levels[g, a, k] = P(L ≥ k) under γ = gammas[g]; zero beyond γ.
    levels = alphas[None, :, None] ** k[None, None, :] * position_decay ** (k * (k - 1) / 2.0)
    cap = np.array(gammas)[:, None, None]
    levels = np.where(k[None, None, :] <= cap, levels, 0.0)
    # emit[g, a, j - 1] = P(step emits j tokens) = P(L ≥ j - 1) - P(L ≥ j), j = 1 … top + 1
    emit = levels[:, :, :-1] - levels[:, :, 1:]
    span = emit.shape[2]
    longest = int(lengths.max())
    f = np.zeros((longest + 1, len(gammas), len(alphas)))
    history = np.zeros((span, len(gammas), len(alphas)))  # f(m - 1), f(m - 2), …
    emit_t = np.moveaxis(emit, 2, 0)  # (j, g, a)
    for m in range(1, longest + 1):
        value = 1.0 + (emit_t * history).sum(axis=0)
        f[m] = value
        history = np.roll(history, 1, axis=0)
        history[0] = value
    per_length = f[lengths] @ alpha_weights  # (lengths, g)
    result: FloatArray = weights @ per_length
    return result


class StationaryBatch:
    """Exact stationary goodput of N closed-loop streams in one batch, per assignment,
    for one drift epoch of a scenario (the acceptances in force at ``t``)."""

    def __init__(self, scenario: Scenario, t: float, arms: Sequence[Arm] | None = None) -> None:
        self.scenario = scenario
        self.arms: tuple[Arm, ...] = tuple(dict.fromkeys([OFF, *(arms or scenario.arms)]))
        self.classes = list(scenario.classes)
        model = scenario.model
        cost = scenario.cost
        total = sum(s.share for s in scenario.classes.values())
        self.q = np.array([scenario.classes[c].share / total for c in self.classes])
        self.steps = np.zeros((len(self.classes), len(self.arms)))
        self.mean_tokens = np.zeros(len(self.classes))
        by_proposer: dict[str, list[int]] = {}
        for index, arm in enumerate(self.arms):
            if arm.proposer is not None:
                by_proposer.setdefault(arm.proposer, []).append(index)
        for row, cls in enumerate(self.classes):
            spec = scenario.classes[cls]
            lengths, weights = _length_weights(spec.output_tokens, spec.output_spread)
            self.mean_tokens[row] = float(weights @ lengths)
            self.steps[row, 0] = self.mean_tokens[row]
            for proposer, columns in by_proposer.items():
                alpha = scenario.acceptance_at(cls, proposer, t)
                alphas, alpha_weights = _alphas(alpha, model.acceptance_concentration)
                gammas = [self.arms[i].gamma for i in columns]
                self.steps[row, columns] = mean_steps(
                    alphas, alpha_weights, gammas, model.position_decay, lengths, weights
                )
        self.alphas = {
            (c, p): scenario.acceptance_at(c, p, t) for c in self.classes for p in by_proposer
        }
        self.verify = np.array([a.verify_tokens for a in self.arms], dtype=np.float64)
        self.proposers = sorted(by_proposer)
        self.step_s = cost.step_s
        self.knee = cost.knee_tokens
        self.draft_s = {p: cost.draft_cost.get(p, 0.0) * cost.step_s for p in self.proposers}
        # gamma_of[p][arm] = γ if the arm drafts with p, else 0
        self.gamma_of = {
            p: np.array([a.gamma if a.proposer == p else 0 for a in self.arms])
            for p in self.proposers
        }

    def goodput(
        self, concurrency: int, assignments: IntArray, shares: FloatArray | None = None
    ) -> FloatArray:
        """Tokens per second for each row of ``assignments`` (arm index per class);
        ``shares`` replaces the classes' request shares (e.g. one class alone)."""
        return self.evaluate(concurrency, assignments, shares)[0]

    def evaluate(
        self, concurrency: int, assignments: IntArray, shares: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray]:
        """(tokens per second, mean seconds per step) for each row of ``assignments``."""
        q = self.q if shares is None else shares
        rows = np.arange(len(self.classes))
        occupancy = q[None, :] * self.steps[rows[None, :], assignments]  # (K, C)
        mean_steps = occupancy.sum(axis=1)
        p = occupancy / mean_steps[:, None]
        # Each slot's arm distribution.
        arm_p = np.zeros((len(assignments), len(self.arms)))
        np.add.at(arm_p, (np.arange(len(assignments))[:, None], assignments), p)
        n = concurrency
        step = self.step_s * self._compute_factor(n, arm_p)
        for proposer in self.proposers:
            gammas = self.gamma_of[proposer]
            top = int(gammas.max())
            expected_depth = np.zeros(len(assignments))
            for g in range(top):
                above = arm_p[:, gammas > g].sum(axis=1)
                expected_depth += 1.0 - (1.0 - above) ** n
            step = step + self.draft_s[proposer] * expected_depth
        rate: FloatArray = n * float(q @ self.mean_tokens) / mean_steps / step
        return rate, step

    def _compute_factor(self, n: int, arm_p: FloatArray) -> FloatArray:
        """E[max(1, V / knee)] for V the verified positions of n independent slots."""
        top = int(self.verify.max())
        single = np.zeros((len(arm_p), top + 1))
        for column, tokens in enumerate(self.verify.astype(np.int64).tolist()):
            single[:, tokens] += arm_p[:, column]
        size = 1
        while size < n * top + 1:
            size *= 2
        spectrum = np.fft.rfft(single, size, axis=1) ** n
        pmf = np.clip(np.fft.irfft(spectrum, size, axis=1)[:, : n * top + 1], 0.0, None)
        pmf /= pmf.sum(axis=1, keepdims=True)
        totals = np.arange(pmf.shape[1], dtype=np.float64)
        result: FloatArray = pmf @ np.maximum(1.0, totals / self.knee)
        return result

    def best(self, concurrency: int) -> tuple[dict[str, Arm], float]:
        """The assignment with the highest exact goodput found, and that goodput."""
        n_arms, n_classes = len(self.arms), len(self.classes)
        choices = np.arange(n_arms)
        if n_arms**n_classes <= _EXHAUSTIVE_LIMIT:
            rows = np.array(list(itertools.product(range(n_arms), repeat=n_classes)))
            values = self.goodput(concurrency, rows)
            best_row, best_value = rows[int(np.argmax(values))], float(values.max())
        else:
            uniform = np.repeat(choices[:, None], n_classes, axis=1)
            values = self.goodput(concurrency, uniform)
            starts = [uniform[i].copy() for i in np.argsort(-values)[:3]]
            starts.append(self._fluid_start(concurrency))
            starts.append(self._solo_start(concurrency))
            best_row, best_value = starts[0], -np.inf
            for start in starts:
                row, value = climb(
                    lambda rows: self.goodput(concurrency, rows), start, choices, _MAX_ROUNDS
                )
                if value > best_value * (1 + 1e-12):
                    best_row, best_value = row, value
        return {c: self.arms[int(i)] for c, i in zip(self.classes, best_row, strict=True)}, float(
            best_value
        )

    def _fluid_start(self, concurrency: int) -> IntArray:
        """The fluid model's assignment (what the phase oracle serves) as a start."""
        model = self.scenario.model

        def tokens(cls: str, arm: Arm) -> float:
            if arm.proposer is None:
                return 1.0
            return expected_tokens_per_step(
                self.alphas[(cls, arm.proposer)],
                arm.gamma,
                model.position_decay,
                model.acceptance_concentration,
            )

        shares = {c: s.share * s.output_tokens for c, s in self.scenario.classes.items()}
        fluid = best_assignment(concurrency, shares, tokens, self.arms, self.scenario.cost)
        return np.array([self.arms.index(fluid.get(c, OFF)) for c in self.classes])

    def _solo_start(self, concurrency: int) -> IntArray:
        """Each class's best arm were the whole batch its own."""
        n_arms = len(self.arms)
        row = np.zeros(len(self.classes), dtype=np.int64)
        for c in range(len(self.classes)):
            alone = np.zeros_like(self.q)
            alone[c] = 1.0
            candidates = np.zeros((n_arms, len(self.classes)), dtype=np.int64)
            candidates[:, c] = np.arange(n_arms)
            row[c] = int(np.argmax(self.goodput(concurrency, candidates, alone)))
        return row


class BatchOracle:
    """Serves each class its arm in the exactly best assignment for the concurrency a
    request starts at and the acceptances in force (see the module docstring).

    While the streams of a falling load retire, a request is planned for the phase's
    level instead: it starts beside the last requests of retiring streams but spends
    most of its life in the smaller batch the phase settles to. Needs the contexts of
    :func:`oracle_buckets` (the bucket label is the concurrency).
    """

    name = "oracle"

    def __init__(self, scenario: Scenario, clock: Clock) -> None:
        self._scenario = scenario
        self._clock = clock
        self._drift_times = sorted({d.at_s for d in scenario.drift})
        self._epochs: dict[int, StationaryBatch] = {}
        self._cache: dict[tuple[int, int], dict[str, Arm]] = {}

    def assignment(self, concurrency: int, t: float) -> dict[str, Arm]:
        """The best assignment for a stationary batch of ``concurrency`` streams of the
        requests issued at ``t`` (a request's acceptance is fixed when it is issued)."""
        epoch = bisect.bisect_right(self._drift_times, t)
        key = (epoch, max(1, concurrency))
        found = self._cache.get(key)
        if found is None:
            batch = self._epochs.get(epoch)
            if batch is None:
                batch = self._epochs[epoch] = StationaryBatch(self._scenario, t)
            found = self._cache[key] = batch.best(key[1])[0]
        return found

    def select(self, context: Context) -> Arm:
        now = self._clock()
        concurrency = int(context.bucket.rstrip("+"))
        level = self._scenario.concurrency_at(now)
        if 0 < level < concurrency:
            concurrency = level
        return self.assignment(concurrency, now).get(context.workload_class or "", OFF)

    def best_guess(self, context: Context) -> Arm:
        return self.select(context)

    def observe(self, observation: RequestObservation) -> None:
        pass


def assignment_goodput(
    batch: StationaryBatch, concurrency: int, assignment: Mapping[str, Arm]
) -> float:
    """Exact stationary goodput of one assignment (for tests and reports)."""
    row = np.array([batch.arms.index(assignment.get(c, OFF)) for c in batch.classes])
    return float(batch.goodput(concurrency, row[None, :])[0])
