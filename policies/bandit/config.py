"""Configuration and decisions of specpilot's bandit: its tuning, the decisions it
hands out, operator overrides, and the constants every part shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.arms import Arm, ConcurrencyBuckets, Context
from policies.fleet import FloatArray, Topology

DEFAULT_MODEL = "default"
DEFAULT_CLASS = "default"
WILDCARD = "*"


def _quantile(values: FloatArray, q: float) -> float:
    """Linear-interpolated quantile of a small sample (``np.quantile`` costs 50× more)."""
    ordered = np.sort(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


DRAFT_COST_PRIOR = 0.05
"""The ``draft_cost_prior`` of an engine whose first step times all come from one arm:
one running one config at a time (push mode), or one engine serving every arm whose
classes all start on the cold proposer (``cold_proposer`` in the shared topology, as
``bench policy`` runs it). Step times of one arm cannot split drafting from the plain
step; without a prior the ridge splits them by minimum norm and calls drafting most of
the step, so the first plans flee the proposer that works. At 0.05 a verify step of
γ = 4 costs 1.2 plain steps: a proposer whose acceptance collapses (about one token per
step) is predicted to lose, a healthy one (three tokens per step) is not mistaken for a
loss. Evidence with contrast (another γ, another proposer, or off in the same engine)
outweighs it. Not the default: where pools run one arm each (routing), off's pool gives
the plain step, and in the replay of a gateway's observations
(tests/policies/test_policy_gateway_observations.py) the prior left n-gram off after 60
requests in 5 of 30 seeds, against 3 without."""


@dataclass(frozen=True, slots=True)
class ArmFit:
    """The arms a saved state is loaded for, and whether they are those it was saved
    for: where not, each part keeps only what still holds (see ``load_state``)."""

    arms: frozenset[str]
    proposers: tuple[str, ...]
    same: bool

    def valid(self, arm: str) -> bool:
        return arm in self.arms


@dataclass(frozen=True, slots=True)
class BanditConfig:
    """Tuning of the bandit; times in seconds of the injected clock."""

    buckets: ConcurrencyBuckets = field(default_factory=ConcurrencyBuckets)
    half_life_s: float = 1800.0
    """Evidence loses half its weight in this time."""
    dwell_s: float = 60.0
    """A context keeps a committed arm at least this long (unless turning off)."""
    hysteresis: float = 0.02
    """A new arm replaces a committed one when predicted to raise the bucket's goodput
    by this much (relative), or its class's own speed-up by this much without lowering
    the bucket's goodput."""
    explore_cap: float = 0.08
    """At most this share of requests is served by an arm other than the committed one."""
    guard_quantile: float = 0.1
    """A class speculates only if this posterior quantile of its goodput effect is >= 1."""
    posterior_draws: int = 16
    refresh_observations: int = 40
    """Re-plan a bucket after this many new observations of its model…"""
    refresh_s: float = 60.0
    """…or after this long, whichever comes first."""
    probe_every: int = 25
    """Serve a class with an unused proposer (its smallest γ) after this many of the
    class's requests went by without it, so drifts of idle proposers get noticed."""
    probe_budget: float = 0.0
    """Share of goodput probes may cost on average. A probe is priced when its bucket
    is planned, by what it is predicted to cost the batch the plan expects while it
    runs (see ``Exploration.probe_cost``); one that pays for itself runs every
    ``probe_every`` requests of its class. Each admitted request earns its class's
    probes ``probe_budget / n`` (n sequences in flight: one request is about 1/n of
    the batch's work while it runs), and a costly probe takes as large a share of the
    class's requests as that pays for. Per class, because a drift is caught within so
    many requests of its class: a rare class earns as much per request as a frequent
    one. 0 by default: probing only where it pays keeps every goodput ratio
    of ``bench policy``, while catching the drift of a proposer nobody uses at high
    load within 200 requests of its class can cost more than 2 % of goodput there
    (e.g. one EAGLE-3 probe costs a 24-stream batch about 4 % while it runs)."""
    probe_burst: float = 4.0
    """A probe costing more than what this many requests of a full batch earn
    (``probe_budget × probe_burst``) never runs: one probe may cost at most a few
    requests' worth of the batch's time."""
    first_probes: float = 0.5
    """A class × proposer whose acceptance rests on fewer (discounted) requests than
    this (none yet, or one that has aged a half-life) is probed on
    ``first_probe_share`` of the class's requests, even where the probe is priced as a
    cost (up to ``first_probe_max_cost``): until the proposer ran for the class, that
    price is the prior's guess at its acceptance (0.5), and a proposer that suits the
    class (an EAGLE head at 0.87 where n-gram gets 0.77) would otherwise never be seen
    at all. One request's per-position counts already place its acceptance (they
    count as up to ``trials_per_request`` trials); asking for two made the first
    minutes cost more than the second request told (0.963 of the oracle on average
    over the bound check's scenarios against 0.966)."""
    first_probe_share: float = 0.5
    """The share of a class's requests such first probes take (within the exploration
    cap) until their evidence is in: many, since a request's evidence arrives only when
    it finishes, and every request served meanwhile is served on the prior's guess."""
    first_probe_max_cost: float = 0.5
    """The most such a first probe may be predicted to cost its engine's goodput
    while it runs (a share, as ``probe_budget``'s prices)."""
    explore_max_loss: float = 0.01
    """Exploring a class's Thompson arm (on the share of its requests the cap lets
    explore) may cost the bucket at most this much goodput where the knee is lowest."""
    trial_max_loss: float = 0.1
    """A knee trial (see ``SpecPilotPolicy._start_trial``) runs only if, should the
    knee sit right at the edge of the batches seen so far, the trial's assignment
    costs the bucket at most this much goodput while it lasts."""
    trials_per_request: float = 20.0
    min_evidence_requests: float = 8.0
    """Dwell and hysteresis only hold arms whose class × proposer acceptance rests on at
    least this many (discounted) requests."""
    moves_need_evidence: bool = False
    """True where a decision takes effect by pushing a config to the fleet (a restart,
    a rollout) rather than by routing one request: a context then starts on the arm
    its pool runs (``decide(context, running=...)``), keeps it while that arm has no
    evidence of its own, moves only to an arm whose class × proposer acceptance has
    evidence (or off), and only when the move surely pays: the ``guard_quantile`` of
    the bucket's goodput ratio, new over old, over posterior draws, is at least 1."""
    push_probe_s: float = 300.0
    """Push mode (``moves_need_evidence``): how long a context on off runs a probe of
    speculation (its most promising proposer's smallest γ) before the evidence it
    gathered decides (``policies.bandit.offprobe``): minutes, since each push restarts
    or rolls its pool and the evidence arrives in scrape windows."""
    push_probe_every_s: float = 1800.0
    """Push mode: a context on off probes at most this often (one evidence half-life by
    default)…"""
    push_probe_budget: float = 0.02
    """…and as much less often as keeps its probes' predicted cost within this share of
    its goodput on average."""
    push_probe_max_cost: float = 0.5
    """Push mode: a probe predicted to cost more than this share of its context's
    goodput while it runs never starts."""
    draft_cost_prior: float | None = None
    """Drafting cost per draft position as a share of a plain step, the prior of
    :class:`StepCostModel` (None: none); see ``DRAFT_COST_PRIOR`` for where it is
    needed."""
    cold_proposer: str | None = None
    """A model-free proposer (n-gram: a lookup in the prompt, no draft model on the
    accelerator) that a class's requests use, at its smallest γ, before the class has
    a plan in their bucket, where ``cold_max_positions`` allows; None: off. Off is what
    the first requests would cost at most; this is what they cost at most where
    nothing is known yet but the batch is small: a verify step of a few positions per
    sequence costs what a plain one does, and the drafting is a CPU lookup, while a
    class that suits n-gram gains at once (``bench policy --bound-check`` compares)."""
    cold_max_positions: int = 48
    """Where ``cold_proposer`` may serve a class that has no plan yet: where the
    bucket's most concurrent requests, each verifying γ + 1 positions a step, verify at
    most this many per step (48: 1 to 15 streams at γ = 2; the open bucket never).
    Decode stays memory-bound up to a few dozen tokens per step on the accelerators
    vLLM serves (each step reads every weight once, and even a small GPU does tens of
    multiply-adds per byte it reads), so the verify step costs what a plain one does
    there, while a blind start off costs a class that copies from its prompt its whole
    first round of requests (holdout-stationary-505, 8 streams: 0.96 of the best
    static config with 32, 0.99 with 48). Past the knee a class with n-gram acceptance
    near zero slows its batch; the evidence check in ``SpecPilotPolicy._cold_arm``
    keeps such a class off in buckets it enters later."""
    topology: Topology = "shared"
    """``shared``: a model's arms share one batch (one engine serves every config, as in
    the simulator's fast mode). ``per_arm``: each arm runs in its own engine (routing
    mode: a pool per speculative config), so a request's step time depends only on the
    requests in its own pool and streams split between pools."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """What one arm would do for a class in a bucket: its per-token speed-up over the
    class running without speculation (off is 1 by definition), at the bucket's
    concurrency with the other classes as served; the posterior median and its 10–90 %
    range over the plan's draws of acceptance and step cost."""

    speedup: float
    interval: tuple[float, float]


