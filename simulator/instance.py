"""One simulated vLLM instance: a speculative config and an :class:`Engine` in real time.

The server mode's unit. An instance runs the same engine (and so the same cost model
and acceptance draws) as the fast in-process mode, but advances it along the wall
clock — scaled by ``speed`` so that a demo or a test runs faster than a real GPU —
and hands every engine step's output to the HTTP layer as it happens.

Time: the simulated clock is ``(clock() - epoch) × speed`` seconds, one clock for a
whole fleet, so a scenario's drift events hit every instance at once. Every latency an
instance reports (per-request metrics, histograms) is in *simulated* seconds: the
figures a real GPU would show, whatever the speed-up.

Stepping: the engine jumps over all steps until the next finish or until one ``tick``
of wall time ahead, then the driver sleeps until the wall clock reaches the engine's
time and only then publishes those steps (tokens to streams, counters to /metrics).
So a client never sees output before its simulated time, and CPU stays low: at most
one wake-up per tick per busy instance, none when idle. New requests join the batch at
the next step boundary, as in vLLM's continuous batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm
from simulator.engine import Completion, Engine, Plan, SimRequest, plan_request
from simulator.scenario import Scenario
from simulator.vllm_metrics import VllmMetrics

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

VLLM_METHOD_ALIASES: Mapping[str, str] = {"draft_model": "draft"}
"""vLLM ``method`` names whose scenario proposer is usually spelled differently."""


class ConfigError(ValueError):
    """A speculative config the scenario's fleet cannot serve; the message says why."""


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """What ``--speculative-config`` an instance runs: off, or a proposer with γ.

    ``per_batch_size`` mirrors vLLM's ``num_speculative_tokens_per_batch_size``:
    inclusive ``(first_batch_size, last_batch_size, k)`` ranges, k = 0 meaning no
    speculation at that batch size; batch sizes outside every range use ``gamma``.
    The engine fixes a request's arm when it joins, so the table is read with the
    batch size at admission (the request itself included).
    """

    proposer: str | None
    gamma: int = 0
    per_batch_size: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        Arm(self.proposer, self.gamma)  # validates proposer and γ together
        for low, high, k in self.per_batch_size:
            if self.proposer is None:
                raise ConfigError("a batch-size table needs a proposer")
            if not 1 <= low <= high:
                raise ConfigError(f"batch-size range {low}-{high} is not 1 <= first <= last")
            if not 0 <= k <= self.gamma:
                raise ConfigError(f"batch-size range {low}-{high}: k={k} is not in [0, γ]")

    def arm_for(self, batch_size: int) -> Arm:
        """The arm a request joining a batch of ``batch_size`` (itself included) gets."""
        for low, high, k in self.per_batch_size:
            if low <= batch_size <= high:
                return Arm(self.proposer, k) if k > 0 else OFF
        return Arm(self.proposer, self.gamma)

    def __str__(self) -> str:
        if self.proposer is None:
            return "off"
        text = f"{self.proposer}:{self.gamma}"
        if self.per_batch_size:
            text += "@" + ",".join(f"{lo}-{hi}={k}" for lo, hi, k in self.per_batch_size)
        return text

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """Inverse of ``str()``: ``off``, ``ngram:4`` or ``eagle3:5@1-4=5,5-16=3,17-1024=0``."""
        head, _, table = text.strip().partition("@")
        try:
            arm = Arm.parse(head)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        ranges: list[tuple[int, int, int]] = []
        for part in filter(None, (p.strip() for p in table.split(","))):
            match = re.fullmatch(r"(\d+)-(\d+)=(\d+)", part)
            if match is None:
                raise ConfigError(f"batch-size range {part!r} is not FIRST-LAST=K")
            low, high, k = (int(g) for g in match.groups())
            ranges.append((low, high, k))
        return cls(arm.proposer, arm.gamma, tuple(ranges))

    @classmethod
    def from_vllm(cls, config: Mapping[str, Any] | None) -> SpecConfig:
        """From vLLM's ``--speculative-config`` JSON (None: no speculation)."""
        if not config:
            return cls(None)
        method = config.get("method")
        gamma = config.get("num_speculative_tokens")
        if not isinstance(method, str) or not isinstance(gamma, int):
            raise ConfigError("speculative config needs 'method' and 'num_speculative_tokens'")
        table = config.get("num_speculative_tokens_per_batch_size") or []
        try:
            ranges = tuple((int(lo), int(hi), int(k)) for lo, hi, k in table)
        except (TypeError, ValueError):
            raise ConfigError(
                "num_speculative_tokens_per_batch_size: expected [[first, last, k], ...]"
            ) from None
        return cls(VLLM_METHOD_ALIASES.get(method, method), gamma, ranges)

    def to_vllm(self) -> dict[str, Any] | None:
        """The ``--speculative-config`` JSON a real vLLM would be started with."""
        if self.proposer is None:
            return None
        config: dict[str, Any] = {"method": self.proposer, "num_speculative_tokens": self.gamma}
        if self.per_batch_size:
            config["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.per_batch_size]
        return config

    def check_against(self, scenario: Scenario) -> None:
        """Raise :class:`ConfigError` unless the scenario knows this proposer."""
        if self.proposer is not None and self.proposer not in scenario.proposers:
            known = ", ".join(sorted(scenario.proposers))
            raise ConfigError(f"unknown proposer {self.proposer!r} (scenario has: {known})")


class RequestDrawer:
    """A request's simulated content: class, length and acceptance, drawn per request.

    Unlike :class:`simulator.engine.Traffic` (which replays the same traffic for every
    policy), a server does not know the stream a request belongs to, so it draws from
    its own seeded generator; the distributions are the same: α per proposer from
    Beta(κα, κ(1-α)) around the class mean in force at that time, the length uniform in
    ``output_tokens × [1 ± spread]``.
    """

    def __init__(self, scenario: Scenario, rng: np.random.Generator) -> None:
        self._scenario = scenario
        self._rng = rng
        self._classes = list(scenario.classes)
        shares = np.array([scenario.classes[c].share for c in self._classes])
        self._shares = shares / shares.sum()
        self._next_id = 0

    def pick_class(self) -> str:
        """A class drawn from the scenario's mix."""
        return self._classes[int(self._rng.choice(len(self._classes), p=self._shares))]

    def draw(self, workload_class: str, max_tokens: int | None, t: float) -> SimRequest:
        """A request of ``workload_class`` issued at simulated time ``t``.

        Its natural length (where it would stop) is drawn; ``max_tokens`` caps it.
        """
        scenario = self._scenario
        spec = scenario.classes[workload_class]
        spread = spec.output_spread * (2.0 * self._rng.random() - 1.0)
        natural = max(2, int(spec.output_tokens * (1.0 + spread) + 0.5))
        length = natural if max_tokens is None else max(1, min(natural, max_tokens))
        kappa = scenario.model.acceptance_concentration
        alpha: dict[str, float] = {}
        for proposer in sorted(scenario.proposers):
            mean = scenario.acceptance_at(workload_class, proposer, t)
            if 0.0 < mean < 1.0:
                alpha[proposer] = float(self._rng.beta(kappa * mean, kappa * (1.0 - mean)))
            else:
                alpha[proposer] = mean
        self._next_id += 1
        return SimRequest(self._next_id, 0, workload_class, length, alpha, self._rng.random(length))


def _driver_ended(task: asyncio.Task[None]) -> None:
    """A driver that fails leaves its instance answering nothing: say why, once."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("simulated instance stopped serving", exc_info=task.exception())


_CODE_MARKERS = re.compile(r"```|\bdef |\bclass |\breturn\b|;\s*$|\bimport |=>|\{\s*$", re.M)
_JSON_MARKERS = re.compile(r"\bjson\b|^\s*[\[{]\s*\"", re.I | re.M)


def guess_class(prompt: str, classes: Sequence[str]) -> str | None:
    """A cheap stand-in for the trained classifier: code or JSON markers in the prompt
    pick a class of that name when the scenario has one; otherwise None (the caller
    draws from the class mix)."""
    if "code" in classes and _CODE_MARKERS.search(prompt):
        return "code"
    if _JSON_MARKERS.search(prompt):
        for name in ("json", "structured"):
            if name in classes:
                return name
    return None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Tokens one engine step emitted for one request (a stream sends one chunk)."""

    tokens: int


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Everything a response reports about a finished request; times in simulated s."""

    observation: RequestObservation
    """The engine's own observation (acceptance, TTFT from admission, generation)."""
    arm: Arm
    queue_s: float
    """From arrival to joining the batch."""
    prompt_tokens: int
    finish_reason: str
    per_step_accepted: tuple[int, ...]
    """Draft tokens accepted at each step (empty when speculation was off)."""

    @property
    def ttft_s(self) -> float:
        """Arrival to first token, as vLLM reports it (queueing included)."""
        return self.queue_s + (self.observation.ttft_s or 0.0)

    @property
    def generation_s(self) -> float:
        return self.observation.generation_time_s or 0.0


class InstanceDown(RuntimeError):
    """The instance is restarting (or stopped) and serves nothing."""


@dataclass(frozen=True, slots=True)
class Aborted:
    """The request was dropped (the instance restarted under it)."""

    reason: str


Event = StepOutput | FinishedRequest | Aborted


@dataclass(slots=True, eq=False)
class Ticket:
    """A submitted request; its events (steps, then the finish) arrive on ``events``."""

    request: SimRequest
    arrival: float
    prompt_tokens: int
    max_tokens: int | None
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)

    @property
    def finish_reason(self) -> str:
        """``length`` when ``max_tokens`` cut the request short, else ``stop``."""
        cut = self.max_tokens is not None and self.request.output_tokens >= self.max_tokens
        return "length" if cut else "stop"


