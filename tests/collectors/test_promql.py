"""The Prometheus reader against a real Prometheus scraping a loopback vLLM-shaped server.

Prometheus scrapes the server every 0.5 s; the server hands out one page per scrape, in
order, so the test knows exactly which pages fall in a query's range and can compare the
reader with ``worker_window`` on the same two pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from collectors.exposition import parse_exposition
from collectors.promql import PrometheusError, PrometheusReader
from collectors.window import WindowStats, gauge_reading, worker_window
from tests.collectors.pages import EngineState, vllm_page
from tests.collectors.servers import Pages, Route, serving
from tests.helpers.prometheus import PrometheusServer, prometheus_factory  # noqa: F401

pytestmark = pytest.mark.prometheus

StartPrometheus = Callable[[Sequence[str]], PrometheusServer]
PAGES = 14
EXACT = 1e-9  # relative: "within rounding"


def growing_pages() -> list[str]:
    """Counters that start high (so Prometheus' extrapolation never stops at zero) and
    grow by uneven steps, so that different windows have different ratios."""
    drafts, tokens, positions, generated = 10_000, 38_000, [8_000, 5_000, 3_000, 1_000], 50_000
    itl: list[float] = [0.02] * 3000 + [0.2] * 500
    pages = []
    for step in range(PAGES):
        step_drafts = 20 + 7 * (step % 3)
        drafts += step_drafts
        tokens += 4 * step_drafts - 5 * (step % 2)
        for position, share in enumerate((0.9, 0.5, 0.3, 0.1 * (step % 4))):
            positions[position] += int(step_drafts * share)
        generated += 60 + step
        itl += [0.03] * 10 + [0.06] * (3 * step) + [0.3] * (step % 3)
        state = EngineState(
            spec=(drafts, tokens, sum(positions), tuple(positions)),
            generation_tokens=generated,
            running=float(step % 5),
            waiting=float(step % 2),
            kv_cache_usage=0.05 * (step % 7),
            itl_observations=itl,
            tpot_observations=itl[::7],
        )
        pages.append(vllm_page([state], process_start_time=1_700_000_000.0))
    return pages


def samples_in_range(prometheus: PrometheusServer, query: str, at: float) -> list[float]:
    result = prometheus.query(query, at)
    assert len(result) == 1
    values = result[0]["values"]
    assert isinstance(values, list)
    return [float(value) for _, value in values]


def read_windows(prometheus: PrometheusServer, range_s: float, at: float) -> dict[str, WindowStats]:
    async def read() -> dict[str, WindowStats]:
        async with httpx.AsyncClient() as client:
            reader = PrometheusReader(prometheus.url, client, selector='job="vllm"')
            windows = await reader.windows(range_s, at=at)
        return {worker: window.total for worker, window in windows.items()}

    return asyncio.run(read())


def test_reader_agrees_with_the_direct_window_over_the_same_scrapes(
    prometheus_factory: StartPrometheus,  # noqa: F811
) -> None:
    pages = growing_pages()
    with serving({"/metrics": Pages(pages)}) as server:
        prometheus = prometheus_factory([f"127.0.0.1:{server.port}"])
        prometheus.wait_for("count_over_time(vllm:spec_decode_num_drafts_total[1h]) >= 7")
        latest = prometheus.query("timestamp(vllm:spec_decode_num_drafts_total)")
        at = float(latest[0]["value"][1]) + 0.1  # type: ignore[index]
        range_s = 2.2
        drafts_seen = samples_in_range(
            prometheus, f"vllm:spec_decode_num_drafts_total[{round(range_s * 1000)}ms]", at
        )
        running_seen = samples_in_range(
            prometheus, f"vllm:num_requests_running[{round(range_s * 1000)}ms]", at
        )
        from_prometheus = read_windows(prometheus, range_s, at)

    snapshots = [parse_exposition(page) for page in pages]
    drafts_of = [next(iter(s.engines.values())).spec.drafts for s in snapshots]  # type: ignore[union-attr]
    first, last = drafts_of.index(drafts_seen[0]), drafts_of.index(drafts_seen[-1])
    assert last - first >= 2
    in_range = snapshots[first : last + 1]
    direct = worker_window(in_range[0], in_range[-1], [gauge_reading(s) for s in in_range]).total

    assert list(from_prometheus) == [f"127.0.0.1:{server.port}"]
    read = from_prometheus[f"127.0.0.1:{server.port}"]
    assert read.spec is not None and direct.spec is not None
    assert not read.reset
    assert read.spec.acceptance_rate == pytest.approx(direct.spec.acceptance_rate, rel=EXACT)
    assert read.spec.mean_acceptance_length == pytest.approx(
        direct.spec.mean_acceptance_length, rel=EXACT
    )
    assert read.spec.mean_proposed_tokens_per_draft == pytest.approx(
        direct.spec.mean_proposed_tokens_per_draft, rel=EXACT
    )
    assert read.spec.per_position_acceptance == pytest.approx(
        direct.spec.per_position_acceptance, rel=EXACT
    )
    # Counts are Prometheus' extrapolated increases: the same factor for every series.
    factor = read.spec.drafts / direct.spec.drafts
    assert factor >= 1.0
    assert read.spec.accepted_tokens == pytest.approx(
        direct.spec.accepted_tokens * factor, rel=EXACT
    )
    assert read.generation_tokens == pytest.approx(
        (direct.generation_tokens or 0) * factor, rel=EXACT
    )
    for name in ("inter_token_latency", "time_per_output_token"):
        got, want = getattr(read, name), getattr(direct, name)
        assert (got.p50_s, got.p90_s, got.p99_s) == pytest.approx(
            (want.p50_s, want.p90_s, want.p99_s), rel=EXACT
        )
        assert got.mean_s == pytest.approx(want.mean_s, rel=EXACT)
    assert read.running.mean == pytest.approx(sum(running_seen) / len(running_seen))
    assert read.running.max == max(running_seen) and read.running.latest == running_seen[-1]
    assert read.running.samples == len(running_seen) == len(in_range)


class RestartingWorker(Route):
    """Serves an old process' pages (acceptance 0.9), then a new process' (0.3) whose
    ``process_start_time_seconds`` is the moment of the switch."""

    def __init__(self, old_pages: int) -> None:
        super().__init__()
        self.old_pages = old_pages
        self.switched_at: float | None = None

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        if self.hits <= self.old_pages:
            k = 1000 + self.hits
            state = EngineState(spec=(10 * k, 40 * k, 36 * k, (10 * k, 10 * k, 9 * k, 7 * k)))
            page = vllm_page([state], process_start_time=1_700_000_000.0)
        else:
            if self.switched_at is None:
                self.switched_at = time.time()
            k = self.hits - self.old_pages
            state = EngineState(spec=(10 * k, 40 * k, 12 * k, (6 * k, 3 * k, 2 * k, k)))
            page = vllm_page([state], process_start_time=self.switched_at)
        Pages([page]).respond(handler)


def test_restart_in_the_range_is_flagged_and_read_from_the_new_process_only(
    prometheus_factory: StartPrometheus,  # noqa: F811
) -> None:
    worker = RestartingWorker(old_pages=4)
    with serving({"/metrics": worker}) as server:
        prometheus = prometheus_factory([f"127.0.0.1:{server.port}"])
        prometheus.wait_for("count_over_time(vllm:spec_decode_num_drafts_total[1h]) >= 8")
        at = time.time()
        windows = read_windows(prometheus, 60.0, at)

    assert worker.switched_at is not None
    read = windows[f"127.0.0.1:{server.port}"]
    assert read.reset
    assert read.spec is not None
    assert read.spec.acceptance_rate == pytest.approx(12 / 40, rel=1e-9)
    assert read.duration_s == pytest.approx(at - worker.switched_at, abs=1e-3)


def test_unreachable_prometheus_raises_a_one_line_error() -> None:
    async def read() -> None:
        async with httpx.AsyncClient() as client:
            await PrometheusReader("http://127.0.0.1:9", client).windows(60, at=time.time())

    with pytest.raises(PrometheusError) as raised:
        asyncio.run(read())
    assert "\n" not in str(raised.value)


def test_query_prometheus_refuses_is_a_prometheus_error(
    prometheus_factory: StartPrometheus,  # noqa: F811
) -> None:
    prometheus = prometheus_factory([])

    async def read() -> None:
        async with httpx.AsyncClient() as client:
            reader = PrometheusReader(prometheus.url, client, selector="job=~(")
            await reader.windows(60, at=time.time())

    with pytest.raises(PrometheusError, match="failed: HTTP 400"):
        asyncio.run(read())


def test_missing_prometheus_skips_unless_required(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.prometheus import prometheus_binary

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("SPECPILOT_REQUIRE_PROMETHEUS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        prometheus_binary()
    monkeypatch.setenv("SPECPILOT_REQUIRE_PROMETHEUS", "1")
    with pytest.raises(pytest.fail.Exception):
        prometheus_binary()
