"""Per-pool pacing: a flapping decision never becomes a restart storm."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from controller.actuators.pacing import Paced
from controller.fleet import PoolConfig
from tests.actuators.fakes import FakeClock

A = {"method": "ngram", "num_speculative_tokens": 4}
B = {"method": "ngram", "num_speculative_tokens": 2}


class Recorder:
    name = "recorder"

    def __init__(self, fail: bool = False) -> None:
        self.pushed: list[tuple[str, object]] = []
        self.fail = fail

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        self.pushed += [(c.pool, c.config) for c in configs]
        if self.fail:
            raise RuntimeError("vLLM refused it")


def pc(pool: str, config: object, buckets: tuple[tuple[str, str], ...] = ()) -> PoolConfig:
    return PoolConfig(pool, config, buckets)  # type: ignore[arg-type]


def test_a_flap_inside_the_interval_pushes_nothing_and_a_late_change_waits() -> None:
    clock, inner = FakeClock(), Recorder()
    paced = Paced(inner, 60.0, clock=clock)

    async def scenario() -> None:
        await paced.apply([pc("p", A), pc("q", A)])
        clock.now = 10.0
        await paced.apply([pc("p", B)])  # too early: held
        assert paced.held == (pc("p", B),) and paced.due_in("p") == 50.0
        await paced.apply([pc("p", A, (("1", "ngram:4"),))])  # flapped back: nothing to do
        assert not paced.held
        await paced.apply([pc("p", B)])
        clock.now = 61.0
        await paced.apply([])  # any later call pushes what is due
        await paced.aclose()

    asyncio.run(scenario())
    assert inner.pushed == [("p", A), ("q", A), ("p", B)]


def test_held_config_is_pushed_by_the_timer_once_due() -> None:
    inner = Recorder()
    paced = Paced(inner, 0.05)

    async def scenario() -> None:
        await paced.apply([pc("p", A)])
        await paced.apply([pc("p", B)])
        assert paced.held  # immediately after the first push: held
        for _ in range(100):
            if not paced.held and len(inner.pushed) == 2:
                break
            await asyncio.sleep(0.02)
        await paced.aclose()

    asyncio.run(scenario())
    assert inner.pushed == [("p", A), ("p", B)]


def test_a_failed_push_counts_so_retries_are_paced_too() -> None:
    clock, inner = FakeClock(), Recorder(fail=True)
    errors: list[Exception] = []
    paced = Paced(inner, 30.0, clock=clock, on_error=errors.append)

    async def scenario() -> None:
        with pytest.raises(RuntimeError):
            await paced.apply([pc("p", A)])
        # The loop hands the pool over again at every iteration after a failure.
        for t in (5.0, 10.0, 20.0):
            clock.now = t
            await paced.apply([pc("p", A)])
        assert inner.pushed == [("p", A)] and paced.held == (pc("p", A),)
        clock.now = 31.0  # the interval has passed: one retry
        with pytest.raises(RuntimeError):
            await paced.apply([pc("p", A)])
        await paced.aclose()

    asyncio.run(scenario())
    assert inner.pushed == [("p", A), ("p", A)]


def test_a_failed_push_is_retried_by_the_timer() -> None:
    inner = Recorder(fail=True)
    errors: list[Exception] = []
    paced = Paced(inner, 0.05, on_error=errors.append)

    async def scenario() -> None:
        with pytest.raises(RuntimeError):
            await paced.apply([pc("p", A)])
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.02)
        await paced.aclose()

    asyncio.run(scenario())
    assert len(inner.pushed) >= 2 and isinstance(errors[0], RuntimeError)
