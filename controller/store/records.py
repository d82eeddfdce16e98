"""What the store keeps, as the rest of the controller sees it (frozen, ORM-free).

Times are seconds since the epoch; speed-ups are ratios of tokens per second
(> 1: faster than the previous arm / than no speculation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from controller.contexts import WILDCARD, Context

Actor = Literal["policy", "operator"]


@dataclass(frozen=True, slots=True)
class ObservationRecord:
    ts: float
    context: Context
    arm: str
    pool: str | None = None
    output_tokens: int | None = None
    tpot_s: float | None = None
    ttft_s: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


@dataclass(frozen=True, slots=True)
class WindowStatRecord:
    """One instance's window from its /metrics (collector's figures, reduced)."""

    ts: float
    pool: str
    instance: str
    model: str
    window_s: float
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    tpot_p50_s: float | None = None
    requests_running: float | None = None
    healthy: bool = True
    """Scraped within the scraper's ``stale_after_s`` and the window was usable."""
    workload_class: str | None = None
    """The class the window was attributed to (its pool's primary class)."""
    bucket: str | None = None
    arm: str | None = None
    """The arm the instance ran in the window, as its metrics show it."""
    requests: float | None = None
    """Requests that finished in the window."""
    generation_tokens: float | None = None
    tpot_mean_s: float | None = None
    status: str | None = None
    """One line on why the window is not evidence (stale, restarted, idle, failing)."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """What the policy predicted for one arm a context could run when it decided: its
    speed-up over the context without speculation (off is 1) and the 10–90 % range."""

    arm: str
    predicted_speedup: float
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    ts: float
    context: Context
    arm: str
    previous_arm: str | None
    reason: str
    """A word of the vocabulary (``policies.reasons.Reason``)."""
    actor: Actor
    predicted_speedup: float | None = None
    measured_speedup: float | None = None
    id: int | None = None
    detail: str = ""
    """The reason's figures and circumstances, for a person."""
    alternatives: tuple[Alternative, ...] = ()
    """Every arm the context could run, as the policy predicted it then."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Which contexts an override covers; ``"*"`` matches any value."""

    model: str = WILDCARD
    workload_class: str = WILDCARD
    bucket: str = WILDCARD

    def matches(self, context: Context) -> bool:
        return all(
            want in (WILDCARD, have)
            for want, have in (
                (self.model, context.model),
                (self.workload_class, context.workload_class),
                (self.bucket, context.bucket),
            )
        )

    @property
    def specificity(self) -> int:
        """How many fields are pinned: a narrower override wins over a broader one."""
        return sum(v != WILDCARD for v in (self.model, self.workload_class, self.bucket))


@dataclass(frozen=True, slots=True)
class OverrideRecord:
    id: str
    created_at: float
    expires_at: float
    scope: Scope
    config: dict[str, Any]
    reason: str
    deleted_at: float | None = None

    def active(self, now: float) -> bool:
        return self.deleted_at is None and now < self.expires_at


@dataclass(frozen=True, slots=True)
class AlertRecord:
    ts: float
    name: str
    severity: str
    message: str
    context: str | None = None
    resolved_at: float | None = None
    id: int | None = None


@dataclass(frozen=True, slots=True)
class StatsRow:
    """Observed figures for one (context, arm) over a window, from raw rows and roll-ups."""

    context: Context
    arm: str
    requests: int
    output_tokens: int
    mean_tpot_s: float | None
    mean_ttft_s: float | None
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    """Tokens emitted per verify step."""


LeaseOutcome = Literal["done", "failed", "expired", "abandoned"]
"""How a restart lease ended: the restart succeeded; it failed and was rolled back; its
replica stopped renewing it (died); its replica gave it up (shut down, or restarted
and found the lease of its previous life)."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One replica's restart of its pool's vLLM (per-pod topology)."""

    id: int
    pool: str
    replica: str
    config: str
    acquired_at: float
    expires_at: float
    released_at: float | None = None
    outcome: LeaseOutcome | None = None
    detail: str | None = None
    holds: bool = False

    def active(self, now: float) -> bool:
        return self.released_at is None and now < self.expires_at


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The answer to a request for a restart lease: ``lease`` when granted; else
    ``held`` (a failed restart of the same config holds the pool) or the ``holders``
    whose restarts fill ``max_unavailable``."""

    lease: LeaseRecord | None = None
    held: LeaseRecord | None = None
    holders: tuple[str, ...] = ()
