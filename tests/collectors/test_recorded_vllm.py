"""The collectors on bytes recorded from real vLLM 0.32 servers (tests/fixtures/vllm-0.32).

Servers: ``ngram`` (γ=4), ``draft`` (draft model, γ=3), ``off``. Between each server's
``start`` and ``after`` pages it served 11 greedy requests: the 6 bodies in
``requests-<cfg>.jsonl``, ``completion-<cfg>.json``, ``chat-<cfg>.json``, the two
streamed completions of one prompt (with and without the usage chunk) and one streamed
chat. Every request's per-request metrics are recorded except the stream without usage,
which repeats the prompt of the stream with usage; greedy decoding makes it identical.
"""

from __future__ import annotations

import json

import pytest

from collectors.exposition import EngineKey, WorkerSnapshot, parse_exposition
from collectors.observations import RequestObservation
from collectors.per_request import (
    final_usage_chunk,
    observation_from_response,
    observation_from_stream,
    summed_spec,
)
from collectors.window import WindowStats, worker_window
from tests.collectors.pages import FIXTURES
from tests.collectors.test_cli import specpilot_metrics

ENGINE = EngineKey("tiny-llama", "0")
GAMMA = {"ngram": 4, "draft": 3}
REQUESTS_BETWEEN_PAGES = 11


def page(name: str) -> WorkerSnapshot:
    return parse_exposition((FIXTURES / f"metrics-{name}.txt").read_text())


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def window(config: str) -> WindowStats:
    return worker_window(page(f"{config}-start"), page(f"{config}-after")).total


def observations(config: str) -> list[RequestObservation]:
    """Per-request observations of every request between the start and after pages."""
    found = [observation_from_response(line) for line in lines(f"requests-{config}.jsonl")]
    found += [
        observation_from_response((FIXTURES / f"{kind}-{config}.json").read_text())
        for kind in ("completion", "chat")
    ]
    streamed = observation_from_stream(lines(f"completion-{config}-stream-usage.sse"))
    chat_streamed = observation_from_stream(lines(f"chat-{config}-stream-usage.sse"))
    assert streamed is not None and chat_streamed is not None
    found += [streamed, streamed, chat_streamed]  # the stream without usage repeats streamed
    assert len(found) == REQUESTS_BETWEEN_PAGES
    return found


def test_unmetered_stream_repeats_the_metered_one_token_for_token() -> None:
    def text(name: str) -> str:
        chunks = []
        for line in lines(name):
            if line.startswith("data: {"):
                chunks += [choice["text"] for choice in json.loads(line[6:])["choices"]]
        return "".join(chunks)

    for config in ("ngram", "draft", "off"):
        metered = text(f"completion-{config}-stream-usage.sse")
        assert metered and metered == text(f"completion-{config}-stream.sse")


@pytest.mark.parametrize("name", sorted(p.stem[8:] for p in FIXTURES.glob("metrics-*.txt")))
def test_every_recorded_page_parses(name: str) -> None:
    snapshot = page(name)
    assert list(snapshot.engines) == [ENGINE]
    assert snapshot.process_start_time_s is not None
    engine = snapshot.engines[ENGINE]
    config = name.split("-")[0]
    if config == "off":
        assert engine.spec is None
    else:
        assert engine.spec is not None
        assert len(engine.spec.accepted_per_position) == GAMMA[config]
    assert engine.inter_token_latency is not None and engine.time_per_output_token is not None
    assert engine.running is not None and engine.kv_cache_usage is not None


@pytest.mark.parametrize("config", ["ngram", "draft"])
def test_counter_window_equals_per_request_metrics_summed_over_the_same_requests(
    config: str,
) -> None:
    stats = window(config)
    requests = observations(config)
    assert all(request.spec is not None for request in requests)

    assert not stats.reset
    assert summed_spec(requests) == stats.spec
    assert stats.spec is not None and stats.spec.accepted_per_position
    assert stats.generation_tokens == sum(o.output_tokens or 0 for o in requests)