@dataclass(frozen=True, slots=True)
class Decision:
    """An arm for a context and why.

    ``predicted_speedup`` is the class's per-token speed-up over no speculation at the
    bucket's concurrency; ``interval`` its posterior 10–90 % range (see
    :class:`Prediction`). ``explored`` is
    True when this request is served by an arm other than the committed one.
    """

    context: Context
    arm: Arm
    reason: str
    """A word of the vocabulary (:class:`policies.reasons.Reason`)."""
    predicted_speedup: float | None = None
    interval: tuple[float, float] | None = None
    explored: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    """How one context's requests are served until its bucket is planned again: plain,
    picklable data (see ``SpecPilotPolicy.routes``), so that a process of its own can
    route from it.

    ``arm`` (with ``reason``, ``speedup`` and ``interval`` as in :class:`Decision`)
    serves every request but those ``explore`` sends elsewhere: each entry ``(arm,
    share, reason)`` takes up to that share of the context's requests, ``reason``
    saying why: ``explore`` (the Thompson arm, share 1: as many as the cap allows),
    ``probe`` (a proposer the class does not use) or ``trial`` (the bucket's knee
    trial: share 1, while it runs). Exploring requests other than a trial's take turns
    only while the moving share of exploring requests is below
    ``BanditConfig.explore_cap``; an override explores nothing."""

    arm: Arm
    reason: str
    speedup: float | None = None
    interval: tuple[float, float] | None = None
    explore: tuple[tuple[Arm, float, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Override:
    """Operator override: every context matching the scope is served with ``arm``."""

    model: str
    workload_class: str
    bucket: str
    arm: Arm

    def matches(self, context: Context) -> bool:
        return all(
            pattern in (WILDCARD, value)
            for pattern, value in (
                (self.model, context.model),
                (self.workload_class, context.workload_class),
                (self.bucket, context.bucket),
            )
        )

    @property
    def specificity(self) -> int:
        return sum(p != WILDCARD for p in (self.model, self.workload_class, self.bucket))


class Overrides:
    """Operator overrides by scope; the most specific scope wins, later entries ties."""

    def __init__(self) -> None:
        self.entries: list[Override] = []

    def set(self, override: Override) -> None:
        self.clear(override.model, override.workload_class, override.bucket)
        self.entries.append(override)

    def clear(self, model: str, workload_class: str, bucket: str) -> bool:
        before = len(self.entries)
        self.entries = [
            o
            for o in self.entries
            if (o.model, o.workload_class, o.bucket) != (model, workload_class, bucket)
        ]
        return len(self.entries) != before

    def for_context(self, context: Context) -> Override | None:
        best: Override | None = None
        for override in self.entries:  # later entries win ties
            if override.matches(context) and (
                best is None or override.specificity >= best.specificity
            ):
                best = override
        return best

    def to_state(self) -> list[list[str]]:
        return [[o.model, o.workload_class, o.bucket, str(o.arm)] for o in self.entries]

    def load_state(self, state: list[list[str]], fit: ArmFit) -> None:
        self.entries = [
            Override(o[0], o[1], o[2], Arm.parse(o[3]))
            for o in state
            if fit.same or fit.valid(o[3])
        ]
