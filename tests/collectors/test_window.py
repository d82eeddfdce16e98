from __future__ import annotations

import dataclasses

import pytest

from collectors.exposition import WorkerSnapshot, parse_exposition
from collectors.window import gauge_reading, histogram_quantile, worker_window
from tests.collectors.pages import EngineState, vllm_page

START = 1_700_000_000.0


def snap(*engines: EngineState, at: float | None = None, started: float = START) -> WorkerSnapshot:
    return parse_exposition(vllm_page(engines, process_start_time=started), scraped_at=at)


def test_spec_figures_come_from_counter_increases() -> None:
    before = snap(EngineState(spec=(100, 400, 250, (90, 70, 50, 40))), at=START + 100)
    after = snap(EngineState(spec=(160, 620, 370, (140, 100, 70, 60))), at=START + 130)

    spec = worker_window(before, after).total.spec

    assert spec is not None
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (60, 220, 120)
    assert spec.acceptance_rate == pytest.approx(120 / 220)
    assert spec.mean_acceptance_length == pytest.approx(1 + 120 / 60)
    assert spec.mean_proposed_tokens_per_draft == pytest.approx(220 / 60)
    assert spec.per_position_acceptance == pytest.approx((50 / 60, 30 / 60, 20 / 60, 20 / 60))
    assert spec.conditional_acceptance == pytest.approx((50 / 60, 30 / 50, 20 / 30, 1.0))


def test_engines_are_summed_and_kept_apart() -> None:
    before = snap(
        EngineState(engine="0", spec=(10, 40, 20, (10, 6, 4, 0)), generation_tokens=100),
        EngineState(engine="1", spec=(10, 40, 30, (10, 10, 8, 2)), generation_tokens=200),
        at=START + 10,
    )
    after = snap(
        EngineState(engine="0", spec=(30, 120, 40, (20, 12, 8, 0)), generation_tokens=160),
        EngineState(engine="1", spec=(15, 60, 40, (15, 14, 9, 2)), generation_tokens=230),
        at=START + 40,
    )
    window = worker_window(before, after)

    model = window.models["tiny-llama"]
    assert set(model.engines) == {"0", "1"}
    assert model.engines["0"].spec is not None and model.engines["1"].spec is not None
    assert model.engines["0"].spec.acceptance_rate == pytest.approx(20 / 80)
    assert model.engines["1"].spec.acceptance_rate == pytest.approx(10 / 20)
    assert model.total.spec is not None
    assert model.total.spec.acceptance_rate == pytest.approx((20 + 10) / (80 + 20))
    assert model.total.spec.accepted_per_position == (15, 10, 5, 0)
    assert model.total.generation_tokens_per_s == pytest.approx((60 + 30) / 30)
    assert window.total == model.total


def test_counter_going_down_is_a_reset_computed_from_the_new_process_only() -> None:
    before = snap(EngineState(spec=(500, 2000, 1500, (450, 400, 350, 300))), at=START + 900)
    restarted = START + 1000
    after = snap(
        EngineState(spec=(20, 80, 30, (15, 10, 5, 0)), generation_tokens=50),
        at=restarted + 25,
        started=restarted,
    )
    window = worker_window(before, after)

    assert window.reset and window.total.reset
    assert window.total.spec is not None
    assert (window.total.spec.drafts, window.total.spec.accepted_tokens) == (20, 30)
    assert window.total.duration_s == pytest.approx(25)
    assert window.total.generation_tokens_per_s == pytest.approx(50 / 25)


def test_restart_is_detected_even_when_new_counters_overtook_old_ones() -> None:
    before = snap(EngineState(spec=(5, 20, 10, (5, 3, 2, 0))), at=START + 10)
    after = snap(
        EngineState(spec=(50, 200, 100, (40, 30, 20, 10))), at=START + 90, started=START + 30
    )
    window = worker_window(before, after)
    assert window.reset
    assert window.total.spec is not None and window.total.spec.drafts == 50


def test_growing_counters_are_not_a_reset() -> None:
    before = snap(EngineState(spec=(5, 20, 10, (5, 3, 2, 0))), at=START + 10)
    after = snap(EngineState(spec=(6, 24, 10, (5, 3, 2, 0))), at=START + 20)
    assert not worker_window(before, after).reset