def test_ngram_proposes_fewer_tokens_than_gamma() -> None:
    spec = window("ngram").spec
    assert spec is not None and spec.mean_proposed_tokens_per_draft is not None
    assert 1.0 <= spec.mean_proposed_tokens_per_draft < GAMMA["ngram"]
    curve = [share for share in spec.per_position_acceptance if share is not None]
    assert curve == sorted(curve, reverse=True) and len(curve) == GAMMA["ngram"]
    assert all(0.0 <= p <= 1.0 for p in spec.conditional_acceptance if p is not None)


def test_inter_token_latency_is_observed_per_engine_step_not_per_token() -> None:
    off, ngram = window("off"), window("ngram")
    assert off.inter_token_latency is not None and ngram.inter_token_latency is not None
    # Without speculation every token after the first is one step.
    assert off.inter_token_latency.count == (off.generation_tokens or 0) - REQUESTS_BETWEEN_PAGES
    # With it, a step emits several tokens: far fewer observations than tokens.
    assert ngram.inter_token_latency.count < (ngram.generation_tokens or 0) - REQUESTS_BETWEEN_PAGES
    assert ngram.time_per_output_token is not None
    assert ngram.time_per_output_token.count == REQUESTS_BETWEEN_PAGES


def test_recorded_reset_pair_is_computed_from_the_new_process_only() -> None:
    before, restarted = page("ngram-after"), page("ngram-restarted")
    reset = worker_window(before, restarted)
    fresh = worker_window(None, restarted)
    assert reset.reset and not fresh.reset
    assert reset.total.spec == fresh.total.spec
    assert reset.total.generation_tokens == fresh.total.generation_tokens


def test_recorded_pair_without_speculation() -> None:
    stats = window("off")
    assert stats.spec is None
    assert stats.generation_tokens == sum(o.output_tokens or 0 for o in observations("off"))
    latency = stats.time_per_output_token
    assert latency is not None and latency.p50_s is not None and latency.mean_s is not None


@pytest.mark.parametrize("config", ["ngram", "draft"])
def test_per_request_figures_match_what_vllm_reports(config: str) -> None:
    for line in lines(f"requests-{config}.jsonl"):
        body = json.loads(line)
        reported = body["metrics"]["speculative_decoding"]
        spec = observation_from_response(body).spec
        assert spec is not None and spec.accepted_per_position is not None
        assert spec.acceptance_rate == pytest.approx(reported["draft_acceptance_rate"])
        assert spec.mean_acceptance_length == pytest.approx(reported["mean_acceptance_length"])
        assert sum(spec.accepted_per_position) == reported["num_accepted_draft_tokens"]
        if "per_step_accepted" in reported:
            for i, count in enumerate(spec.accepted_per_position):
                assert count == sum(1 for step in reported["per_step_accepted"] if step > i)


def test_per_request_timing_and_no_spec_when_speculation_is_off() -> None:
    chat = observation_from_response((FIXTURES / "chat-off.json").read_text())
    assert chat.spec is None
    assert chat.ttft_s is not None and chat.mean_itl_s is not None
    assert chat.output_tokens is not None and chat.generation_time_s is not None
    assert chat.mean_itl_s == pytest.approx(chat.generation_time_s / (chat.output_tokens - 1))


def test_stream_without_usage_chunk_has_no_observation() -> None:
    assert final_usage_chunk(lines("completion-ngram-stream.sse")) is None
    chunk = final_usage_chunk(lines("chat-ngram-stream-usage.sse"))
    assert chunk is not None and chunk["choices"] == []


def test_cli_on_recorded_pages(capsys: pytest.CaptureFixture[str]) -> None:
    start, after = FIXTURES / "metrics-draft-start.txt", FIXTURES / "metrics-draft-after.txt"
    assert specpilot_metrics(str(start), str(after), "--json") == 0
    result = json.loads(capsys.readouterr().out)
    spec = window("draft").spec
    assert spec is not None
    assert result["drafts"] == spec.drafts and result["reset"] is False
    assert result["per_position_acceptance"] == list(spec.per_position_acceptance)

    restarted = FIXTURES / "metrics-ngram-restarted.txt"
    assert (
        specpilot_metrics(str(FIXTURES / "metrics-ngram-after.txt"), str(restarted), "--json") == 0
    )
    assert json.loads(capsys.readouterr().out)["reset"] is True

    assert specpilot_metrics(str(FIXTURES / "chat-ngram.json")) == 2
    assert capsys.readouterr().err.count("\n") == 1
