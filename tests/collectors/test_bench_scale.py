from __future__ import annotations

from pathlib import Path

import pytest

from bench.scale import run, scaled
from collectors.exposition import parse_exposition
from tests.collectors.pages import EngineState, vllm_page


def test_scaled_page_keeps_its_shape_and_scales_every_value() -> None:
    page = vllm_page([EngineState(spec=(10, 40, 20, (10, 6, 4, 0)), itl_observations=[0.02])])
    half = parse_exposition(scaled(page, 0.5))
    whole = parse_exposition(page)
    assert scaled(page, 0.5).count("\n") == page.count("\n")
    (engine,) = whole.engines.values()
    (halved,) = half.engines.values()
    assert engine.spec is not None and halved.spec is not None
    assert halved.spec.drafts == engine.spec.drafts / 2
    assert halved.inter_token_latency is not None and engine.inter_token_latency is not None
    assert halved.inter_token_latency.upper_bounds == engine.inter_token_latency.upper_bounds


def test_run_measures_both_sides_on_the_given_page(tmp_path: Path) -> None:
    path = tmp_path / "page.prom"
    path.write_text(vllm_page([EngineState(spec=(10, 40, 20, (10, 6, 4, 0)))]))
    result = run(path, workers=3, rounds=1)
    assert (result.workers, result.page_lines) == (3, path.read_text().count("\n"))
    assert result.specpilot_round_cpu_s >= 0 and result.bare_parse_round_cpu_s >= 0
    assert result.as_json()["meets_goal"] == (result.core_share < 0.2)
    assert result.core_share == pytest.approx(result.specpilot_round_cpu_s / 15.0)
