"""Request and response bodies of the REST API (they make the published OpenAPI).

Times are seconds since the epoch; speed-ups are ratios of tokens per second over no
speculation; acceptance is a 0-1 ratio.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# No NUL: PostgreSQL text cannot hold it, and no name or reason needs it.
Text = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00]*$")]
LongText = Annotated[str, StringConstraints(min_length=1, max_length=2000, pattern=r"^[^\x00]*$")]


class ScopeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: Text = "*"
    workload_class: Text = Field(default="*", alias="class")
    bucket: Text = "*"


class OverrideIn(BaseModel):
    """Pin a config (or ``{"method": "off"}``) for every context in ``scope``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "scope": {"model": "*", "class": "code", "bucket": "*"},
                    "config": {"method": "ngram", "num_speculative_tokens": 3},
                    "ttl_s": 600,
                    "reason": "incident 42",
                }
            ]
        },
    )

    scope: ScopeBody
    config: dict[str, Any]
    ttl_s: float = Field(gt=0, le=366 * 24 * 3600, allow_inf_nan=False)
    reason: LongText


class OverrideOut(BaseModel):
    id: str
    scope: ScopeBody
    config: dict[str, Any]
    arm: str | None
    """The arm the config means on the fleet; None if the fleet can no longer run it."""
    reason: str
    created_at: float
    expires_at: float


class OverrideList(BaseModel):
    overrides: list[OverrideOut]


class Interval(BaseModel):
    low: float
    high: float


class AlternativeOut(BaseModel):
    """What the policy predicted for one arm when it decided."""

    arm: str
    predicted_speedup: float
    """Speed-up over the context without speculation (off is 1)."""
    interval: Interval
    """Its 10–90 % posterior range."""


class DecisionOut(BaseModel):
    id: int
    ts: float
    model: str
    workload_class: str = Field(serialization_alias="class")
    bucket: str
    arm: str
    previous_arm: str | None
    reason: str
    """A word of README's "Decision reasons" (``policies.reasons.Reason``)."""
    detail: str
    """The reason's figures and circumstances."""
    actor: Literal["policy", "operator"]
    predicted_speedup: float | None
    measured_speedup: float | None
    alternatives: list[AlternativeOut]
    """Every arm the context could run, as the policy predicted it then."""


class AlertOut(BaseModel):
    id: int
    ts: float
    """Unix seconds when it was raised."""
    name: str
    """What kind, e.g. ``AcceptanceDrift`` or ``ActuatorFailed``."""
    severity: str
    message: str
    context: str | None
    resolved_at: float | None


class AlertListOut(BaseModel):
    alerts: list[AlertOut]
    """Newest first."""


class DecisionPageOut(BaseModel):
    decisions: list[DecisionOut]
    next_before: int | None
    """Pass as ``before`` to get the next (older) page; null on the last page."""


class AcceptanceEvidenceOut(BaseModel):
    """The counts vLLM reported over the evidence an acceptance was read from."""

    accepted_tokens: float
    draft_tokens: float
    since: float
    """Start of the first window or request counted (seconds since the epoch)."""
    until: float
    """End of the last one counted."""


class EstimateOut(BaseModel):
    arm: str
    acceptance: float | None
    """vLLM's acceptance of this arm for the context's model and class: accepted draft
    tokens over draft tokens, over its newest evidence of at least 500 draft tokens
    (``acceptance_evidence``). Null for off and while it has no drafted evidence."""
    acceptance_evidence: AcceptanceEvidenceOut | None = None
    drafted_nothing: bool | None = None
    """True while the newest evidence of this arm drafted nothing (n-gram found no
    match): there is no acceptance to measure, which is not acceptance 0. Null where
    the newest evidence of the class and proposer ran another arm, or there is none."""
    estimated_first_position_acceptance: float | None = None
    """The policy's model, not vLLM's figure: the share of decode steps (drafted or not)
    whose first draft token it expects accepted, which its speed-up estimate rests on."""
    estimated_first_position_acceptance_interval: Interval | None = None
    speedup: float | None
    speedup_interval: Interval | None
    observations: int


