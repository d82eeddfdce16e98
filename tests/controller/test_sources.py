"""``collect: scrape`` on pages recorded from real vLLM 0.32: what becomes evidence, what
is skipped and why, and that one bad instance never stops the others or the loop.

The pages are served through httpx's mock transport (the scraper's HTTP client is
injected); the scrape against a real vLLM is ``tests/e2e/test_sidecar_vllm.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from controller.fleet import Fleet
from controller.ports import InstanceSeen
from controller.running import RunningConfigs
from controller.settings import Settings
from controller.sources import FleetPlacements, ScrapeSource

PAGES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": tmp_path,
            "classes": ["code", "chat"],
            "scrape_interval_s": 5.0,
            "fleet": {
                "pools": {
                    "code": {
                        "model": "tiny-llama",
                        "classes": ["code"],
                        "instances": [
                            "http://good:8000",
                            "http://garbage:8000",
                            "http://down:8000",
                        ],
                        "speculative_config": NGRAM,
                        "proposers": {
                            "ngram": {
                                "method": "ngram",
                                "gamma": [1, 4],
                                "tuning": {"prompt_lookup_max": 4},
                            }
                        },
                    }
                }
            },
        }
    )


class Pages:
    """What each host serves now; ``down`` refuses every connection."""

    def __init__(self) -> None:
        self.good = (PAGES / "metrics-ngram-start.txt").read_text()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if host == "garbage":
            return httpx.Response(200, text="<html>not a metrics page</html>\n{{{")
        return httpx.Response(200, text=self.good)


def model_of(page: str) -> str:
    line = next(line for line in page.splitlines() if 'model_name="' in line)
    return line.split('model_name="', 1)[1].split('"', 1)[0]


def test_windows_evidence_and_one_line_reasons(tmp_path: Path) -> None:
    pages = Pages()
    config = settings(tmp_path)
    served = model_of(pages.good)
    config = Settings.model_validate(
        {
            **config.model_dump(mode="python", exclude={"fleet"}),
            "fleet": {
                "pools": {
                    "code": {
                        **config.fleet.pools["code"].model_dump(mode="python"),
                        "model": served,
                    }
                }
            },
        }
    )
    now = [1000.0]
    client = httpx.AsyncClient(transport=httpx.MockTransport(pages))
    source = ScrapeSource(
        config,
        FleetPlacements(config, Fleet(config)),
        clock=lambda: now[0],
        client=client,
    )

    async def run() -> None:
        first = await source.collect()
        by_host = {w.instance.split("//")[1].split(":")[0]: w for w in first.windows}
        assert set(by_host) == {"good", "garbage", "down"}
        assert by_host["down"].healthy is False
        assert by_host["down"].status is not None and "ConnectError" in by_host["down"].status
        assert by_host["garbage"].healthy is False
        assert by_host["garbage"].status is not None
        assert "\n" not in by_host["garbage"].status
        # One scrape is no window yet: nothing to learn; but the page shows γ = 4.
        assert by_host["good"].healthy is True
        [shape] = first.instances  # the failing instances show nothing
        assert (shape.pool, shape.instance, shape.positions) == ("code", "http://good:8000", 4)
        assert shape.restarted is False
        assert first.window_observations == []

        now[0] += 5.0
        pages.good = (PAGES / "metrics-ngram-after.txt").read_text()
        second = await source.collect()
        [evidence] = second.window_observations
        assert evidence.pool == "code" and evidence.workload_class == "code"
        assert evidence.arm is not None and evidence.arm.startswith("ngram:")
        assert evidence.drafts > 0 and evidence.requests > 0
        good = next(w for w in second.windows if "good" in w.instance)
        assert good.status is None and good.acceptance_rate == pytest.approx(
            evidence.acceptance_rate
        )

        # The worker restarted: its counters went back. Skipped, and said so.
        now[0] += 5.0
        pages.good = (PAGES / "metrics-ngram-restarted.txt").read_text()
        third = await source.collect()
        assert third.window_observations == []
        restarted = next(w for w in third.windows if "good" in w.instance)
        assert restarted.status is not None and "restarted" in restarted.status
        assert [s.restarted for s in third.instances] == [True]
        await client.aclose()

    asyncio.run(run())


def test_windows_are_the_arm_vllm_shows_whatever_was_pushed(tmp_path: Path) -> None:
    """Pushed off and believed off, the instance still drafts with four positions: its
    windows are n-gram γ = 4 (the method it was last known to run), never off."""
    pages = Pages()
    served = model_of(pages.good)
    data = settings(tmp_path).model_dump(mode="python")
    data["fleet"]["pools"]["code"]["instances"] = ["http://good:8000"]
    data["fleet"]["pools"]["code"]["model"] = served
    config = Settings.model_validate(data)
    fleet = Fleet(config)
    now = [1000.0]
    running = RunningConfigs(fleet, confirm_within_s=60.0, clock=lambda: now[0])
    running.pushed("code", None, 990.0)
    running.see(InstanceSeen("code", "http://good:8000", 0, True, 995.0))
    running.settle()
    assert running.believed("code") is None  # an off it once confirmed
    placements = FleetPlacements(config, fleet)
    placements.running = running
    client = httpx.AsyncClient(transport=httpx.MockTransport(pages))
    source = ScrapeSource(config, placements, clock=lambda: now[0], client=client)

    async def run() -> None:
        await source.collect()
        now[0] += 5.0
        pages.good = (PAGES / "metrics-ngram-after.txt").read_text()
        collected = await source.collect()
        [evidence] = collected.window_observations
        assert evidence.arm == "ngram:4"
        assert [w.arm for w in collected.windows] == ["ngram:4"]
        await client.aclose()

    asyncio.run(run())
