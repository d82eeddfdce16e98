"""Build vLLM-shaped /metrics pages with prometheus_client for tests.

The families, label names and histogram buckets follow vLLM 0.32's
``vllm/v1/metrics/loggers.py`` and ``vllm/v1/spec_decode/metrics.py``; the exposition
bytes come from prometheus_client's own writer (as in vLLM), so the text format is the
real one. Recorded pages of a real vLLM live in ``tests/fixtures/vllm-0.32``; these
builders exist for what a recording cannot give: chosen counter values for property
tests and many distinct workers for the scraper tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

ITL_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
)
ITL_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
)
LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine"]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
"""Recorded real vLLM 0.32 pages and responses (see its README.md)."""


@dataclass(frozen=True)
class EngineState:
    """Counter and gauge values of one engine; observations go into the histograms."""

    model_name: str = "tiny-llama"
    engine: str = "0"
    spec: tuple[int, int, int, tuple[int, ...]] | None = None
    """(drafts, draft_tokens, accepted_tokens, accepted_per_position) or None = off."""
    generation_tokens: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    itl_observations: Sequence[float] = field(default_factory=tuple)
    tpot_observations: Sequence[float] = field(default_factory=tuple)


def vllm_page(
    engines: Sequence[EngineState], *, process_start_time: float | None = 1_700_000_000.0
) -> str:
    registry = CollectorRegistry()
    gauges = {
        name: Gauge(name, "gauge", LABELS, registry=registry)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    }
    kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", LABELS, registry=registry)
    generation = Counter("vllm:generation_tokens", "gen", LABELS, registry=registry)
    prompt = Counter("vllm:prompt_tokens", "prompt", LABELS, registry=registry)
    histograms = {
        name: PromHistogram(name, "h", LABELS, buckets=buckets, registry=registry)
        for name, buckets in (
            ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
            ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
            ("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
            ("vllm:e2e_request_latency_seconds", LATENCY_BUCKETS),
            ("vllm:request_queue_time_seconds", LATENCY_BUCKETS),
            ("vllm:request_decode_time_seconds", LATENCY_BUCKETS),
        )
    }
    spec_counters = None
    if any(state.spec is not None for state in engines):
        spec_counters = [
            Counter(name, "spec", LABELS, registry=registry)
            for name in (
                "vllm:spec_decode_num_drafts",
                "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens",
            )
        ]
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
            registry=registry,
        )
    for state in engines:
        labels = (state.model_name, state.engine)
        gauges["vllm:num_requests_running"].labels(*labels).set(state.running)
        gauges["vllm:num_requests_waiting"].labels(*labels).set(state.waiting)
        kv.labels(*labels).set(state.kv_cache_usage)
        generation.labels(*labels).inc(state.generation_tokens)
        prompt.labels(*labels).inc(7 * state.generation_tokens)
        for histogram in histograms.values():
            histogram.labels(*labels)
        for value in state.itl_observations:
            histograms["vllm:inter_token_latency_seconds"].labels(*labels).observe(value)
        for value in state.tpot_observations:
            histograms["vllm:request_time_per_output_token_seconds"].labels(*labels).observe(value)
        if spec_counters is not None and state.spec is not None:
            drafts, draft_tokens, accepted, positions = state.spec
            for counter, value in zip(spec_counters, (drafts, draft_tokens, accepted), strict=True):
                counter.labels(*labels).inc(value)
            for position, value in enumerate(positions):
                per_pos.labels(*labels, str(position)).inc(value)
    text = generate_latest(registry).decode()
    if process_start_time is not None:
        text += (
            "# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {process_start_time}\n"
        )
    return text
