from __future__ import annotations

import json
from typing import Any

import pytest

from collectors.per_request import (
    final_usage_chunk,
    observation_from_response,
    observation_from_stream,
    spec_stats,
    summed_spec,
)

SPEC = {
    "mean_acceptance_length": 2.0,
    "draft_acceptance_rate": 0.25,
    "acceptance_histogram": [10, 4, 3, 2, 1],
    "num_spec_steps": 20,
    "num_accepted_draft_tokens": 20,
    "num_draft_tokens": 80,
    "num_spec_tokens": 4,
}
BODY: dict[str, Any] = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "tiny-llama",
    "choices": [{"index": 0, "text": "def f(x):", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 48, "total_tokens": 60},
    "metrics": {
        "time_to_first_token_ms": 41.5,
        "generation_time_ms": 188.0,
        "mean_itl_ms": 4.0,
        "speculative_decoding": SPEC,
    },
}


def test_non_streaming_body_gives_timing_in_seconds_and_spec_stats() -> None:
    observation = observation_from_response(json.dumps(BODY))
    assert observation.model == "tiny-llama"
    assert (observation.prompt_tokens, observation.output_tokens) == (12, 48)
    assert observation.ttft_s == pytest.approx(0.0415)
    assert observation.generation_time_s == pytest.approx(0.188)
    assert observation.mean_itl_s == pytest.approx(0.004)
    spec = observation.spec
    assert spec is not None
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (20, 80, 20)
    assert spec.acceptance_rate == pytest.approx(SPEC["draft_acceptance_rate"])
    assert spec.mean_acceptance_length == pytest.approx(SPEC["mean_acceptance_length"])


def test_per_position_counts_come_from_the_acceptance_histogram() -> None:
    spec = spec_stats(SPEC)
    assert spec is not None and spec.accepted_per_position is not None
    # Steps accepting more than i drafts: position 0 is accepted by 4+3+2+1 of them.
    assert spec.accepted_per_position == (10, 6, 3, 1)
    assert sum(spec.accepted_per_position) == SPEC["num_accepted_draft_tokens"]


@pytest.mark.parametrize(
    "metrics",
    [None, {}, {"time_to_first_token_ms": 3.0}, {"speculative_decoding": None}],
    ids=["n>1 or disabled", "empty", "timing only", "spec null"],
)
def test_missing_spec_metrics_give_none(metrics: dict[str, Any] | None) -> None:
    body = {key: value for key, value in BODY.items() if key != "metrics"}
    if metrics is not None:
        body["metrics"] = metrics
    observation = observation_from_response(body)
    assert observation.spec is None
    assert observation.output_tokens == 48


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe not json",
        "[1, 2]",
        "",
        {"usage": "lots", "metrics": {"mean_itl_ms": "fast", "generation_time_ms": -1}},
        {
            "metrics": {
                "speculative_decoding": {"num_spec_steps": True, "acceptance_histogram": ["x"]}
            }
        },
        {"metrics": {"time_to_first_token_ms": float("nan")}},
    ],
)
def test_malformed_bodies_give_none_fields_never_exceptions(body: Any) -> None:
    observation = observation_from_response(body)
    assert observation.ttft_s is None and observation.mean_itl_s is None
    assert observation.generation_time_s is None and observation.output_tokens is None
    assert observation.spec is None or observation.spec.num_drafts is None


def sse(*chunks: dict[str, Any]) -> list[str]:
    lines = []
    for chunk in chunks:
        lines += [f"data: {json.dumps(chunk)}", ""]
    return [*lines, "data: [DONE]", ""]


def test_stream_metrics_are_read_from_the_final_usage_chunk() -> None:
    delta = {"id": "c", "model": "tiny-llama", "choices": [{"index": 0, "text": "x"}]}
    final = {key: value for key, value in BODY.items() if key != "choices"} | {"choices": []}
    lines = sse(delta, delta, final)

    assert final_usage_chunk(lines) == final
    observation = observation_from_stream(line.encode() for line in lines)
    assert observation == observation_from_response(BODY)


def test_stream_without_usage_chunk_gives_no_observation() -> None:
    delta = {"id": "c", "model": "tiny-llama", "choices": [{"index": 0, "text": "x"}]}
    lines = [": keep-alive", *sse(delta), "data: {not json"]
    assert final_usage_chunk(lines) is None
    assert observation_from_stream(lines) is None


def test_summed_spec_adds_requests_and_skips_those_without_spec() -> None:
    with_spec = observation_from_response(BODY)
    no_spec = observation_from_response({"usage": {"completion_tokens": 5}})
    other = observation_from_response(
        BODY | {"metrics": {"speculative_decoding": SPEC | {"acceptance_histogram": [1, 1]}}}
    )
    total = summed_spec([with_spec, no_spec, other])
    assert total is not None
    assert (total.drafts, total.draft_tokens, total.accepted_tokens) == (40, 160, 40)
    assert total.accepted_per_position == (10 + 1, 6, 3, 1)
    assert summed_spec([no_spec]) is None
