"""The Prometheus reader against a real Prometheus scraping loopback vLLM-shaped servers.

One Prometheus (every 0.5 s) scrapes, for the whole module: a server of synthetic pages
whose counters grow unevenly, one that restarts, and one per recorded real vLLM 0.32
configuration. Each server hands out one page per scrape, in order, so a test knows which
pages fall in a query's range and can compare the reader with ``worker_window`` on them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from collectors.exposition import parse_exposition
from collectors.promql import PrometheusError, PrometheusReader
from collectors.window import gauge_reading, worker_window
from tests.collectors.agreement import EXACT, assert_same_ratios, read_windows
from tests.collectors.pages import FIXTURES, EngineState, vllm_page
from tests.collectors.servers import LoopbackServer, Pages, Route, serving
from tests.helpers.prometheus import (
    PrometheusServer,
    prometheus_factory,  # noqa: F401
    running_prometheus,
)

pytestmark = pytest.mark.prometheus

StartPrometheus = Callable[[Sequence[str]], PrometheusServer]
RECORDED = ("ngram", "draft", "off")
PAGES = 14


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


@dataclass(frozen=True)
class Fleet:
    prometheus: PrometheusServer
    growing: LoopbackServer
    growing_pages: list[str]
    restarting: LoopbackServer
    restarting_route: RestartingWorker
    recorded: dict[str, LoopbackServer]

    @staticmethod
    def instance(server: LoopbackServer) -> str:
        return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ExitStack() as stack:
        pages = growing_pages()
        growing = stack.enter_context(serving({"/metrics": Pages(pages)}))
        route = RestartingWorker(old_pages=4)
        restarting = stack.enter_context(serving({"/metrics": route}))
        recorded = {}
        for config in RECORDED:
            start, after = (recorded_page(config, when) for when in ("start", "after"))
            route_pages = Pages([start, start, after])
            recorded[config] = stack.enter_context(serving({"/metrics": route_pages}))
        servers = [growing, restarting, *recorded.values()]
        prometheus = stack.enter_context(
            running_prometheus(
                [Fleet.instance(server) for server in servers],
                tmp_path_factory.mktemp("prometheus"),
                scrape_interval_s=0.5,
            )
        )
        yield Fleet(prometheus, growing, pages, restarting, route, recorded)


def recorded_page(config: str, when: str) -> str:
    return (FIXTURES / f"metrics-{config}-{when}.txt").read_text()


def test_reader_agrees_with_the_direct_window_over_the_same_scrapes(fleet: Fleet) -> None:
    prometheus, instance = fleet.prometheus, Fleet.instance(fleet.growing)
    selector = f'vllm:spec_decode_num_drafts_total{{instance="{instance}"}}'
    prometheus.wait_for(f"count_over_time({selector}[1h]) >= 7")
    # Query while the pages still grew: just after the 7th scrape.
    stamps = prometheus.query(f"{selector}[1h]")[0]["values"]
    assert isinstance(stamps, list)
    at = float(stamps[6][0]) + 0.1
    range_s = 2.2
    window = f"[{round(range_s * 1000)}ms]"
    drafts_seen = samples_in_range(prometheus, f"{selector}{window}", at)
    running_seen = samples_in_range(
        prometheus, f'vllm:num_requests_running{{instance="{instance}"}}{window}', at
    )
    read = read_windows(prometheus.url, range_s, at)[instance]

    snapshots = [parse_exposition(page) for page in fleet.growing_pages]
    drafts_of = [next(iter(s.engines.values())).spec.drafts for s in snapshots]  # type: ignore[union-attr]
    first, last = drafts_of.index(drafts_seen[0]), drafts_of.index(drafts_seen[-1])
    assert first >= 1 and last - first >= 2
    # Counts: from the last scrape at or before the range's start to the last in it.
    # Gauges: the scrapes inside the range.
    in_range = snapshots[first : last + 1]
    direct = worker_window(
        snapshots[first - 1], in_range[-1], [gauge_reading(s) for s in in_range]
    ).total

    assert not read.reset
    assert_same_ratios(read, direct)
    assert read.spec is not None and direct.spec is not None
    assert read.spec.drafts == direct.spec.drafts  # exact: whole numbers, no extrapolation
    assert read.spec.accepted_tokens == direct.spec.accepted_tokens
    assert read.spec.accepted_per_position == direct.spec.accepted_per_position
    assert read.generation_tokens == direct.generation_tokens
    assert read.running.mean == pytest.approx(sum(running_seen) / len(running_seen))
    assert read.running.max == max(running_seen) and read.running.latest == running_seen[-1]
    assert read.running.samples == len(running_seen) == len(in_range)


def test_reader_agrees_with_the_direct_window_on_recorded_vllm_pages(fleet: Fleet) -> None:
    fleet.prometheus.wait_for("min(count_over_time(vllm:generation_tokens_total[1h])) >= 4")
    windows = read_windows(fleet.prometheus.url, 600.0, time.time())
    # Every used counter is 0 on the start pages, so Prometheus extrapolates each series
    # by the same factor (none towards the range start) and ratios must agree.
    for config, server in fleet.recorded.items():
        read = windows[Fleet.instance(server)]
        start, after = (parse_exposition(recorded_page(config, w)) for w in ("start", "after"))
        direct = worker_window(start, after).total
        assert not read.reset
        assert direct.spec is not None or config == "off"
        assert_same_ratios(read, direct)


def test_restart_in_the_range_is_flagged_and_read_from_the_new_process_only(
    fleet: Fleet,
) -> None:
    instance = Fleet.instance(fleet.restarting)
    fleet.prometheus.wait_for(
        f'count_over_time(vllm:spec_decode_num_drafts_total{{instance="{instance}"}}[1h]) >= 8'
    )
    at = time.time()
    read = read_windows(fleet.prometheus.url, 60.0, at)[instance]

    switched_at = fleet.restarting_route.switched_at
    assert switched_at is not None
    assert read.reset
    assert read.spec is not None
    assert read.spec.acceptance_rate == pytest.approx(12 / 40, rel=EXACT)
    assert read.duration_s == pytest.approx(at - switched_at, abs=1e-3)


def test_restart_just_before_the_range_is_flagged_too(fleet: Fleet) -> None:
    """The exact count reaches back to the last sample before the range: when the
    restart falls between it and the range's first sample, no reset shows inside the
    range, and the reader must still read the new process alone."""
    instance = Fleet.instance(fleet.restarting)
    selector = f'vllm:spec_decode_num_drafts_total{{instance="{instance}"}}'
    fleet.prometheus.wait_for(f"count_over_time({selector}[1h]) >= 8")
    samples = fleet.prometheus.query(f"{selector}[1h]")[0]["values"]
    assert isinstance(samples, list)
    values = [float(value) for _, value in samples]
    restart = next(i for i in range(1, len(values)) if values[i] < values[i - 1])
    first_new = float(samples[restart][0])
    at, range_s = first_new + 1.2, 1.3  # the range starts 0.1 s before the first new sample
    assert float(samples[restart - 1][0]) <= at - range_s < first_new
    read = read_windows(fleet.prometheus.url, range_s, at)[instance]

    switched_at = fleet.restarting_route.switched_at
    assert switched_at is not None
    assert read.reset
    assert read.spec is not None
    assert read.spec.acceptance_rate == pytest.approx(12 / 40, rel=EXACT)
    assert read.duration_s == pytest.approx(at - switched_at, abs=1e-3)


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
