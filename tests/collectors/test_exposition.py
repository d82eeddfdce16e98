from __future__ import annotations

import math

import pytest

from collectors.exposition import EngineKey, ExpositionError, parse_exposition
from tests.collectors.pages import EngineState, vllm_page


def test_reads_spec_counters_per_engine_and_ignores_unused_series() -> None:
    page = vllm_page(
        [
            EngineState(engine="0", spec=(10, 40, 25, (9, 7, 5, 4)), generation_tokens=35),
            EngineState(engine="1", spec=(3, 12, 2, (2, 0, 0, 0)), running=2, waiting=1),
        ]
    )
    snapshot = parse_exposition(page, scraped_at=12.5)

    assert list(snapshot.engines) == [EngineKey("tiny-llama", "0"), EngineKey("tiny-llama", "1")]
    first = snapshot.engines[EngineKey("tiny-llama", "0")]
    assert first.spec is not None
    assert (first.spec.drafts, first.spec.draft_tokens, first.spec.accepted_tokens) == (10, 40, 25)
    assert first.spec.accepted_per_position == (9, 7, 5, 4)
    assert first.generation_tokens == 35
    second = snapshot.engines[EngineKey("tiny-llama", "1")]
    assert (second.running, second.waiting) == (2, 1)
    assert snapshot.scraped_at == 12.5
    assert snapshot.process_start_time_s == 1_700_000_000.0


def test_histogram_buckets_are_cumulative_and_end_at_infinity() -> None:
    page = vllm_page([EngineState(itl_observations=(0.02, 0.02, 0.3, 100.0))])
    itl = next(iter(parse_exposition(page).engines.values())).inter_token_latency

    assert itl is not None
    assert itl.upper_bounds[-1] == math.inf
    assert list(itl.cumulative_counts) == sorted(itl.cumulative_counts)
    assert itl.count == 4 and itl.cumulative_counts[-1] == 4
    assert itl.sum == pytest.approx(100.34)
    assert itl.cumulative_counts[itl.upper_bounds.index(0.025)] == 2


def test_no_spec_series_means_speculation_off() -> None:
    snapshot = parse_exposition(vllm_page([EngineState(generation_tokens=5)]))
    assert [engine.spec for engine in snapshot.engines.values()] == [None]


def test_empty_page_is_an_empty_snapshot() -> None:
    snapshot = parse_exposition("")
    assert dict(snapshot.engines) == {} and snapshot.process_start_time_s is None


def test_non_finite_values_count_as_absent() -> None:
    page = 'vllm:num_requests_running{model_name="m",engine="0"} NaN\n'
    page += 'vllm:num_requests_waiting{model_name="m",engine="0"} 3\n'
    engine = parse_exposition(page).engines[EngineKey("m", "0")]
    assert engine.running is None and engine.waiting == 3


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>\n",
        '{"object": "list", "data": []}\n',
        "hello world\n",
        'vllm:num_requests_running{model_name="m" 1\n',
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} many\n',
        "# TYPE x counter\nx_total 1\n\x00\x01binary\n",
    ],
)
def test_non_exposition_text_raises_one_line_error(text: str) -> None:
    with pytest.raises(ExpositionError) as raised:
        parse_exposition(text)
    message = str(raised.value)
    assert message.startswith("not Prometheus exposition text")
    assert "\n" not in message
