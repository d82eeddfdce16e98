"""Reading vLLM's per-request figures into a ``RequestObservation``.

Parsing belongs to ``collectors.per_request`` (another branch); until that lands here,
:func:`observation_from_response` is the one place the gateway reads a response, with
the same signature, so the swap is one import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from collectors.observations import RequestObservation, SpecDecodeRequestStats

ObservationSink = Callable[[RequestObservation], None]
"""Receives every finished request (the policy's feed). Called in the event loop, so it
must be quick and must not block: queue the observation if the work is heavy."""


def observation_from_response(body: Mapping[str, Any]) -> RequestObservation:
    """A non-streaming response body, or a stream's final usage chunk, parsed.

    Minimal on purpose: missing or mistyped fields read as None, never an exception (a
    user's request must not fail over the gateway's bookkeeping).
    """
    usage = body.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    metrics = body.get("metrics")
    metrics = metrics if isinstance(metrics, Mapping) else {}
    spec = metrics.get("speculative_decoding")
    model = body.get("model")
    return RequestObservation(
        model=model if isinstance(model, str) else None,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        output_tokens=_count(usage.get("completion_tokens")),
        ttft_s=_seconds(metrics.get("time_to_first_token_ms")),
        mean_itl_s=_seconds(metrics.get("mean_itl_ms")),
        generation_time_s=_seconds(metrics.get("generation_time_ms")),
        spec=SpecDecodeRequestStats(
            num_drafts=_count(spec.get("num_spec_steps")),
            num_draft_tokens=_count(spec.get("num_draft_tokens")),
            num_accepted_tokens=_count(spec.get("num_accepted_draft_tokens")),
        )
        if isinstance(spec, Mapping)
        else None,
    )


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _seconds(milliseconds: object) -> float | None:
    if isinstance(milliseconds, int | float) and not isinstance(milliseconds, bool):
        return float(milliseconds) / 1000.0
    return None
