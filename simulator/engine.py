"""The simulated engine: one continuous batch holding every in-flight request.

Each request carries its own arm. All in-flight sequences advance together, one step at
a time; a step's duration follows :class:`policies.fleet.CostParams` from the batch's
total verified positions and the drafting its proposers need, so every policy pays for
what its choices do to everybody else's latency — the fair comparison on the same
capacity. A request's acceptance is its own (drawn around the class × proposer mean)
and is fixed when it is admitted, as is how many steps it will take under its arm.

The engine is event-driven: the batch's composition, hence the step time, only changes
when a request joins or finishes, so ``advance`` jumps over all steps in between at
once. It can also be stepped in real time (a server drives ``add`` and ``advance``
from its own clock); the engine itself never reads a clock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from policies.arms import Arm
from policies.fleet import CostParams
from simulator.scenario import Scenario


@dataclass(frozen=True, slots=True, eq=False)
class SimRequest:
    """One request's content, independent of how it is served."""

    request_id: int
    stream: int
    workload_class: str
    output_tokens: int
    alpha: dict[str, float]
    """This request's own mean acceptance per proposer."""
    uniforms: npt.NDArray[np.float64]
    """One draw per potential step: a step accepts its k-th draft when u < P(L ≥ k),
    so the same draw decides every γ alike (common random numbers across arms)."""


class Traffic:
    """Deterministic request content per (stream, index): every policy sees the same.

    Request ``index`` of ``stream`` always has the same class, length and random draws,
    whatever time it is issued at; only a drift in force at issue time changes its
    acceptance. One instance may serve several runs (it remembers what it drew).
    """

    def __init__(self, scenario: Scenario) -> None:
        self._scenario = scenario
        self._classes = list(scenario.classes)
        total = sum(scenario.classes[c].share for c in self._classes)
        self._cumulative = list(
            itertools.accumulate(scenario.classes[c].share / total for c in self._classes)
        )
        self._proposers = sorted(scenario.proposers)
        self._change_times = sorted({d.at_s for d in scenario.drift})
        self._quantiles: dict[tuple[int, str], list[npt.NDArray[np.float64] | None]] = {}
        self._streams: dict[int, tuple[int, np.random.Generator | None]] = {}
        # Content already drawn, so several runs over one Traffic draw each request once.
        self._drawn: dict[
            tuple[int, int], tuple[int, int, npt.NDArray[np.float64], list[float]]
        ] = {}
        self._next_id = 0

    def request(self, stream: int, index: int, t: float) -> SimRequest:
        """Request ``index`` of ``stream``; streams are read in order (0, 1, 2, …)."""
        content = self._drawn.get((stream, index))
        if content is None:
            issued, rng = self._streams.get(stream, (0, None))
            if rng is None or index != issued:
                # Each stream is its own generator; jumping to an index replays it.
                rng = np.random.default_rng((self._scenario.seed, stream))
                for _ in range(index):
                    self._draw(rng)
            content = self._drawn[(stream, index)] = self._draw(rng)
            self._streams[stream] = (index + 1, rng)
        position, output_tokens, uniforms, alpha_draws = content
        cls = self._classes[position]
        alpha: dict[str, float] = {}
        tables = self._quantile_tables(cls, t)
        for proposer, draw, table in zip(self._proposers, alpha_draws, tables, strict=True):
            if table is None:
                alpha[proposer] = self._scenario.acceptance_at(cls, proposer, t)
            else:
                alpha[proposer] = float(table[int(draw * (len(table) - 1))])
        self._next_id += 1
        return SimRequest(self._next_id, stream, cls, output_tokens, alpha, uniforms)

    def _quantile_tables(self, cls: str, t: float) -> list[npt.NDArray[np.float64] | None]:
        """Per proposer, the inverse CDF of this class's α at t (None: α is 0 or 1)."""
        epoch = bisect.bisect_right(self._change_times, t)
        key = (epoch, cls)
        tables = self._quantiles.get(key)
        if tables is None:
            kappa = self._scenario.model.acceptance_concentration
            tables = []
            for proposer in self._proposers:
                mean = self._scenario.acceptance_at(cls, proposer, t)
                if 0.0 < mean < 1.0:
                    tables.append(_beta_inverse_cdf(kappa * mean, kappa * (1 - mean)))
                else:
                    tables.append(None)
            self._quantiles[key] = tables
        return tables

    def _draw(
        self, rng: np.random.Generator
    ) -> tuple[int, int, npt.NDArray[np.float64], list[float]]:
        # The same number of draws whatever the time: a drift changes α, not the stream.
        head = rng.random(2 + len(self._proposers)).tolist()
        position = min(bisect.bisect_right(self._cumulative, head[0]), len(self._classes) - 1)
        spec = self._scenario.classes[self._classes[position]]
        spread = spec.output_spread * (2.0 * head[1] - 1.0)
        output_tokens = max(2, int(spec.output_tokens * (1.0 + spread) + 0.5))
        return position, output_tokens, rng.random(output_tokens), head[2:]