class ContextPolicyOut(BaseModel):
    model: str
    workload_class: str = Field(serialization_alias="class")
    bucket: str
    arm: str
    """The arm the context runs: in push mode as vLLM's metrics show its pool running;
    in routing mode the arm the gateway sends its requests to (the policy's committed
    arm, or an operator's pin), exploration aside."""
    decided_arm: str
    """The arm last decided for it (by the policy or an operator): in push mode, what
    was pushed, which differs from ``arm`` until the fleet runs it."""
    actor: Literal["policy", "operator"]
    changed_at: float | None
    """When the arm last changed; null if it never did under specpilot."""
    override_id: str | None
    estimate: EstimateOut | None
    """The policy's belief about the chosen arm."""
    estimates: list[EstimateOut]
    routed_requests: int | None = None
    """Routing mode, on the leader: the context's requests finished since its arm last
    changed (or since this replica started leading); null otherwise."""
    explored_share: float | None = None
    """Of ``routed_requests``, the share the routing table sent to another arm than
    ``arm`` (exploration, probes, knee trials); null without requests."""
    failover_share: float | None = None
    """Of ``routed_requests``, the share the gateway served on another pool than the
    routing table's because that pool could not take them (no instance up): failovers,
    not in ``explored_share``; null without requests."""


class PolicyOut(BaseModel):
    frozen: bool
    leader: bool
    contexts: list[ContextPolicyOut]


class FrozenOut(BaseModel):
    frozen: bool


class GatewayWindowOut(BaseModel):
    """What the gateway measured of the requests it relayed to one instance over the
    last ``window_s`` seconds (routing mode's evidence, ``controller.relayed``)."""

    window_s: float
    requests: int
    arm: str | None
    """The arm of the pool that served them."""
    output_tokens: int
    acceptance_rate: float | None
    """vLLM's acceptance over these requests: accepted over draft tokens (null: none
    drafted)."""
    mean_acceptance_length: float | None
    """Tokens emitted per verify step: 1 + accepted tokens / drafts."""
    mean_tpot_s: float | None
    """Time per output token after the first, as vLLM reported it, mean over requests."""
    mean_ttft_s: float | None
    mean_e2e_s: float | None
    """What the client waited, as the gateway measured it, mean over requests."""
    last_request_at: float


class InstanceOut(BaseModel):
    url: str
    """The instance's base URL, a password in it (or user info without one) as ``***``;
    in the per-pod topology with its pod's replica as the fragment (``#pod-a``)."""
    healthy: bool | None
    """From the newest window its metrics gave; null before the first."""
    last_window_at: float | None
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    """Tokens emitted per verify step in the newest window."""
    arm: str | None = None
    """The arm the instance ran in its newest window, as its metrics show it."""
    requests_running: float | None = None
    status: str | None = None
    """One line on why its newest window was no evidence (stale, failing scrape,
    restarted, idle); null when it was."""
    gateway: GatewayWindowOut | None = None
    """On the leader, where a gateway serves (routing mode): what the gateway measured
    of the requests it relayed to the instance lately; null when it relayed none."""


class PoolOut(BaseModel):
    name: str
    model: str
    classes: list[str]
    proposers: list[str]
    settings_config: dict[str, Any]
    """What the settings say the instances were started with."""
    running_config: dict[str, Any] | None
    """What the instances run as vLLM's metrics show it (null: no speculation): γ from
    their per-position series, off from no spec-decode series, the method from the
    managed actuator or the last push the evidence confirmed."""
    running_arm: str
    """``running_config`` as an arm (``unknown`` while its instances disagree)."""
    effective_config: dict[str, Any] | None
    """What specpilot wants them to run now (null: no speculation)."""
    pushed_arm: str | None = None
    """Push mode: the arm of the last config handed to the actuators; null before any."""
    push_state: Literal["confirmed", "pending", "not_applied"] | None = None
    """Push mode: ``confirmed`` once vLLM's metrics show the push running, ``pending``
    until then, ``not_applied`` after ``actuators.confirm_within_s`` without it."""
    pushed_at: float | None = None
    push_settled_at: float | None = None
    """When the push was confirmed or found not applied."""
    summary: str
    """One line: ``runs ngram:4`` or ``pushed ngram:2, running ngram:4 (not_applied)``."""
    instances: list[InstanceOut]


class FleetOut(BaseModel):
    leader: bool
    frozen: bool
    pools: list[PoolOut]


class StatsRowOut(BaseModel):
    model: str
    workload_class: str = Field(serialization_alias="class")
    bucket: str
    arm: str
    requests: int
    output_tokens: int
    acceptance_rate: float | None
    emitted_tokens_per_verify: float | None
    mean_tpot_s: float | None
    mean_ttft_s: float | None


class StatsOut(BaseModel):
    since: float
    window_s: float
    rows: list[StatsRowOut]


class HealthOut(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


class ErrorOut(BaseModel):
    detail: str
