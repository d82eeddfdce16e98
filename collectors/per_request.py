"""Per-request figures from a vLLM response: ``metrics.speculative_decoding`` and timing.

vLLM 0.32 started with ``--enable-per-request-metrics`` (timing) and
``--per-request-spec-decode-metrics summary|detailed`` (acceptance) adds a ``metrics``
object to a completion or chat-completion response::

    "metrics": {"time_to_first_token_ms": 41.2, "generation_time_ms": 180.5,
                "queue_time_ms": 0.3, "mean_itl_ms": 2.9, "tokens_per_second": 280.1,
                "speculative_decoding": {"mean_acceptance_length": 2.0,
                    "draft_acceptance_rate": 0.25, "acceptance_histogram": [10, 4, 3, 2, 1],
                    "num_spec_steps": 20, "num_accepted_draft_tokens": 20,
                    "num_draft_tokens": 80, "num_spec_tokens": 4}}

When streaming, it rides only on the final usage chunk (``stream_options:
{"include_usage": true}``). With ``n > 1``, speculation off or an older vLLM the
fields are absent; every absent or malformed field reads as None, never an exception,
because a gateway must not fail a user's request over its own bookkeeping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from collectors.window import SpecDecodeWindow


def observation_from_response(body: Mapping[str, Any] | str | bytes) -> RequestObservation:
    """Read a non-streaming response body (parsed JSON or its text), or the final usage
    chunk of a stream (see ``final_usage_chunk``), into a ``RequestObservation``.

    vLLM's ``*_ms`` timings are converted to seconds. ``mean_itl_s`` is vLLM's
    ``mean_itl_ms``: decode time over (output tokens − 1), so with speculation it is a
    per-token average even though tokens arrive several per engine step.
    """
    document = _as_object(body)
    usage = _object(document.get("usage"))
    metrics = _object(document.get("metrics"))
    model = document.get("model")
    return RequestObservation(
        model=model if isinstance(model, str) else None,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        output_tokens=_count(usage.get("completion_tokens")),
        ttft_s=_seconds(metrics.get("time_to_first_token_ms")),
        mean_itl_s=_seconds(metrics.get("mean_itl_ms")),
        generation_time_s=_seconds(metrics.get("generation_time_ms")),
        spec=spec_stats(metrics.get("speculative_decoding")),
    )


def spec_stats(payload: object) -> SpecDecodeRequestStats | None:
    """``metrics.speculative_decoding`` → stats; None when absent or not an object.

    The accepted count at draft position i is the number of verify steps that accepted
    more than i draft tokens (acceptance is a prefix), read from
    ``acceptance_histogram`` (index j = steps that accepted exactly j drafts).
    """
    if not isinstance(payload, Mapping):
        return None
    histogram = payload.get("acceptance_histogram")
    per_position: tuple[int, ...] | None = None
    if isinstance(histogram, list) and histogram:
        steps = [_count(value) for value in histogram]
        if all(value is not None for value in steps):
            exact = [value for value in steps if value is not None]
            per_position = tuple(
                sum(exact[j] for j in range(i + 1, len(exact))) for i in range(len(exact) - 1)
            )
    return SpecDecodeRequestStats(
        num_drafts=_count(payload.get("num_spec_steps")),
        num_draft_tokens=_count(payload.get("num_draft_tokens")),
        num_accepted_tokens=_count(payload.get("num_accepted_draft_tokens")),
        accepted_per_position=per_position,
    )


def final_usage_chunk(lines: Iterable[str | bytes]) -> dict[str, Any] | None:
    """The last ``data:`` chunk of a server-sent-event stream that carries ``usage``
    (where vLLM puts the per-request metrics), parsed; None when the stream has none.

    ``lines`` are the stream's lines in order, with or without line endings; comments,
    ``[DONE]``, other fields and undecodable chunks are skipped.
    """
    found: dict[str, Any] | None = None
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            continue
        chunk = _as_object(data)
        if isinstance(chunk.get("usage"), Mapping):
            found = chunk
    return found


def observation_from_stream(lines: Iterable[str | bytes]) -> RequestObservation | None:
    """The observation of a streamed response; None when no usage chunk arrived (the
    client did not ask for ``stream_options.include_usage``)."""
    chunk = final_usage_chunk(lines)
    return None if chunk is None else observation_from_response(chunk)


def _as_object(body: Mapping[str, Any] | str | bytes) -> dict[str, Any]:
    if isinstance(body, Mapping):
        return dict(body)
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _object(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _count(value: object) -> int | None:
    # bool is an int subclass; a JSON true is not a count.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _seconds(milliseconds: object) -> float | None:
    if isinstance(milliseconds, bool) or not isinstance(milliseconds, int | float):
        return None
    if not math.isfinite(milliseconds) or milliseconds < 0:
        return None
    return float(milliseconds) / 1000.0


def summed_spec(observations: Iterable[RequestObservation]) -> SpecDecodeWindow | None:
    """Per-request spec-decode stats summed into the window type the counters give, so a
    set of requests (a workload class, a time window) reads like ``/metrics`` does; for
    the same requests the two agree exactly. Requests without spec stats are skipped;
    None when none has them."""
    specs = [o.spec for o in observations if o.spec is not None and o.spec.num_drafts is not None]
    if not specs:
        return None
    positions = [spec.accepted_per_position or () for spec in specs]
    return SpecDecodeWindow(
        drafts=float(sum(spec.num_drafts or 0 for spec in specs)),
        draft_tokens=float(sum(spec.num_draft_tokens or 0 for spec in specs)),
        accepted_tokens=float(sum(spec.num_accepted_tokens or 0 for spec in specs)),
        accepted_per_position=tuple(
            float(sum(counts[i] for counts in positions if i < len(counts)))
            for i in range(max(map(len, positions)))
        ),
    )