_BETA_GRID = np.linspace(0.0005, 0.9995, 1000)
_QUANTILE_POINTS = np.linspace(0.0, 1.0, 1001)


def _beta_inverse_cdf(a: float, b: float) -> npt.NDArray[np.float64]:
    """Beta(a, b) quantiles at 1001 evenly spaced probabilities.

    A uniform maps to α through this table (monotonically), so a drift moves every
    request's α the same way instead of reshuffling draws between policies. Accurate
    to about 1e-3, plenty for a traffic model.
    """
    log_density = (a - 1) * np.log(_BETA_GRID) + (b - 1) * np.log1p(-_BETA_GRID)
    density = np.exp(log_density - log_density.max())
    cdf = np.cumsum(density)
    cdf /= cdf[-1]
    result: npt.NDArray[np.float64] = np.interp(_QUANTILE_POINTS, cdf, _BETA_GRID)
    return result


@dataclass(frozen=True, slots=True)
class Plan:
    """How a request unfolds under one arm: steps and what each emits."""

    steps: int
    emitted_cumulative: npt.NDArray[np.int64] | None
    """Tokens emitted after each step (capped at the request's length); None when
    every step emits one token (no speculation), which needs no array."""
    accepted_per_position: tuple[int, ...]
    accepted: int

    def emitted_after(self, steps: int) -> int:
        """Tokens emitted once ``steps`` (≥ 1) of its steps have run."""
        if self.emitted_cumulative is None:
            return min(steps, self.steps)
        return int(self.emitted_cumulative[min(steps, self.steps) - 1])

    def cumulative(self) -> npt.NDArray[np.int64]:
        """Tokens emitted after each step, as an array even without speculation."""
        if self.emitted_cumulative is None:
            return np.arange(1, self.steps + 1, dtype=np.int64)
        return self.emitted_cumulative


def plan_request(request: SimRequest, arm: Arm, position_decay: float) -> Plan:
    """Steps a request needs under an arm, from its own acceptance and draws.

    This runs once per request and arm, on arrays of a few hundred elements, so it
    keeps the number of numpy calls (each ~1 µs of overhead) small.
    """
    n = request.output_tokens
    if arm.proposer is None:
        return Plan(n, None, (), 0)
    alpha = request.alpha.get(arm.proposer, 0.0)
    gamma = arm.gamma
    # P(L ≥ k) for k = γ … 1: ascending (survival decreases with k). A step accepts
    # as many drafts as there are levels above its uniform; it emits one more.
    levels = np.array(
        [alpha**k * position_decay ** (k * (k - 1) / 2.0) for k in range(gamma, 0, -1)]
    )
    emits = (gamma + 1) - np.searchsorted(levels, request.uniforms, side="right")
    emitted = np.cumsum(emits)
    steps = int(np.searchsorted(emitted, n)) + 1
    accepted = int(emitted[steps - 1]) - steps
    # Steps accepting more than i drafts = steps emitting more than i + 1 tokens.
    counts = np.bincount(emits[:steps], minlength=gamma + 2).tolist()
    per_position = []
    above = 0
    for emitted_count in range(gamma + 1, 1, -1):
        above += counts[emitted_count]
        per_position.append(above)
    per_position.reverse()
    emitted_used = emitted[:steps]
    emitted_used[-1] = n
    return Plan(steps, emitted_used, tuple(per_position), accepted)


@dataclass(slots=True, eq=False)
class _Flight:
    request: SimRequest
    arm: Arm
    plan: Plan
    admitted_at: float
    concurrency: int
    start_step: int
    first_token_at: float | None = None


@dataclass(slots=True)
class Completion:
    request: SimRequest
    arm: Arm
    observation: RequestObservation


