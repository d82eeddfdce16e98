"""What one finished request tells specpilot: the unit the policy learns from.

The collectors fill the measured part from a vLLM response
(``metrics.speculative_decoding`` and timing, see ``collectors.per_request``); the
gateway adds the context it knows (workload class, pool, arm, concurrency). The
simulator produces the same type, so the policy cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SpecDecodeRequestStats:
    """Per-request speculative-decoding figures as vLLM reports them.

    Any field may be None when the server did not report it (older vLLM, summary
    mode, n > 1).
    """

    num_drafts: int | None
    """Verify steps that carried draft tokens."""
    num_draft_tokens: int | None
    """Draft tokens proposed (n-gram may propose fewer than γ per step)."""
    num_accepted_tokens: int | None
    """Draft tokens the target accepted."""
    accepted_per_position: tuple[int, ...] | None = None
    """Accepted tokens at draft position i (0 first), summed over the request's steps."""

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens, in [0, 1]; None when nothing was proposed."""
        if not self.num_draft_tokens or self.num_accepted_tokens is None:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: 1 + accepted / drafts; None without drafts."""
        if not self.num_drafts or self.num_accepted_tokens is None:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass(frozen=True, slots=True)
class RequestObservation:
    """One finished request: what was asked, how it was served, what it measured.

    Times are in seconds (base units); vLLM's ``*_ms`` fields are converted on read.
    """

    model: str | None
    prompt_tokens: int | None
    output_tokens: int | None
    ttft_s: float | None
    """Time to first token."""
    mean_itl_s: float | None
    """vLLM's per-request ``mean_itl_ms``: generation time over (output tokens − 1), a
    per-token mean (checked on the recorded responses). Unlike the histogram
    ``vllm:inter_token_latency_seconds``, which is observed once per engine step."""
    generation_time_s: float | None
    """From first to last output token."""
    spec: SpecDecodeRequestStats | None
    """None when speculation was off or not reported."""
    workload_class: str | None = None
    pool: str | None = None
    arm: str | None = None
    """The (proposer, γ) arm that served it, e.g. ``"ngram:4"`` or ``"off"``."""
    concurrency: int | None = None
    """Requests of the same model in flight when this one started (itself included):
    the count that placed it in its concurrency bucket, so that it is counted in the
    context it was routed in. A gateway counts every pool of the model."""
    finished_at: float | None = None
    """Seconds on the injected clock (wall clock in the service)."""
    e2e_s: float | None = None
    """Seconds from a gateway receiving the request to relaying its end: what the client
    waited, queueing and prefill included. None unless a gateway measured it."""
    routed_arm: str | None = None
    """The arm of the pool a gateway's routing sent it to. Where that pool had no
    instance able to take it, the gateway failed over to another pool of the model,
    whose arm ``arm`` is: a failover, not the policy's choice. None: no gateway."""
    instance: str | None = None
    """The instance that served it (its URL as ``/v1/fleet`` shows it, credentials
    redacted), where a gateway relayed it."""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: the figure the policy's reward uses."""
        if self.generation_time_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return self.generation_time_s / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (how a follower replica hands it over)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestObservation:
        """The inverse of :meth:`to_json`."""
        spec = data.get("spec")
        if spec is not None:
            positions = spec.get("accepted_per_position")
            positions = None if positions is None else tuple(positions)
            spec = SpecDecodeRequestStats(**{**spec, "accepted_per_position": positions})
        return cls(**{**data, "spec": spec})


@dataclass(frozen=True, slots=True)
class WindowObservation:
    """What one worker's ``/metrics`` window tells the policy about one served model:
    the same figures a request reports, summed over every request the window covers.

    Built by ``collectors.evidence.window_observation`` from a scraped or PromQL window;
    the controller adds what it knows of the worker (pool, the arm its config runs, the
    workload class the window is attributed to). Counts are increases over the window.
    """

    model: str
    started_at: float
    """Seconds on the injected clock: where the window's counters start."""
    finished_at: float
    duration_s: float
    requests: float
    """Requests that finished in the window (``vllm:e2e_request_latency_seconds_count``)."""
    generation_tokens: float
    """Output tokens generated (``vllm:generation_tokens_total``)."""
    drafts: float
    """Verify steps that carried drafts (``vllm:spec_decode_num_drafts_total``); 0: off."""
    draft_tokens: float
    accepted_per_position: tuple[float, ...]
    """``vllm:spec_decode_num_accepted_tokens_per_pos_total`` increases, position 0 first."""
    step_s: float | None
    """Mean time per engine step of a running request: ``vllm:inter_token_latency_seconds``
    sum over count (observed once per step and request, so it is a step time)."""
    tpot_s: float | None
    """Mean time per output token: ``vllm:request_time_per_output_token_seconds`` sum
    over count."""
    running: float | None
    """Mean of ``vllm:num_requests_running`` over the window's scrapes."""
    workload_class: str | None = None
    pool: str | None = None
    instance: str | None = None
    arm: str | None = None
    """The arm the worker's config runs, e.g. ``"ngram:4"`` or ``"off"``."""

    @property
    def accepted_tokens(self) -> float:
        return float(sum(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None when none were proposed."""
        if self.draft_tokens <= 0:
            return None
        return min(1.0, self.accepted_tokens / self.draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step: 1 + accepted / drafts; None without drafts."""
        if self.drafts <= 0:
            return None
        return 1.0 + self.accepted_tokens / self.drafts

    @property
    def steps(self) -> float:
        """Engine steps that emitted the window's tokens: each emits 1 + its accepted
        tokens, so ``generation - accepted`` (see ``policies.bandit.steps_taken``), never
        fewer than the drafted steps."""
        return max(self.drafts, self.generation_tokens - self.accepted_tokens)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (how a per-pod follower hands it over)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WindowObservation:
        """The inverse of :meth:`to_json`."""
        return cls(**{**data, "accepted_per_position": tuple(data["accepted_per_position"])})
