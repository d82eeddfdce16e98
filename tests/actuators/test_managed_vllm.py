"""The managed actuator on real vLLM: restarts under streaming traffic, and a config vLLM
accepts at start but dies on at the first request is rolled back.

One actuator (and its event loop) serves the module, so the two tests share their
starting n-gram instance: five server starts in all (n-gram, draft, EAGLE-3, n-gram, the
refused one), never more than two alive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from controller.actuators.managed import (
    CanarySettings,
    ManagedActuator,
    ManagedSettings,
    RolloutFailed,
    SpecConfig,
)
from controller.actuators.preflight import Preflight
from controller.fleet import PoolConfig
from testbed.environment import ModelSet, VllmEnvironment
from testbed.launcher import RealVllmLauncher
from testbed.server import parse_spec, process_group_alive
from testbed.traffic import code_prompt, completion_body

pytestmark = pytest.mark.vllm

POOL = "code"
MAX_TOKENS = 24


@dataclass(frozen=True)
class Streamed:
    url: str
    ok: bool
    detail: str


class Harness:
    def __init__(self, env: VllmEnvironment, models: ModelSet) -> None:
        self.models = models
        self.loop = asyncio.new_event_loop()
        self.launcher = RealVllmLauncher(env, models)
        self.switches: list[tuple[str, tuple[str, ...]]] = []
        self.actuator = ManagedActuator(
            self.launcher,
            # A draft model or EAGLE head costs a second forward pass per step, so on
            # a 2-core CPU it is several times slower than n-gram depending on the
            # machine's load: the latency comparison is tested with fakes
            # (test_managed.py), not here, where the subject is that no request fails
            # or is cut while the config moves.
            # Starts take minutes when other vLLM servers share this machine's cores.
            settings=ManagedSettings(
                start_timeout_s=900.0, canary=CanarySettings(max_slowdown=None)
            ),
            preflight=Preflight({POOL: str(models.target)}),
            on_switch=lambda pool, urls: self.switches.append((pool, urls)),
        )

    def config(self, spec: str) -> SpecConfig:
        return parse_spec(spec, self.models)

    def apply(self, config: SpecConfig) -> None:
        self.loop.run_until_complete(self.actuator.apply([PoolConfig(POOL, config, ())]))

    def start_ngram(self) -> None:
        if self.actuator.config(POOL) != self.config("ngram:4"):
            self.apply(self.config("ngram:4"))

    def while_streaming(self, action: Any) -> tuple[list[Streamed], BaseException | None]:
        """Run ``action()`` (a coroutine factory) while a client streams completions, one
        after another, to whatever instance serves the pool at that moment."""

        async def scenario() -> tuple[list[Streamed], BaseException | None]:
            stop = asyncio.Event()
            results: list[Streamed] = []
            client_task = asyncio.create_task(stream_until(self.actuator, stop, results))
            error: BaseException | None = None
            try:
                await action()
            except Exception as exc:
                error = exc
            finally:
                await asyncio.sleep(1.0)  # one more request after the last switch
                stop.set()
                await client_task
            return results, error

        return self.loop.run_until_complete(scenario())

    def close(self) -> None:
        self.loop.run_until_complete(self.actuator.aclose())
        self.launcher.stop_all()
        self.loop.close()


async def stream_once(client: httpx.AsyncClient, url: str, index: int) -> Streamed:
    body = completion_body(code_prompt(index), MAX_TOKENS, stream=True, include_usage=True)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Streamed(url, False, f"HTTP {response.status_code}")
            lines = [line async for line in response.aiter_lines() if line.strip()]
    except httpx.HTTPError as exc:
        return Streamed(url, False, f"{type(exc).__name__}: {exc}")
    if not lines or lines[-1] != "data: [DONE]":
        return Streamed(url, False, f"cut: last line {lines[-1:]!r}")
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    usage = chunks[-1].get("usage") or {}
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    if usage.get("completion_tokens") != MAX_TOKENS or "length" not in finish:
        return Streamed(url, False, f"incomplete: usage {usage}, finish {finish}")
    return Streamed(url, True, "")


async def stream_until(
    actuator: ManagedActuator, stop: asyncio.Event, results: list[Streamed]
) -> None:
    index = 0
    async with httpx.AsyncClient(timeout=120.0) as client:
        while not stop.is_set():
            urls = actuator.urls(POOL)
            assert urls, "the pool lost its instance"
            results.append(await stream_once(client, urls[0], index))
            index += 1
            # vLLM engines here share one core: leave the starting server some of it.
            await asyncio.sleep(1.5)


@pytest.fixture(scope="module")
def harness(testbed: tuple[VllmEnvironment, ModelSet]) -> Iterator[Harness]:
    harness = Harness(*testbed)
    try:
        yield harness
    finally:
        harness.close()
    assert not any(s.pid and process_group_alive(s.pid) for s in harness.launcher.servers)


def test_moves_a_real_vllm_between_ngram_draft_and_eagle_under_streaming(
    harness: Harness,
) -> None:
    harness.start_ngram()
    ngram, draft, eagle = (harness.config(s) for s in ("ngram:4", "draft:3", "eagle3:3"))
    first_url = harness.actuator.urls(POOL)[0]

    async def round_trip() -> None:
        for config in (draft, eagle):
            await harness.actuator.apply([PoolConfig(POOL, config, ())])
            assert harness.actuator.config(POOL) == config
        await harness.actuator.apply([PoolConfig(POOL, ngram, ())])

    results, error = harness.while_streaming(round_trip)

    assert error is None
    assert harness.actuator.config(POOL) == ngram
    failed = [r for r in results if not r.ok]
    assert not failed, failed
    served_by = list(dict.fromkeys(r.url for r in results))
    # The stream ran on the first n-gram instance, the draft one, the EAGLE-3 one and
    # the new n-gram one.
    assert len(served_by) == 4 and served_by[0] == first_url, served_by
    assert harness.launcher.launched[-3:] == [draft, eagle, ngram]
    # Old instances are gone; exactly one serves.
    alive = [s for s in harness.launcher.servers if s.pid and process_group_alive(s.pid)]
    assert [s.base_url for s in alive] == [harness.actuator.urls(POOL)[0]]
    assert [urls for _, urls in harness.switches][-3:] == [(u,) for u in served_by[1:]]


def test_config_vllm_dies_on_is_rolled_back_while_the_old_instance_serves(
    harness: Harness,
) -> None:
    harness.start_ngram()
    serving_url = harness.actuator.urls(POOL)[0]
    switches_before = len(harness.switches)
    # vLLM 0.32 on CPU starts healthy with this, then its engine dies at the first request.
    ngram = harness.config("ngram:4")
    assert ngram is not None
    synthetic = {
        **ngram,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.8, 0.6, 0.4, 0.2],
    }

    async def push() -> None:
        await harness.actuator.apply([PoolConfig(POOL, synthetic, ())])

    results, error = harness.while_streaming(push)

    assert isinstance(error, RolloutFailed), error
    (failure,) = error.failures
    assert failure.stage == "canary" and failure.still_serving
    assert failure.serving == harness.config("ngram:4")
    assert "canary" in str(error) and POOL in str(error)
    assert harness.launcher.launched[-1] == synthetic
    assert harness.launcher.servers[-1].pid is None  # the refused instance was stopped
    assert harness.actuator.urls(POOL) == (serving_url,)
    assert len(harness.switches) == switches_before  # traffic never moved
    assert results and all(r.ok and r.url == serving_url for r in results), results
