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

import functools
from dataclasses import dataclass, field

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
    acceptance.
    """

    def __init__(self, scenario: Scenario) -> None:
        self._scenario = scenario
        self._classes = list(scenario.classes)
        shares = np.array([scenario.classes[c].share for c in self._classes])
        self._cumulative = np.cumsum(shares / shares.sum())
        self._proposers = sorted(scenario.proposers)
        self._next_id = 0

    def request(self, stream: int, index: int, t: float) -> SimRequest:
        scenario = self._scenario
        rng = np.random.default_rng((scenario.seed, stream, index))
        position = int(np.searchsorted(self._cumulative, rng.random(), side="right"))
        cls = self._classes[min(position, len(self._classes) - 1)]
        spec = scenario.classes[cls]
        spread = spec.output_spread * (2.0 * rng.random() - 1.0)
        output_tokens = max(2, round(spec.output_tokens * (1.0 + spread)))
        uniforms = rng.random(output_tokens)
        kappa = scenario.model.acceptance_concentration
        alpha: dict[str, float] = {}
        for proposer in self._proposers:
            mean = scenario.acceptance_at(cls, proposer, t)
            draw = rng.random()  # always consumed, so later proposers do not shift
            if 0.0 < mean < 1.0:
                alpha[proposer] = float(_beta_quantile(draw, kappa * mean, kappa * (1 - mean)))
            else:
                alpha[proposer] = mean
        self._next_id += 1
        return SimRequest(self._next_id, stream, cls, output_tokens, alpha, uniforms)


def _beta_quantile(u: float, a: float, b: float) -> float:
    """Inverse CDF of Beta(a, b), so one uniform maps to α monotonically.

    Used instead of ``Generator.beta`` so that a drift moves every request's α the same
    way rather than reshuffling the draws between policies.
    """
    return float(np.interp(u, _beta_cdf(a, b), _BETA_GRID))


_BETA_GRID = np.linspace(0.0005, 0.9995, 1000)


@functools.lru_cache(maxsize=256)
def _beta_cdf(a: float, b: float) -> npt.NDArray[np.float64]:
    # Density on a fixed grid, cumulated: accurate to about 1e-3, plenty for traffic.
    log_density = (a - 1) * np.log(_BETA_GRID) + (b - 1) * np.log1p(-_BETA_GRID)
    density = np.exp(log_density - log_density.max())
    cdf = np.cumsum(density)
    result: npt.NDArray[np.float64] = cdf / cdf[-1]
    return result


@dataclass(frozen=True, slots=True)
class Plan:
    """How a request unfolds under one arm: steps and what each emits."""

    steps: int
    emitted_cumulative: npt.NDArray[np.int64]
    """Tokens emitted after each step (capped at the request's length)."""
    accepted_per_position: tuple[int, ...]
    accepted: int


def plan_request(request: SimRequest, arm: Arm, position_decay: float) -> Plan:
    """Steps a request needs under an arm, from its own acceptance and draws."""
    n = request.output_tokens
    if arm.proposer is None:
        return Plan(n, np.arange(1, n + 1, dtype=np.int64), (), 0)
    alpha = request.alpha.get(arm.proposer, 0.0)
    k = np.arange(1, arm.gamma + 1)
    survival = alpha**k * position_decay ** (k * (k - 1) / 2.0)
    accepted = (request.uniforms[:, None] < survival[None, :]).sum(axis=1)
    emitted = np.cumsum(accepted + 1)
    steps = int(np.searchsorted(emitted, n)) + 1
    used = accepted[:steps]
    counts = np.bincount(used, minlength=arm.gamma + 1)
    # Steps accepting more than i drafts: reverse cumulative counts from position i+1.
    per_position = tuple(int(x) for x in np.cumsum(counts[::-1])[::-1][1:])
    return Plan(steps, np.minimum(emitted[:steps], n), per_position, int(used.sum()))


@dataclass(slots=True, eq=False)
class _Flight:
    request: SimRequest
    arm: Arm
    plan: Plan
    admitted_at: float
    concurrency: int
    done: int = 0
    first_token_at: float | None = None


@dataclass(slots=True)
class Completion:
    request: SimRequest
    arm: Arm
    observation: RequestObservation


@dataclass(slots=True)
class Engine:
    """The batch. ``add`` admits a request with its arm; ``advance`` runs steps."""

    cost: CostParams
    model_name: str
    position_decay: float
    now: float = 0.0
    emitted_tokens: int = 0
    """Tokens generated so far, across all requests (finished or not)."""
    steps_run: int = 0
    _flights: list[_Flight] = field(default_factory=list)
    _step_time: float | None = None

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def add(self, request: SimRequest, arm: Arm) -> None:
        plan = plan_request(request, arm, self.position_decay)
        self._flights.append(_Flight(request, arm, plan, self.now, len(self._flights) + 1))
        self._step_time = None

    def step_time(self) -> float:
        if self._step_time is None:
            self._step_time = self.cost.batch_step_time(f.arm for f in self._flights)
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
        to_next_finish = min(f.plan.steps - f.done for f in self._flights)
        to_until = max(1, int(np.ceil((until - self.now) / step - 1e-9)))
        k = min(to_next_finish, to_until)
        start = self.now
        self.now = start + k * step
        self.steps_run += k
        finished: list[Completion] = []
        remaining: list[_Flight] = []
        for flight in self._flights:
            cumulative = flight.plan.emitted_cumulative
            before = int(cumulative[flight.done - 1]) if flight.done else 0
            if flight.first_token_at is None:
                flight.first_token_at = start + step
            flight.done += k
            self.emitted_tokens += int(cumulative[flight.done - 1]) - before
            if flight.done >= flight.plan.steps:
                finished.append(self._complete(flight))
            else:
                remaining.append(flight)
        if finished:
            self._flights = remaining
            self._step_time = None
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
            mean_itl_s=generation / (plan.steps - 1) if plan.steps > 1 else None,
            generation_time_s=generation,
            spec=spec,
            workload_class=flight.request.workload_class,
            arm=str(flight.arm),
            concurrency=flight.concurrency,
            finished_at=self.now,
        )
        return Completion(flight.request, flight.arm, observation)