class Engine:
    """The batch. ``add`` admits a request with its arm; ``advance`` runs steps.

    Steps are counted globally; a request admitted at step s with a plan of n steps
    finishes at step s + n, so a heap of finish steps replaces per-request counters.
    """

    def __init__(self, cost: CostParams, model_name: str, position_decay: float) -> None:
        self.cost = cost
        self.model_name = model_name
        self.position_decay = position_decay
        self.now = 0.0
        self.steps_run = 0
        self._flights: dict[int, _Flight] = {}
        self._finish_heap: list[tuple[int, int]] = []
        self._awaiting_first_token: list[_Flight] = []
        self._finished_tokens = 0
        self._verify_tokens = 0
        self._depths: dict[str, Counter[int]] = {}
        self._step_time: float | None = None
        self._sequence = 0

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def emitted_tokens(self) -> int:
        """Tokens generated so far, by finished and in-flight requests."""
        total = self._finished_tokens
        for flight in self._flights.values():
            done = self.steps_run - flight.start_step
            if done > 0:
                total += flight.plan.emitted_after(done)
        return total

    def add(self, request: SimRequest, arm: Arm, concurrency: int | None = None) -> None:
        """Admit a request now. ``concurrency`` is what its observation reports as in
        flight at its start (default: the batch including it)."""
        plan = plan_request(request, arm, self.position_decay)
        self._sequence += 1
        seen = concurrency if concurrency is not None else len(self._flights) + 1
        flight = _Flight(request, arm, plan, self.now, seen, self.steps_run)
        self._flights[self._sequence] = flight
        heapq.heappush(self._finish_heap, (self.steps_run + plan.steps, self._sequence))
        self._awaiting_first_token.append(flight)
        self._account(arm, +1)

    def _account(self, arm: Arm, sign: int) -> None:
        self._verify_tokens += sign * arm.verify_tokens
        if arm.proposer is not None:
            depths = self._depths.setdefault(arm.proposer, Counter())
            depths[arm.gamma] += sign
            if depths[arm.gamma] <= 0:
                del depths[arm.gamma]
        self._step_time = None

    def next_finish_at(self) -> float:
        """When the next request finishes if nothing joins (``inf`` when idle)."""
        if not self._finish_heap:
            return float("inf")
        return self.now + (self._finish_heap[0][0] - self.steps_run) * self.step_time()

    def step_time(self) -> float:
        if self._step_time is None:
            depth = {p: max(c) for p, c in self._depths.items() if c}
            self._step_time = self.cost.step_time(self._verify_tokens, depth)
        return self._step_time

    def advance(self, until: float) -> list[Completion]:
        """Run whole steps until a request finishes or time reaches ``until``.

        Overshoots ``until`` by less than one step (steps are not divisible). Returns
        the requests that finished, with their observations; an idle engine just
        moves its clock to ``until``.
        """
        if not self._flights:
            self.now = max(self.now, until)
            return []
        step = self.step_time()
        to_next_finish = self._finish_heap[0][0] - self.steps_run
        to_until = max(1, math.ceil((until - self.now) / step - 1e-9))
        k = min(to_next_finish, to_until)
        for flight in self._awaiting_first_token:
            flight.first_token_at = self.now + step
        self._awaiting_first_token.clear()
        self.now += k * step
        self.steps_run += k
        finished: list[Completion] = []
        while self._finish_heap and self._finish_heap[0][0] <= self.steps_run:
            _, key = heapq.heappop(self._finish_heap)
            flight = self._flights.pop(key)
            self._account(flight.arm, -1)
            self._finished_tokens += flight.request.output_tokens
            finished.append(self._complete(flight))
        return finished

    def _complete(self, flight: _Flight) -> Completion:
        plan = flight.plan
        first = flight.first_token_at if flight.first_token_at is not None else self.now
        generation = self.now - first
        spec = None
        if flight.arm.proposer is not None:
            spec = SpecDecodeRequestStats(
                num_drafts=plan.steps,
                num_draft_tokens=plan.steps * flight.arm.gamma,
                num_accepted_tokens=plan.accepted,
                accepted_per_position=plan.accepted_per_position,
            )
        observation = RequestObservation(
            model=self.model_name,
            prompt_tokens=None,
            output_tokens=flight.request.output_tokens,
            ttft_s=first - flight.admitted_at,
            # vLLM's per-request mean_itl is per token, not per step (0 for one token).
            mean_itl_s=generation / max(flight.request.output_tokens - 1, 1),
            generation_time_s=generation,
            spec=spec,
            workload_class=flight.request.workload_class,
            arm=str(flight.arm),
            concurrency=flight.concurrency,
            finished_at=self.now,
        )
        return Completion(flight.request, flight.arm, observation)
