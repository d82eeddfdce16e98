"""Window statistics never raise on any pair of valid snapshots, and ratios stay in [0, 1];
a page written by prometheus_client parses back to the values written.

"Valid" is what a vLLM page can say: counts are finite and non-negative, at most γ
draft tokens per draft, accepted ≤ proposed, per-position counts non-increasing and
summing to the accepted count, cumulative histogram buckets non-decreasing. The two
snapshots are otherwise unrelated: the pair may be a restart, a different γ, an engine
that came or went, or two scrapes taken in the middle of a counter update.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.exposition import (
    EngineKey,
    EngineSnapshot,
    Histogram,
    SpecDecodeCounters,
    WorkerSnapshot,
    parse_exposition,
)
from collectors.window import LatencyWindow, WindowStats, worker_window
from tests.collectors.pages import EngineState, vllm_page

BOUNDS = (0.01, 0.05, 0.1, 0.5, math.inf)
counts = st.integers(min_value=0, max_value=10**9)


@st.composite
def spec_counters(draw: st.DrawFn) -> SpecDecodeCounters:
    gamma = draw(st.integers(min_value=1, max_value=6))
    drafts = draw(counts)
    draft_tokens = draw(st.integers(min_value=0, max_value=drafts * gamma))
    per_position: list[int] = []
    ceiling = min(drafts, draft_tokens)
    for _ in range(gamma):
        ceiling = draw(st.integers(min_value=0, max_value=ceiling))
        per_position.append(ceiling)
    accepted = sum(per_position)
    if accepted > draft_tokens:
        per_position = [0] * gamma
        accepted = 0
    return SpecDecodeCounters(drafts, draft_tokens, accepted, tuple(map(float, per_position)))


@st.composite
def histograms(draw: st.DrawFn) -> Histogram:
    increments = draw(st.lists(counts, min_size=len(BOUNDS), max_size=len(BOUNDS)))
    cumulative = tuple(float(sum(increments[: i + 1])) for i in range(len(BOUNDS)))
    total = draw(st.floats(min_value=0, max_value=1e9, allow_nan=False))
    return Histogram(BOUNDS, cumulative, cumulative[-1], total)


gauges = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)


@st.composite
def engines(draw: st.DrawFn) -> EngineSnapshot:
    key = EngineKey(draw(st.sampled_from(["a", "b"])), draw(st.sampled_from(["0", "1"])))
    return EngineSnapshot(
        key=key,
        spec=draw(st.none() | spec_counters()),
        generation_tokens=draw(st.none() | counts.map(float)),
        running=draw(gauges),
        waiting=draw(gauges),
        kv_cache_usage=draw(st.none() | st.floats(min_value=0, max_value=1)),
        inter_token_latency=draw(st.none() | histograms()),
        time_per_output_token=draw(st.none() | histograms()),
    )


@st.composite
def snapshots(draw: st.DrawFn) -> WorkerSnapshot:
    found = draw(st.lists(engines(), max_size=4))
    return WorkerSnapshot(
        {engine.key: engine for engine in found},
        draw(st.none() | st.sampled_from([1.0e9, 1.1e9])),
        draw(st.none() | st.floats(min_value=1.1e9, max_value=1.2e9)),
    )


def assert_sane(stats: WindowStats) -> None:
    if stats.spec is not None:
        spec = stats.spec
        for ratio in (
            spec.acceptance_rate,
            *spec.per_position_acceptance,
            *spec.conditional_acceptance,
        ):
            assert ratio is None or 0.0 <= ratio <= 1.0
        length = spec.mean_acceptance_length
        assert length is None or length >= 1.0
    assert stats.kv_cache_usage.mean is None or 0.0 <= stats.kv_cache_usage.mean <= 1.0
    rate = stats.generation_tokens_per_s
    assert rate is None or rate >= 0.0
    latencies: list[LatencyWindow | None] = [stats.inter_token_latency, stats.time_per_output_token]
    for latency in latencies:
        if latency is not None:
            for value in (latency.p50_s, latency.p90_s, latency.p99_s, latency.mean_s):
                assert value is None or value >= 0.0


@settings(max_examples=200, deadline=None)
@given(snapshots(), snapshots())
def test_window_of_any_valid_pair_never_raises_and_ratios_stay_in_unit_interval(
    start: WorkerSnapshot, end: WorkerSnapshot
) -> None:
    for window in (worker_window(start, end), worker_window(None, end)):
        assert_sane(window.total)
        for model in window.models.values():
            assert_sane(model.total)
            for engine in model.engines.values():
                assert_sane(engine)


@settings(max_examples=100, deadline=None)
@given(snapshots())
def test_a_snapshot_against_itself_is_an_empty_window(snapshot: WorkerSnapshot) -> None:
    window = worker_window(snapshot, snapshot)
    assert not window.reset
    spec = window.total.spec
    assert spec is None or (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (0, 0, 0)


@settings(max_examples=50, deadline=None)
@given(
    spec_counters(),
    counts,
    st.floats(min_value=0, max_value=1),
    st.lists(st.floats(min_value=0, max_value=100), max_size=20),
)
def test_parsing_a_written_page_gives_back_its_values(
    spec: SpecDecodeCounters, generated: int, kv: float, itl: list[float]
) -> None:
    state = EngineState(
        spec=(
            int(spec.drafts),
            int(spec.draft_tokens),
            int(spec.accepted_tokens),
            tuple(int(v) for v in spec.accepted_per_position),
        ),
        generation_tokens=generated,
        kv_cache_usage=kv,
        itl_observations=itl,
    )
    (engine,) = parse_exposition(vllm_page([state])).engines.values()
    assert engine.spec == spec
    assert engine.generation_tokens == generated and engine.kv_cache_usage == kv
    assert engine.inter_token_latency is not None
    assert engine.inter_token_latency.count == len(itl)
    assert engine.inter_token_latency.sum == pytest.approx(math.fsum(itl))
