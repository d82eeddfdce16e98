from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from collectors.exposition import parse_exposition
from collectors.scraper import Scraper, ScraperSettings, ScrapeTarget
from collectors.window import worker_window
from tests.collectors.pages import FIXTURES, EngineState, vllm_page
from tests.collectors.servers import Fixed, Hang, ManualClock, Pages, Trickle, dead_url, serving


def spec_page(drafts: int, *, running: float = 0.0, started: float | None = 1e9) -> str:
    accepted = drafts // 2
    state = EngineState(spec=(drafts, 4 * drafts, accepted, (accepted, 0, 0, 0)), running=running)
    return vllm_page([state], process_start_time=started)


@asynccontextmanager
async def scraper_for(
    targets: dict[str, str], settings: ScraperSettings, clock: Callable[[], float] | None = None
) -> AsyncIterator[Scraper]:
    async with httpx.AsyncClient() as client:
        yield Scraper(
            [ScrapeTarget(name, url) for name, url in targets.items()],
            client,
            clock=clock or ManualClock(),
            rng=random.Random(7),
            settings=settings,
        )


def test_one_round_over_good_slow_trickling_garbage_failing_and_dead_targets() -> None:
    routes = {
        "/good": Pages([spec_page(10)]),
        "/slow": Hang(),
        "/trickle": Trickle(),
        "/garbage": Fixed(200, b"<html><body>hello</body></html>"),
        "/error": Fixed(503, b"overloaded"),
        "/huge": Fixed(200, b"# padding\n" * 20_000, "text/plain"),
    }
    settings = ScraperSettings(timeout_s=0.5, max_page_bytes=64 * 1024)

    async def scrape() -> tuple[dict[str, bool], dict[str, str | None]]:
        targets = {path: server.url(path) for path in routes} | {"dead": dead_url()}
        async with scraper_for(targets, settings) as scraper:
            results = dict(await scraper.scrape_all())
            errors = {name: scraper.status(name).last_error for name in targets}
            return results, errors

    with serving(routes) as server:
        results, errors = asyncio.run(scrape())

    assert results == {name: name == "/good" for name in results}
    assert errors["/good"] is None
    assert errors["/slow"] == errors["/trickle"] == "timed out"
    assert errors["/garbage"] is not None and "exposition" in errors["/garbage"]
    assert errors["/error"] is not None and "503" in errors["/error"]
    assert errors["/huge"] is not None and "exceeds" in errors["/huge"]
    assert errors["dead"] is not None and "Connect" in errors["dead"]


def test_a_hanging_target_does_not_stall_the_others_in_the_running_loop() -> None:
    routes = {"/good": Pages([spec_page(n) for n in range(1, 50)]), "/slow": Hang()}
    settings = ScraperSettings(interval_s=0.02, timeout_s=30.0, jitter=0.1)

    async def run() -> tuple[int, int, bool]:
        # Real time: the loop really sleeps between scrapes.
        urls = {path: server.url(path) for path in routes}
        async with scraper_for(urls, settings, time.monotonic) as scraper:
            task = asyncio.create_task(scraper.run())
            for _ in range(2000):
                if scraper.peek_window("/good").scrapes >= 5:
                    break
                await asyncio.sleep(0.01)
            good = scraper.peek_window("/good")
            slow = scraper.status("/slow")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return good.scrapes, slow.consecutive_failures, slow.last_success_at is None

    with serving(routes) as server:
        good_scrapes, slow_failures, slow_never_answered = asyncio.run(run())
    assert routes["/slow"].hits == 1  # its one request is still hanging…
    assert slow_failures == 0 and slow_never_answered
    assert good_scrapes >= 5  # …while the good target was scraped again and again


def test_failing_target_backs_off_exponentially_up_to_the_ceiling() -> None:
    settings = ScraperSettings(interval_s=10.0, jitter=0.0, max_backoff_s=60.0, timeout_s=2.0)
    clock = ManualClock()

    async def delays() -> list[float]:
        found = []
        async with scraper_for({"dead": dead_url()}, settings, clock) as scraper:
            for _ in range(5):
                assert not await scraper.scrape("dead")
                status = scraper.status("dead")
                assert status.next_scrape_at is not None
                found.append(status.next_scrape_at - clock())
        return found

    assert asyncio.run(delays()) == [10.0, 20.0, 40.0, 60.0, 60.0]


