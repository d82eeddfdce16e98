"""The learned pieces of specpilot's bandit: acceptance, step cost and change detection.

All three are discounted (old evidence fades with a half-life on the injected clock) so
the bandit keeps adapting, and all three serialise to JSON-able dicts.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.arms import Arm
from policies.fleet import CostParams
from policies.speedup import conditional_acceptance

FloatArray = npt.NDArray[np.float64]


def decay_factor(elapsed_s: float, half_life_s: float) -> float:
    """Weight left on evidence ``elapsed_s`` old."""
    if elapsed_s <= 0 or math.isinf(half_life_s):
        return 1.0
    return float(0.5 ** (elapsed_s / half_life_s))


class AcceptanceModel:
    """Posterior over per-position conditional acceptance of one class × proposer.

    Position i is accepted with probability q_i given positions 0..i-1 were; each q_i
    has a Beta posterior fed with the per-position counts of every observed request,
    whatever γ it ran with (the counterfactual: a run at γ informs every γ' ≤ γ). Few
    trials at a deep position borrow from the position before it: the prior of q_i is
    centred on q_{i-1} with ``chain_strength`` pseudo-trials, so the posterior over
    E_γ stays sensible for γ never tried.

    A request counts as at most ``trials_per_request`` trials at position 0 (and
    proportionally fewer deeper): acceptance varies more between requests than between
    the steps of one request, and counting every step would make the posterior
    overconfident.
    """

    def __init__(
        self,
        positions: int,
        *,
        half_life_s: float = 1800.0,
        trials_per_request: float = 20.0,
        prior_mean: float = 0.5,
        prior_strength: float = 2.0,
        chain_strength: float = 4.0,
    ) -> None:
        self.positions = positions
        self.half_life_s = half_life_s
        self.trials_per_request = trials_per_request
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.chain_strength = chain_strength
        self.successes = np.zeros(positions)
        self.trials = np.zeros(positions)
        self.updated_at: float | None = None
        self.requests = 0.0

    def _age(self, now: float) -> None:
        if self.updated_at is not None:
            factor = decay_factor(now - self.updated_at, self.half_life_s)
            self.successes *= factor
            self.trials *= factor
            self.requests *= factor
        self.updated_at = now

    def update(
        self,
        accepted_per_position: Sequence[float],
        num_drafts: float,
        now: float,
        *,
        requests: float = 1.0,
    ) -> None:
        """Add the counts of ``requests`` requests (one request, or a worker's window
        of many: it counts as that many requests of equal drafts each)."""
        if num_drafts <= 0 or requests <= 0:
            return
        self._age(now)
        weight = min(1.0, self.trials_per_request * requests / num_drafts)
        pairs = conditional_acceptance(accepted_per_position, num_drafts)
        for i, (accepted, tried) in enumerate(pairs[: self.positions]):
            self.successes[i] += weight * accepted
            self.trials[i] += weight * tried
        self.requests += requests

    def reset(self) -> None:
        self.successes[:] = 0.0
        self.trials[:] = 0.0
        self.requests = 0.0

    def _beta_parameters(self) -> tuple[FloatArray, FloatArray]:
        """Posterior Beta(a, b) per position; each prior is centred on the previous
        position's posterior mean."""
        a = np.empty(self.positions)
        b = np.empty(self.positions)
        centre, strength = self.prior_mean, self.prior_strength
        successes = self.successes.tolist()
        failures = (self.trials - self.successes).tolist()
        for i in range(self.positions):
            a[i] = successes[i] + strength * centre
            b[i] = failures[i] + strength * (1.0 - centre)
            centre, strength = a[i] / (a[i] + b[i]), self.chain_strength
        return a, b

    def mean_conditionals(self) -> FloatArray:
        a, b = self._beta_parameters()
        result: FloatArray = a / (a + b)
        return result

    def sample_conditionals(self, rng: np.random.Generator, draws: int) -> FloatArray:
        """``draws`` × positions samples of q."""
        a, b = self._beta_parameters()
        shape = (draws, self.positions)
        result: FloatArray = rng.beta(
            np.broadcast_to(np.maximum(a, 1e-3), shape), np.broadcast_to(np.maximum(b, 1e-3), shape)
        )
        return result

    @staticmethod
    def expected_tokens(conditionals: FloatArray) -> FloatArray:
        """E_γ for γ = 0..positions from conditionals (last axis = position)."""
        survival = np.cumprod(conditionals, axis=-1)
        zeros = np.zeros((*conditionals.shape[:-1], 1))
        result: FloatArray = 1.0 + np.concatenate([zeros, np.cumsum(survival, axis=-1)], axis=-1)
        return result

    def to_state(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "successes": self.successes.tolist(),
            "trials": self.trials.tolist(),
            "updated_at": self.updated_at,
            "requests": self.requests,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        # Saved for another γ range: deeper positions than it had start from the prior.
        self.successes = np.zeros(self.positions)
        self.trials = np.zeros(self.positions)
        saved_successes = np.array(state["successes"], dtype=float)[: self.positions]
        saved_trials = np.array(state["trials"], dtype=float)[: self.positions]
        self.successes[: len(saved_successes)] = saved_successes
        self.trials[: len(saved_trials)] = saved_trials
        self.updated_at = state["updated_at"]
        self.requests = float(state["requests"])


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """The detector fired: a class × proposer's acceptance moved away from its baseline."""

    at_s: float
    model: str
    workload_class: str
    proposer: str
    baseline: float
    recent: float


class ChangeDetector:
    """Two-sided CUSUMs on per-request first-position acceptance.

    First-position acceptance (accepted at position 0 / drafts) does not depend on the
    γ a request ran with, so switching γ never looks like a drift. The baseline mean
    and spread come from the requests seen since a (re)start and keep being refined
    by every later request (a self-starting CUSUM): the first requests to finish are
    the fast ones, with high acceptance, so a frozen early baseline would be biased and
    later turn into false alarms. A request joins the baseline only ``lag`` requests
    after it was scored, so a shift is judged against the baseline from before it
    rather than absorbed into it (which matters while the baseline rests on few
    requests).

    Monitoring starts after ``warmup`` requests, few on purpose: a proposer a class
    does not use is seen only through sparse probes, and a drift must be caught from
    a handful of them. Until many requests are in, the spread is shrunk towards
    ``prior_spread`` (worth ``prior_requests`` requests), so a small early sample that
    happens to agree closely cannot make ordinary noise look like a shift.

    Scores are standardised and clipped (one odd request cannot fire it alone). Three
    CUSUMs share the baseline: a coarse one (``slack`` 1 standard deviation,
    ``threshold`` 12) fires within four or five requests on a shift of three or more
    standard deviations; a fine one (``fine_slack`` 0.5, ``fine_threshold`` 18) catches
    a shift of about one standard deviation within about 40 requests; a gross one
    (``gross_slack`` 2.5, ``gross_threshold`` 4.4) fires on three requests in a row
    scored at the clip, a collapse of four or more standard deviations: a proposer a
    class does not use is seen only through probes a few dozen requests apart, and
    each request saved there is dozens of the class's requests. Ordinary tails, even
    the long ones of per-request acceptance near 0 or 1, do not score three clipped
    values in a row (with a slack of 2 and a threshold of 5.5 they did, once in a few
    million requests at α = 0.05). All have in-control run lengths far beyond any
    realistic stream.
    """

    def __init__(
        self,
        *,
        warmup: int = 5,
        slack: float = 1.0,
        threshold: float = 12.0,
        fine_slack: float = 0.5,
        fine_threshold: float = 18.0,
        gross_slack: float = 2.5,
        gross_threshold: float = 4.4,
        clip: float = 4.0,
        min_spread: float = 0.04,
        prior_spread: float = 0.15,
        prior_requests: float = 10.0,
        lag: int = 6,
    ) -> None:
        self.warmup = warmup
        self.slack = slack
        self.threshold = threshold
        self.fine_slack = fine_slack
        self.fine_threshold = fine_threshold
        self.gross_slack = gross_slack
        self.gross_threshold = gross_threshold
        self.clip = clip
        self.min_spread = min_spread
        self.prior_spread = prior_spread
        self.prior_requests = prior_requests
        self.lag = lag
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.high = 0.0
        self.low = 0.0
        self.fine_high = 0.0
        self.fine_low = 0.0
        self.gross_high = 0.0
        self.gross_low = 0.0
        self.recent: float | None = None
        self.pending: deque[float] = deque()

    @property
    def baseline(self) -> float | None:
        return self.mean if self.count >= self.warmup else None

    @property
    def spread(self) -> float:
        prior = self.prior_requests * self.prior_spread**2
        variance = (self.m2 + prior) / (max(self.count - 1, 0) + self.prior_requests)
        return max(math.sqrt(variance), self.min_spread)

    def _learn(self, value: float) -> None:
        # Welford's running mean and variance.
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    def update(self, value: float) -> bool:
        """Feed one request's value; True when a change is detected."""
        self.recent = value if self.recent is None else 0.8 * self.recent + 0.2 * value
        if self.count < self.warmup:
            self._learn(value)
            return False
        z = max(-self.clip, min(self.clip, (value - self.mean) / self.spread))
        self.high = max(0.0, self.high + z - self.slack)
        self.low = max(0.0, self.low - z - self.slack)
        self.fine_high = max(0.0, self.fine_high + z - self.fine_slack)
        self.fine_low = max(0.0, self.fine_low - z - self.fine_slack)
        self.gross_high = max(0.0, self.gross_high + z - self.gross_slack)
        self.gross_low = max(0.0, self.gross_low - z - self.gross_slack)
        if (
            self.high > self.threshold
            or self.low > self.threshold
            or self.fine_high > self.fine_threshold
            or self.fine_low > self.fine_threshold
            or self.gross_high > self.gross_threshold
            or self.gross_low > self.gross_threshold
        ):
            return True
        self.pending.append(value)
        if len(self.pending) > self.lag:
            self._learn(self.pending.popleft())
        return False

    def to_state(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "m2": self.m2,
            "high": self.high,
            "low": self.low,
            "fine_high": self.fine_high,
            "fine_low": self.fine_low,
            "gross_high": self.gross_high,
            "gross_low": self.gross_low,
            "recent": self.recent,
            "pending": list(self.pending),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.high = float(state["high"])
        self.low = float(state["low"])
        # States saved before the fine CUSUM existed start it afresh.
        self.fine_high = float(state.get("fine_high", 0.0))
        self.fine_low = float(state.get("fine_low", 0.0))
        self.gross_high = float(state.get("gross_high", 0.0))
        self.gross_low = float(state.get("gross_low", 0.0))
        self.recent = state["recent"]
        self.pending = deque(float(v) for v in state.get("pending", []))


# Knee candidates (verified positions per step), log-spaced: the knee is learned as a
# posterior over this grid, the rest of the cost model by linear regression given it.
KNEE_GRID: tuple[float, ...] = tuple(float(x) for x in np.geomspace(8, 2048, 25))

# Ratio between neighbouring knees of the grid: how precisely a knee can be known.
KNEE_CELL = KNEE_GRID[1] / KNEE_GRID[0]


class StepCostModel:
    """Posterior over an engine's step-time model (see :mod:`policies.fleet`).

    Step time = step_s × max(1, T / knee) + Σ_p draft_cost_p × step_s × depth_p, where
    T is the batch's verified positions per step and depth_p the deepest γ of proposer
    p. For each knee on a grid this is linear in (step_s, step_s × draft_cost_p), so a
    discounted Bayesian linear regression per knee plus the knees' likelihoods make
    the posterior. Features come from the batch composition the policy itself assigned.
    """

    def __init__(
        self,
        proposers: Sequence[str],
        *,
        half_life_s: float = 1800.0,
        draft_cost_prior: float | None = None,
    ) -> None:
        self.proposers = tuple(sorted(proposers))
        self.half_life_s = half_life_s
        self.draft_cost_prior = draft_cost_prior
        """Prior drafting cost per draft position, as a fraction of a plain step (None:
        no prior beyond the ridge). Where an engine runs one arm at a time (push mode),
        its step times cannot tell the plain step from drafting: both move together.
        The prior decides that split, weakly enough that any contrast in the data (the
        engine also ran another γ, another proposer, or off) outweighs it; without it,
        the ridge alone would split the time by minimum norm and call drafting most of
        the step. Speculation is never free (every verify step drafts, samples and
        rejects), so the prior is positive."""
        dims = 1 + len(self.proposers)
        knees = len(KNEE_GRID)
        self._knees = np.array(KNEE_GRID)
        self.xtx = np.zeros((knees, dims, dims))
        self.xty = np.zeros((knees, dims))
        self.yty = 0.0
        self.weight = 0.0
        self.largest_batch = 0.0
        """The most verified positions per step any request's batches averaged."""
        self.updated_at: float | None = None
        self._fitted: tuple[FloatArray, FloatArray, FloatArray, FloatArray] | None = None
        self._mean_params: CostParams | None = None

    def features(self, verify_tokens: float, depth: dict[str, int]) -> FloatArray:
        """Design rows for every knee: (knees × dims)."""
        rows = np.empty((len(self._knees), 1 + len(self.proposers)))
        rows[:, 0] = np.maximum(1.0, verify_tokens / self._knees)
        for j, proposer in enumerate(self.proposers):
            rows[:, 1 + j] = depth.get(proposer, 0)
        return rows

    def update(self, rows: FloatArray, step_s: float, now: float, *, weight: float = 1.0) -> None:
        """Add one request: its mean design rows over its life (see :meth:`features`);
        or a worker's window, as ``weight`` requests of its mean step time."""
        if self.updated_at is not None:
            factor = decay_factor(now - self.updated_at, self.half_life_s)
            self.xtx *= factor
            self.xty *= factor
            self.yty *= factor
            self.weight *= factor
        self.updated_at = now
        self._fitted = None
        self._mean_params = None
        self.xtx += weight * rows[:, :, None] * rows[:, None, :]
        self.xty += weight * rows * step_s
        self.yty += weight * step_s * step_s
        self.weight += weight
        # The first column at the lowest knee is T / knee where T passed it.
        self.largest_batch = max(self.largest_batch, float(rows[0, 0] * self._knees[0]))

    @property
    def ready(self) -> bool:
        return self.weight >= 3.0

    def _fit(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Per knee: coefficients, residual variance, log-likelihood, precision matrices."""
        if self._fitted is None:
            self._fitted = self._solve()
        return self._fitted

    def _solve(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        dims = self.xtx.shape[1]
        scale = max(self.yty / max(self.weight, 1e-9), 1e-12)
        # Ridge: a weak prior pulling coefficients towards zero, scaled to the data.
        ridge = np.eye(dims)
        if self.draft_cost_prior is not None:
            # The plain step is always in the data (every step has one); pulling it to
            # zero would, where drafting and the step cannot be told apart, hand the
            # difference to drafting against the prior below.
            ridge[0, 0] = 0.0
        precision = self.xtx + 1e-3 * ridge[None, :, :] * max(self.weight, 1.0)
        if self.draft_cost_prior is not None:
            # Penalise (β_p − prior × β_0)² per proposer: drafting costs about the prior's
            # share of a plain step per position unless the data says otherwise.
            contrast = np.zeros((len(self.proposers), dims))
            contrast[:, 0] = -self.draft_cost_prior
            contrast[:, 1:] = np.eye(len(self.proposers))
            precision = precision + 1e-2 * max(self.weight, 1.0) * (contrast.T @ contrast)[None]
        coefficients = np.linalg.solve(precision, self.xty[:, :, None])[:, :, 0]
        coefficients[:, 0] = np.maximum(coefficients[:, 0], 1e-9)
        coefficients[:, 1:] = np.maximum(coefficients[:, 1:], 0.0)
        sse = (
            self.yty
            - 2 * np.einsum("kd,kd->k", coefficients, self.xty)
            + np.einsum("kd,kde,ke->k", coefficients, self.xtx, coefficients)
        )
        variance = np.maximum(sse, 1e-6 * scale * max(self.weight, 1.0)) / max(
            self.weight - dims, 1.0
        )
        log_likelihood = -0.5 * self.weight * np.log(variance)
        return (
            np.asarray(coefficients, dtype=np.float64),
            np.asarray(variance, dtype=np.float64),
            np.asarray(log_likelihood, dtype=np.float64),
            precision,
        )

    def _best_knee(self, margin: float = 1.0) -> int:
        """Index of the knee the mean parameters use.

        The most likely knee; where the data cannot tell several apart (log-likelihoods
        within ``margin``), the lowest of them that no batch seen has run past, i.e.
        the batches seen were memory-bound unless the data says otherwise. (Batches of
        one size only fit any knee below that size as well as any above, with a smaller
        plain step; the lowest would claim, against no evidence, that every batch seen
        was compute-bound.) Without such a knee, the lowest of the most likely ones.
        """
        _, _, log_likelihood, _ = self._fit()
        tied = log_likelihood >= log_likelihood.max() - margin
        # The first design column averages max(1, T / knee): exactly 1 where no batch
        # went past the knee, so its mean square is 1.
        unbound = self.xtx[:, 0, 0] <= self.weight * (1.0 + 1e-9)
        candidates = np.flatnonzero(tied & unbound)
        if len(candidates):
            return int(candidates[0])
        return int(np.argmax(log_likelihood))

    def mean_params(self) -> CostParams:
        fitted = self._fit()
        if self._mean_params is None:
            coefficients = fitted[0]
            best = self._best_knee()
            self._mean_params = self._params(coefficients[best], float(self._knees[best]))
        return self._mean_params

    def next_knee_params(self, margin: float = 1.0) -> CostParams | None:
        """The fit at the grid knee just above :meth:`mean_params`' knee, if the data
        cannot tell the two apart (log-likelihoods within ``margin``); else None.

        Where every batch seen so far stayed below the knee, each knee above the largest
        batch fits equally well and the mean parameters take the lowest: the knee sits
        at the edge of what was seen, and planning on it never runs a larger batch that
        would show the knee to be higher. This is the first step past that edge.
        """
        coefficients, _, log_likelihood, _ = self._fit()
        best = self._best_knee(margin)
        above = best + 1
        if above >= len(self._knees) or log_likelihood[above] < log_likelihood[best] - margin:
            return None
        return self._params(coefficients[above], float(self._knees[above]))

    def edge_params(self) -> CostParams:
        """:meth:`mean_params` with the knee as low as the data allows: where no batch
        seen went past the knee, right at the largest batch seen (the grid knee the
        mean takes lies up to a cell above it, and the data fits every knee between
        the two alike)."""
        mean = self.mean_params()
        if self.largest_batch <= 0.0 or self.largest_batch >= mean.knee_tokens:
            return mean
        return dataclasses.replace(mean, knee_tokens=max(self.largest_batch, 1.0))

    def sample_params(self, rng: np.random.Generator, draws: int) -> list[CostParams]:
        coefficients, variance, log_likelihood, precision = self._fit()
        weights = np.exp(log_likelihood - log_likelihood.max())
        weights /= weights.sum()
        out = []
        for knee_index in rng.choice(len(self._knees), size=draws, p=weights):
            covariance = variance[knee_index] * np.linalg.inv(precision[knee_index])
            try:
                factor = np.linalg.cholesky(covariance)
            except np.linalg.LinAlgError:
                factor = np.diag(np.sqrt(np.maximum(np.diag(covariance), 0.0)))
            beta = coefficients[knee_index] + factor @ rng.standard_normal(len(covariance))
            beta[0] = max(beta[0], 1e-9)
            out.append(self._params(np.maximum(beta, 0.0), float(self._knees[knee_index])))
        return out

    def _params(self, beta: FloatArray, knee: float) -> CostParams:
        step = float(max(beta[0], 1e-9))
        draft = {p: float(beta[1 + j]) / step for j, p in enumerate(self.proposers)}
        return CostParams(step_s=step, knee_tokens=knee, draft_cost=draft)

    def to_state(self) -> dict[str, Any]:
        return {
            "proposers": list(self.proposers),
            "xtx": self.xtx.tolist(),
            "xty": self.xty.tolist(),
            "yty": self.yty,
            "weight": self.weight,
            "largest_batch": self.largest_batch,
            "updated_at": self.updated_at,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.xtx = np.array(state["xtx"], dtype=float)
        self.xty = np.array(state["xty"], dtype=float)
        self.yty = float(state["yty"])
        self.weight = float(state["weight"])
        self.largest_batch = float(state.get("largest_batch", 0.0))
        self.updated_at = state["updated_at"]
        self._fitted = None
        self._mean_params = None


class BatchTracker:
    """The batch composition the policy assigned, integrated over time.

    A request's step time reflects every batch it shared during its life, so its
    design rows for :class:`StepCostModel` are time averages over that life, not a
    snapshot at its end (a snapshot would smear a short-lived expensive neighbour over
    everyone and bias the drafting costs down). The policy adds an arm when it serves a
    request and removes it when the request is observed; between events the
    composition is constant, so the integral is piecewise linear and a short history of
    it answers "average since t0" exactly.
    """

    def __init__(self, cost: StepCostModel, history: int = 8192) -> None:
        self._cost = cost
        self.counts: Counter[Arm] = Counter()
        self._at: float | None = None
        self._integral = np.zeros_like(cost.features(0, {}))
        self._times: deque[float] = deque(maxlen=history)
        self._integrals: deque[FloatArray] = deque(maxlen=history)

    def _rows(self) -> FloatArray:
        return self._cost.features(*self.composition())

    def _advance(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._integral = self._integral + self._rows() * (now - self._at)
        if self._at is None or now >= self._at:
            self._at = now
            self._times.append(now)
            self._integrals.append(self._integral)

    def add(self, arm: Arm, now: float) -> None:
        self._advance(now)
        self.counts[arm] += 1

    def remove(self, arm: Arm, now: float) -> None:
        self._advance(now)
        if self.counts[arm] > 0:
            self.counts[arm] -= 1

    def mean_rows(self, start: float, end: float) -> FloatArray | None:
        """Average design rows over [start, end]; None if that is not covered."""
        if end <= start or not self._times or start < self._times[0] or end > self._times[-1]:
            return None
        return (self._integral_at(end) - self._integral_at(start)) / (end - start)

    def _integral_at(self, t: float) -> FloatArray:
        index = bisect.bisect_right(self._times, t) - 1
        base_t, base = self._times[index], self._integrals[index]
        if index + 1 < len(self._times):
            next_t, following = self._times[index + 1], self._integrals[index + 1]
            if next_t > base_t:
                result: FloatArray = base + (following - base) * (t - base_t) / (next_t - base_t)
                return result
        return base

    @property
    def in_flight(self) -> int:
        return sum(c for c in self.counts.values() if c > 0)

    def composition(self, extra: Arm | None = None) -> tuple[float, dict[str, int]]:
        """(verified positions per step, deepest γ per proposer) of the batch now,
        optionally with one more sequence on ``extra``."""
        return composition(self.counts, extra)


def composition(
    counts: Mapping[Arm, float], extra: Arm | None = None
) -> tuple[float, dict[str, int]]:
    """(verified positions per step, deepest γ per proposer) of a batch holding
    ``counts`` sequences per arm, optionally with one more sequence on ``extra``."""
    verify = 0.0
    depth: dict[str, int] = {}
    members = list(counts.items()) + ([(extra, 1.0)] if extra is not None else [])
    for arm, count in members:
        if count <= 0:
            continue
        verify += count * arm.verify_tokens
        if arm.proposer is not None:
            depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
    return verify, depth
