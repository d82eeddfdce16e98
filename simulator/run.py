"""The fast in-process mode: run one policy over a scenario's closed-loop traffic."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from policies.arms import Arm, ConcurrencyBuckets, Context
from policies.base import Clock, Policy
from simulator.engine import Completion, Engine, SimRequest, Traffic
from simulator.scenario import Scenario


class Batching(Protocol):
    """What ``simulate`` drives: one :class:`Engine`, or one per arm
    (tests/policies/test_policy_routing.py ``PerArmEngines``)."""

    now: float

    @property
    def in_flight(self) -> int: ...

    def add(self, request: SimRequest, arm: Arm, concurrency: int | None = None) -> None: ...

    def advance(self, until: float) -> list[Completion]: ...

    def emitted_tokens(self) -> int: ...


class SimClock:
    """The simulated time line, readable by the policies as their injected clock."""

    def __init__(self, engine: Batching) -> None:
        self._engine = engine

    def __call__(self) -> float:
        return self._engine.now


@dataclass(frozen=True, slots=True)
class Admission:
    """One request as it entered the batch."""

    at_s: float
    workload_class: str
    arm: Arm
    explored: bool
    """Served by an arm other than the policy's best guess at that moment."""


@dataclass(slots=True)
class RunResult:
    policy: str
    duration_s: float
    tokens: int
    phase_tokens: list[int]
    phase_seconds: list[float]
    tpots: list[float] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        """Generated tokens per simulated second."""
        return self.tokens / self.duration_s

    def phase_goodput(self, index: int) -> float:
        seconds = self.phase_seconds[index]
        return self.phase_tokens[index] / seconds if seconds > 0 else 0.0

    @property
    def mean_tpot_s(self) -> float:
        return sum(self.tpots) / len(self.tpots) if self.tpots else float("nan")


PolicyFactory = Callable[[Clock], Policy]


def _descending(stream: int) -> int:
    return -stream


def simulate(
    scenario: Scenario,
    make_policy: PolicyFactory,
    buckets: ConcurrencyBuckets | None = None,
    progress: Callable[[float], None] | None = None,
    traffic: Traffic | None = None,
    engine: Batching | None = None,
) -> RunResult:
    """Serve the scenario's traffic with one policy; deterministic for a given seed.

    Streams are closed loops: stream i is active while the phase's concurrency exceeds
    i, and issues its next request as soon as the previous one finishes. A stream that
    becomes inactive finishes its request first. ``progress`` gets the fraction of
    simulated time done, now and then. Passing the same ``traffic`` to several runs of
    one scenario saves drawing the requests again. ``engine`` replaces the default
    single batch (e.g. with one engine per arm, for routing mode).
    """
    buckets = buckets or ConcurrencyBuckets()
    if engine is None:
        engine = Engine(scenario.cost, scenario.model.name, scenario.model.position_decay)
    policy = make_policy(SimClock(engine))
    traffic = traffic or Traffic(scenario)
    max_streams = max(p.concurrency for p in scenario.phases)
    # Idle streams, highest first, so the lowest-numbered idle stream is popped first.
    idle = list(range(max_streams - 1, -1, -1))
    issued = [0] * max_streams
    boundaries = sorted(
        {p.at_s for p in scenario.phases} | {d.at_s for d in scenario.drift} | {scenario.duration_s}
    )
    next_boundary = 0
    phase_tokens = [0] * len(scenario.phases)
    phase_seconds = [0.0] * len(scenario.phases)
    result = RunResult(policy.name, scenario.duration_s, 0, phase_tokens, phase_seconds)
    model = scenario.model.name
    next_report = 0.0
    counted = 0
    # Phases start in strictly increasing order (the scenario checks it), so the phase
    # in force is a bisection; this loop runs once per event and stays lean.
    starts = [p.at_s for p in scenario.phases]
    levels = [p.concurrency for p in scenario.phases]
    bucket_of: dict[int, str] = {}
    admissions = result.admissions
    tpots = result.tpots
    while engine.now < scenario.duration_s:
        now = engine.now
        phase = max(0, bisect_right(starts, now) - 1)
        active = levels[phase] if now >= starts[0] else 0
        if idle and idle[-1] < active:
            # Requests that start at the same instant all see each other in flight.
            starting = sum(1 for s in idle if s < active)
            concurrency = engine.in_flight + starting
            bucket = bucket_of.get(concurrency)
            if bucket is None:
                bucket = bucket_of[concurrency] = buckets.bucket(concurrency)
            while idle and idle[-1] < active:
                stream = idle.pop()
                request = traffic.request(stream, issued[stream], now)
                issued[stream] += 1
                context = Context(model, request.workload_class, bucket)
                # The request path asks only ``select`` (the controller does too), so
                # it runs first and carries any re-planning; ``best_guess`` after it
                # only tells whether the request explored.
                arm = policy.select(context)
                guess = policy.best_guess(context)
                engine.add(request, arm, concurrency)
                admissions.append(Admission(now, request.workload_class, arm, arm != guess))
        while next_boundary < len(boundaries) and boundaries[next_boundary] <= now:
            next_boundary += 1
        horizon = boundaries[next_boundary] if next_boundary < len(boundaries) else now
        completions = engine.advance(horizon)
        phase_seconds[phase] += min(engine.now, scenario.duration_s) - now
        if engine.now >= horizon:
            # Token counts are settled only at boundaries: cheaper than every event.
            emitted = engine.emitted_tokens()
            phase_tokens[phase] += emitted - counted
            counted = emitted
        for completion in completions:
            insort(idle, completion.request.stream, key=_descending)
            observation = completion.observation
            tpot = observation.tpot_s
            if tpot is not None:
                tpots.append(tpot)
            policy.observe(observation)
        if progress is not None and engine.now >= next_report:
            progress(min(1.0, engine.now / scenario.duration_s))
            next_report = engine.now + scenario.duration_s / 100
    result.tokens = sum(phase_tokens)
    return result