def test_delays_are_jittered_within_bounds() -> None:
    settings = ScraperSettings(interval_s=10.0, jitter=0.2)
    clock = ManualClock()

    async def delays() -> list[float]:
        found = []
        with serving({"/good": Pages([spec_page(3)])}) as server:
            async with scraper_for({"w": server.url("/good")}, settings, clock) as scraper:
                for _ in range(8):
                    assert await scraper.scrape("w")
                    next_at = scraper.status("w").next_scrape_at
                    assert next_at is not None
                    found.append(next_at - clock())
        return found

    found = asyncio.run(delays())
    assert all(8.0 <= delay <= 12.0 for delay in found)
    assert len(set(found)) > 1


def test_target_goes_stale_without_successful_scrapes() -> None:
    settings = ScraperSettings(interval_s=10.0, stale_after_s=30.0, timeout_s=0.5)
    clock = ManualClock()
    route = Pages([spec_page(3)])

    async def staleness() -> list[bool]:
        seen = []
        with serving({"/m": route}) as server:
            async with scraper_for({"w": server.url("/m")}, settings, clock) as scraper:
                seen.append(scraper.status("w").stale)  # never scraped
                await scraper.scrape("w")
                seen.append(scraper.status("w").stale)
                clock.advance(29.0)
                seen.append(scraper.status("w").stale)
                clock.advance(2.0)
                seen.append(scraper.status("w").stale)
        return seen

    assert asyncio.run(staleness()) == [True, False, False, True]


def test_memory_is_bounded_and_window_spans_first_to_latest_scrape() -> None:
    pages = [spec_page(10 * (i + 1), running=float(i)) for i in range(40)]
    settings = ScraperSettings(max_gauge_readings=8)
    clock = ManualClock()

    async def scrape() -> Scraper:
        with serving({"/m": Pages(pages)}) as server:
            async with scraper_for({"w": server.url("/m")}, settings, clock) as scraper:
                for _ in range(40):
                    assert await scraper.scrape("w")
                    clock.advance(15.0)
                return scraper

    scraper = asyncio.run(scrape())
    result = scraper.take_window("w")
    assert result.window is not None and result.scrapes == 40
    total = result.window.total
    assert total.running.samples == 8
    assert total.spec is not None and total.spec.drafts == 400 - 10
    assert total.duration_s == pytest.approx(39 * 15.0)
    assert total.running.max == 39 and total.running.mean == pytest.approx(sum(range(32, 40)) / 8)
    # The next window opens at the latest scrape.
    follow = scraper.peek_window("w")
    assert follow.window is not None and follow.scrapes == 1
    assert follow.window.total.spec is not None and follow.window.total.spec.drafts == 0


def test_restart_between_scrapes_is_flagged_even_when_counters_overtook() -> None:
    # No process_start_time on these pages: only the counters tell the restart.
    pages = [spec_page(100, started=None), spec_page(5, started=None), spec_page(300, started=None)]
    clock = ManualClock()

    async def window() -> Scraper:
        with serving({"/m": Pages(pages)}) as server:
            async with scraper_for({"w": server.url("/m")}, ScraperSettings(), clock) as scraper:
                for _ in pages:
                    assert await scraper.scrape("w")
                return scraper

    result = asyncio.run(window()).take_window("w")
    assert result.window is not None and result.window.reset
    assert result.window.total.spec is not None and result.window.total.spec.drafts == 300


def test_scraped_recorded_vllm_pages_give_the_same_window_as_the_files() -> None:
    start, after = (
        (FIXTURES / f"metrics-draft-{when}.txt").read_text() for when in ("start", "after")
    )
    clock = ManualClock()

    async def scrape() -> Scraper:
        with serving({"/metrics": Pages([start, after])}) as server:
            async with scraper_for(
                {"w": server.url("/metrics")}, ScraperSettings(), clock
            ) as scraper:
                for _ in range(2):
                    assert await scraper.scrape("w")
                    clock.advance(15.0)
                return scraper

    result = asyncio.run(scrape()).take_window("w")
    expected = worker_window(parse_exposition(start), parse_exposition(after)).total
    assert result.window is not None and result.scrapes == 2
    assert result.window.total.spec == expected.spec
    assert result.window.total.inter_token_latency == expected.inter_token_latency
    assert result.window.total.duration_s == 15.0
