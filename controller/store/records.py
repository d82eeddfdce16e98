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


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    ts: float
    context: Context
    arm: str
    previous_arm: str | None
    reason: str
    actor: Actor
    predicted_speedup: float | None = None
    measured_speedup: float | None = None
    id: int | None = None


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