def test_speculation_off_is_not_an_error() -> None:
    before = snap(EngineState(generation_tokens=10), at=START + 1)
    after = snap(EngineState(generation_tokens=70), at=START + 31)
    total = worker_window(before, after).total
    assert total.spec is None
    assert total.generation_tokens_per_s == pytest.approx(2.0)


def test_zero_denominators_are_no_data() -> None:
    same = snap(EngineState(spec=(10, 40, 20, (10, 6, 4, 0))), at=START + 5)
    spec = worker_window(same, dataclasses.replace(same, scraped_at=START + 5)).total.spec
    assert spec is not None
    assert spec.acceptance_rate is None
    assert spec.mean_acceptance_length is None
    assert spec.mean_proposed_tokens_per_draft is None
    assert spec.per_position_acceptance == (None, None, None, None)
    assert spec.conditional_acceptance == (None, None, None, None)


def test_single_snapshot_is_the_window_since_process_start() -> None:
    only = snap(EngineState(spec=(10, 40, 20, (10, 6, 4, 0)), generation_tokens=90), at=START + 45)
    total = worker_window(None, only).total
    assert not total.reset
    assert total.duration_s == pytest.approx(45)
    assert total.generation_tokens_per_s == pytest.approx(2.0)
    assert total.spec is not None and total.spec.acceptance_rate == pytest.approx(0.5)


def test_files_without_scrape_time_have_no_rate() -> None:
    total = worker_window(None, snap(EngineState(generation_tokens=90))).total
    assert total.duration_s is None and total.generation_tokens_per_s is None


def test_gauges_mean_and_max_over_the_scrapes_in_the_window() -> None:
    pages = [
        snap(
            EngineState(engine="0", running=r0, waiting=w, kv_cache_usage=kv),
            EngineState(engine="1", running=r1, waiting=0, kv_cache_usage=kv / 2),
            at=START + i,
        )
        for i, (r0, r1, w, kv) in enumerate([(1, 0, 0, 0.2), (4, 3, 2, 0.6), (2, 1, 0, 0.4)])
    ]
    total = worker_window(pages[0], pages[-1], [gauge_reading(p) for p in pages]).total
    assert total.running.samples == 3
    assert total.running.mean == pytest.approx((1 + 7 + 3) / 3)
    assert total.running.max == 7 and total.running.latest == 3
    assert total.waiting.max == 2
    assert total.kv_cache_usage.mean == pytest.approx((0.15 + 0.45 + 0.3) / 3)


def test_latency_quantiles_and_means_from_bucket_increases() -> None:
    before = snap(EngineState(itl_observations=[5.0] * 50), at=START + 1)
    # After the first page: 50 more steps of 30-40 ms, all in the (0.025, 0.05] bucket.
    after = snap(EngineState(itl_observations=[5.0] * 50 + [0.03] * 25 + [0.04] * 25), at=START + 2)
    itl = worker_window(before, after).total.inter_token_latency
    assert itl is not None
    assert itl.count == 50
    assert itl.mean_s == pytest.approx(0.035)
    assert itl.p50_s == pytest.approx(0.025 + 0.025 * 0.5)
    assert itl.p99_s == pytest.approx(0.025 + 0.025 * 0.99)


def test_histogram_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    itl = snap(EngineState(itl_observations=[500.0] * 3)).engines
    histogram = next(iter(itl.values())).inter_token_latency
    assert histogram is not None
    assert histogram_quantile(0.5, histogram) == 80.0


def test_two_models_are_reported_apart() -> None:
    before = snap(
        EngineState(model_name="a", spec=(1, 4, 1, (1, 0, 0, 0))),
        EngineState(model_name="b"),
        at=START,
    )
    after = snap(
        EngineState(model_name="a", spec=(11, 44, 21, (9, 6, 4, 2))),
        EngineState(model_name="b"),
        at=START + 10,
    )
    window = worker_window(before, after)
    assert set(window.models) == {"a", "b"}
    assert window.models["b"].total.spec is None
    model_a = window.models["a"].total.spec
    assert model_a is not None and model_a.acceptance_rate == pytest.approx(20 / 40)