@dataclass(slots=True, eq=False)
class _Active:
    ticket: Ticket
    arm: Arm
    plan: Plan
    accepted: npt.NDArray[np.int64]
    """Draft tokens accepted per step."""
    admitted_at: float
    start_step: int
    delivered: int = 0


def _accepted_per_step(plan: Plan, arm: Arm) -> npt.NDArray[np.int64]:
    """Per-step accepted drafts of a plan, consistent with ``plan.accepted``.

    Emitted tokens per step are accepted + 1, except that the last step is cut to the
    request's length; the engine counts that step's drafts as accepted all the same,
    and so do the counters, so the last entry is what the total leaves.
    """
    if arm.proposer is None:
        return np.zeros(plan.steps, dtype=np.int64)
    emitted = np.diff(plan.cumulative(), prepend=0)
    accepted: npt.NDArray[np.int64] = (emitted - 1).astype(np.int64)
    accepted[-1] = plan.accepted - int(accepted[:-1].sum())
    return accepted


class SimInstance:
    """One simulated vLLM server process (one GPU): an engine, a config, its metrics.

    ``start`` launches the driver task in the running loop; ``submit`` enqueues a
    request; ``restart`` drops everything in flight and comes back with fresh counters,
    a new ``process_start_time_seconds`` and optionally a new config.
    """

    def __init__(
        self,
        scenario: Scenario,
        config: SpecConfig,
        *,
        rng: np.random.Generator,
        epoch: float,
        speed: float = 1.0,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
        tick_s: float = 0.01,
        max_num_seqs: int = 256,
        kv_cache_tokens: int = 262_144,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        config.check_against(scenario)
        self.scenario = scenario
        self.model_name = scenario.model.name
        self.speed = speed
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self._epoch = epoch
        self._clock = clock
        self._wall_clock = wall_clock
        self._tick_sim = tick_s * speed
        self._drawer = RequestDrawer(scenario, rng)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._down = False
        self.restarts = 0
        self._reset(config)

    # -- state ---------------------------------------------------------------------

    def _reset(self, config: SpecConfig) -> None:
        self.config = config
        self.started_at = self._wall_clock()
        self._engine = Engine(
            self.scenario.cost, self.model_name, self.scenario.model.position_decay
        )
        self._engine.now = self.sim_now()
        self._active: dict[int, _Active] = {}
        self._waiting: deque[Ticket] = deque()
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = VllmMetrics(
            self.model_name,
            spec_positions=config.gamma,
            started_at=self.started_at,
            gauges=self._gauges,
        )
        self.registry.register(self.metrics)

    def sim_now(self) -> float:
        """Simulated seconds since the fleet's epoch."""
        return (self._clock() - self._epoch) * self.speed

    @property
    def drawer(self) -> RequestDrawer:
        return self._drawer

    @property
    def is_up(self) -> bool:
        return not self._down and self._task is not None

    @property
    def running(self) -> int:
        return self._engine.in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _gauges(self) -> tuple[int, int, float]:
        in_kv = 0
        steps_run = self._engine.steps_run
        for active in self._active.values():
            done = min(steps_run - active.start_step, active.plan.steps)
            emitted = active.plan.emitted_after(done) if done > 0 else 0
            in_kv += active.ticket.prompt_tokens + emitted
        return self.running, self.waiting, min(1.0, in_kv / self.kv_cache_tokens)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start driving the engine in the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive())
            self._task.add_done_callback(_driver_ended)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._abort_all("server stopped")

    async def restart(self, config: SpecConfig | None = None, downtime_s: float = 0.0) -> None:
        """Restart as a new process: in-flight requests are aborted, counters reset.

        ``downtime_s`` (simulated) is how long the instance serves nothing, like a real
        server loading weights; /health fails meanwhile.
        """
        new_config = config if config is not None else self.config
        new_config.check_against(self.scenario)
        self._down = True
        self._abort_all("instance restarted")
        self.restarts += 1
        if downtime_s > 0:
            await asyncio.sleep(downtime_s / self.speed)
        self._reset(new_config)
        self._down = False
        self._wake.set()

    def _abort_all(self, reason: str) -> None:
        for active in self._active.values():
            active.ticket.events.put_nowait(Aborted(reason))
        for ticket in self._waiting:
            ticket.events.put_nowait(Aborted(reason))
        self._active.clear()
        self._waiting.clear()

    # -- requests ------------------------------------------------------------------

    def submit(self, workload_class: str, prompt_tokens: int, max_tokens: int | None) -> Ticket:
        """Queue a request of a scenario class; it joins the batch at the next step."""
        if not self.is_up:
            raise InstanceDown("instance is not serving")
        if workload_class not in self.scenario.classes:
            raise KeyError(workload_class)
        now = self.sim_now()
        request = self._drawer.draw(workload_class, max_tokens, now)
        ticket = Ticket(request, now, prompt_tokens, max_tokens)
        self._waiting.append(ticket)
        self.metrics.on_arrival(prompt_tokens, max_tokens)
        self._wake.set()
        return ticket

    def _admit(self) -> None:
        engine = self._engine
        while self._waiting and engine.in_flight < self.max_num_seqs:
            ticket = self._waiting[0]
            if ticket.arrival > engine.now:
                break
            self._waiting.popleft()
            arm = self.config.arm_for(engine.in_flight + 1)
            plan = plan_request(ticket.request, arm, engine.position_decay)
            engine.add(ticket.request, arm)
            self._active[ticket.request.request_id] = _Active(
                ticket, arm, plan, _accepted_per_step(plan, arm), engine.now, engine.steps_run
            )

    # -- the driver ----------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            if self._down or (not self._engine.in_flight and not self._waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            engine = self._engine
            now = self.sim_now()
            if not engine.in_flight:
                # Idle: the clock jumps to the first arrival, not to when this task woke
                # up, so host scheduling delays (× speed) do not show as queueing.
                engine.advance(self._waiting[0].arrival if self._waiting else now)
            self._admit()  # an idle engine admits at least the first arrival
            t0, step = engine.now, engine.step_time()
            completions = engine.advance(max(now, t0) + self._tick_sim)
            deliveries = [
                (
                    active,
                    active.delivered,
                    min(engine.steps_run - active.start_step, active.plan.steps),
                )
                for active in self._active.values()
            ]
            delay = engine.now / self.speed - (self._clock() - self._epoch)
            if delay > 0:
                await asyncio.sleep(delay)
            if engine is not self._engine or self._down:
                continue  # restarted while asleep: those steps never happened
            self._publish(deliveries, completions, t0, step)

    def _publish(
        self,
        deliveries: list[tuple[_Active, int, int]],
        completions: list[Completion],
        t0: float,
        step: float,
    ) -> None:
        metrics = self.metrics
        for active, start, end in deliveries:
            if end <= start:
                continue
            if start == 0:
                # Joined at t0, so its first token came at the end of this chunk's first step.
                metrics.observe_ttft(t0 + step - active.ticket.arrival)
            metrics.observe_steps(
                itl_s=step,
                itl_count=end - start - (1 if start == 0 else 0),
                gamma=active.arm.gamma,
                accepted=active.accepted[start:end],
            )
            emitted = active.plan.cumulative()
            first = previous = int(emitted[start - 1]) if start > 0 else 0
            for index in range(start, end):
                active.ticket.events.put_nowait(StepOutput(int(emitted[index]) - previous))
                previous = int(emitted[index])
            metrics.add_generation_tokens(previous - first)
            active.delivered = end
        for completion in completions:
            active = self._active.pop(completion.request.request_id)
            ticket = active.ticket
            observation = completion.observation
            finished = FinishedRequest(
                observation=observation,
                arm=active.arm,
                queue_s=max(0.0, active.admitted_at - ticket.arrival),
                prompt_tokens=ticket.prompt_tokens,
                finish_reason=ticket.finish_reason,
                per_step_accepted=(
                    tuple(int(a) for a in active.accepted) if active.arm.proposer else ()
                ),
            )
            finished_at = observation.finished_at if observation.finished_at is not None else t0
            metrics.on_finish(finished, e2e_s=finished_at - ticket.arrival)
            ticket.events.put_nowait(finished)
