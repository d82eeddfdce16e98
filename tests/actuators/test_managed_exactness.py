"""The exactness canary on fakes: a speculating instance whose greedy token ids differ
from the pool's no-speculation reference is rolled back and named; the loop records it
as a critical ``ExactnessBroken``; the periodic check runs every ``interval_s``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.managed import (
    CanarySettings,
    ManagedActuator,
    ManagedSettings,
    RolloutFailed,
    SpecConfig,
)
from controller.exactness import ExactnessBroken, compare, config_text
from controller.fleet import PoolConfig
from controller.service import build_service
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.controller.conftest import make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
NGRAM_2 = {**NGRAM, "num_speculative_tokens": 2}
PROMPTS = ("alpha", "beta")


def make(launcher: FakeLauncher, *, mode: Any = "blue_green", **canary: Any) -> ManagedActuator:
    return ManagedActuator(
        launcher,
        settings=ManagedSettings(
            mode=mode,
            switch_grace_s=0.0,
            drain_poll_s=0.0,
            canary=CanarySettings(
                requests=1, max_slowdown=None, exactness_prompts=PROMPTS, **canary
            ),
        ),
        in_flight=launcher.in_flight,
        timer=launcher.clock,
        transport=launcher.transport(),
    )


def apply(actuator: ManagedActuator, config: SpecConfig) -> None:
    asyncio.run(actuator.apply([PoolConfig("p", config, ())]))


def test_compare_names_the_first_differing_position() -> None:
    (divergence,) = compare([(1, 2, 3), (4, 5, 6, 7, 8)], [(1, 2, 3), (4, 5, 9, 7, 8)])
    assert (divergence.prompt, divergence.position) == (1, 2)
    assert divergence.expected == (6, 7, 8) and divergence.got == (9, 7, 8)
    (short,) = compare([(1, 2, 3)], [(1, 2)])
    assert (short.position, short.reference_length, short.length) == (2, 3, 2)


def test_an_exact_speculating_instance_takes_traffic() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator = make(launcher)
    apply(actuator, None)  # the reference: no speculation
    apply(actuator, NGRAM)
    assert actuator.config("p") == NGRAM and actuator.urls("p") == ("http://i2",)
    after_launch = launcher.events[launcher.events.index("launch ngram") :]
    assert after_launch.count("exact i2") == len(PROMPTS)
    assert "exact i1" not in after_launch  # the stored reference, not asked again


def test_a_divergent_instance_is_rolled_back_and_named() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"diverge_at": 5}})
    actuator = make(launcher)
    apply(actuator, None)

    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, NGRAM)

    (failure,) = raised.value.failures
    assert failure.stage == "exactness" and failure.still_serving and failure.serving is None
    broken = failure.exactness
    assert isinstance(broken, ExactnessBroken)
    assert (broken.pool, broken.config, broken.reference) == ("p", NGRAM, "no speculation")
    assert [(d.prompt, d.position) for d in broken.divergences] == [(0, 5), (1, 5)]
    assert "token 5 of 32 differs" in str(broken) and '"method":"ngram"' in str(broken)
    assert actuator.config("p") is None and actuator.urls("p") == ("http://i1",)
    assert launcher.instances["i2"].stopped and not launcher.instances["i1"].stopped

    # The same config again is refused without starting anything.
    launcher.events.clear()
    with pytest.raises(RolloutFailed) as again:
        apply(actuator, NGRAM)
    assert again.value.failures[0].stage == "exactness"
    assert again.value.failures[0].exactness is None and launcher.events == []


def test_without_a_reference_the_old_instance_before_the_push_is_the_baseline() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"draft_model": {"diverge_at": 2}})
    actuator = make(launcher)
    apply(actuator, NGRAM)  # first start speculates: nothing to compare with yet
    assert actuator.config("p") == NGRAM
    draft = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, draft)
    broken = raised.value.failures[0].exactness
    assert broken is not None and broken.divergences[0].position == 2
    assert broken.reference == f"the instance before the push ({config_text(NGRAM)})"
    assert actuator.config("p") == NGRAM


def test_in_place_rolls_back_to_the_old_config() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"diverge_at": 3}})
    actuator = make(launcher, mode="in_place")
    apply(actuator, None)
    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, NGRAM)
    assert raised.value.failures[0].stage == "exactness"
    assert actuator.config("p") is None and actuator.urls("p") == ("http://i3",)


def test_a_server_without_token_ids_is_not_judged() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"token_ids": False}})
    actuator = make(launcher)
    apply(actuator, None)
    apply(actuator, NGRAM)
    assert actuator.config("p") == NGRAM


def test_periodic_check_runs_every_interval_and_reports_a_divergence() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator = make(launcher, interval_s=100.0)
    apply(actuator, None)
    apply(actuator, NGRAM)

    async def check(now: float) -> list[tuple[str, bool]]:
        return [(r.context, r.broken is None) for r in await actuator.check_due(now)]

    assert asyncio.run(check(1000.0)) == []  # starts the clock
    assert asyncio.run(check(1050.0)) == []
    assert asyncio.run(check(1100.0)) == [("pool=p", True)]
    launcher.instances["i2"].diverge_at = 31  # the engine starts to differ at the end
    assert asyncio.run(check(1150.0)) == []
    (result,) = asyncio.run(actuator.check_due(1200.0))
    assert result.broken is not None and result.broken.divergences[0].position == 31


def test_no_periodic_check_without_interval_or_on_an_off_pool() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator = make(launcher, interval_s=None)
    apply(actuator, None)
    apply(actuator, NGRAM)
    assert asyncio.run(actuator.check_due(0.0)) == []
    assert asyncio.run(actuator.check_due(1e9)) == []
    off_pool = make(FakeLauncher(FakeClock()), interval_s=1.0)
    apply(off_pool, None)
    assert asyncio.run(off_pool.check_due(0.0)) == []
    assert asyncio.run(off_pool.check_due(10.0)) == []


def test_the_loop_records_exactness_broken_on_a_rolled_back_push(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"diverge_at": 7}})
    managed = make(launcher, interval_s=10.0)
    policy = ScriptedPolicy(settings.buckets)
    clock = FakeClock()
    service = build_service(settings, policy, QueueSource(), actuators=[managed], clock=clock)
    try:

        async def scenario() -> None:
            await service.loop.start()
            await service.loop.tick()  # first push: the pool's running config (off)
            assert managed.running() == {"p": None}
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:3"
            clock.now += 1
            await service.loop.tick()
            alerts = service.store.alerts()
            names = sorted((a.name, a.severity) for a in alerts)
            assert names == [("ActuatorFailed", "critical"), ("ExactnessBroken", "critical")]
            (broken,) = [a for a in alerts if a.name == "ExactnessBroken"]
            assert broken.context == "pool=p" and "pool 'p' running" in broken.message
            assert '"method":"ngram"' in broken.message and "token 7 of 32" in broken.message
            assert managed.running() == {"p": None}  # rolled back
            # A config that passes its canary reaches the pool: both resolve.
            launcher.behaviour.pop("ngram")
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:2"
            clock.now += 1
            await service.loop.tick()
            for _ in range(100):  # the push runs beside the loop; wait for its end
                if not service.store.alerts(unresolved_only=True):
                    break
                await asyncio.sleep(0.05)
            assert service.store.alerts(unresolved_only=True) == []

        asyncio.run(scenario())
    finally:
        service.close()


def test_the_loop_runs_the_periodic_check_and_resolves_it(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    launcher = FakeLauncher(FakeClock())
    managed = make(launcher, interval_s=60.0)
    policy = ScriptedPolicy(settings.buckets)
    clock = FakeClock()
    clock.now = 1000.0
    service = build_service(settings, policy, QueueSource(), actuators=[managed], clock=clock)

    def firing() -> list[tuple[str, str | None, bool]]:
        return [(a.name, a.context, a.resolved_at is None) for a in service.store.alerts()]

    try:

        async def tick(after_s: float) -> None:
            clock.now += after_s
            await service.loop.tick()

        async def scenario() -> None:
            await service.loop.start()
            await tick(0.0)  # off: the reference
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:3"
            await tick(1.0)  # n-gram, exact: taken; its check clock starts
            assert managed.config("p") is not None
            await tick(30.0)
            assert firing() == []
            (ngram,) = [i for i in launcher.instances.values() if not i.stopped]
            ngram.diverge_at = 20
            await tick(31.0)  # due: 61 s since the clock started
            assert firing() == [("ExactnessBroken", "pool=p", True)]
            ngram.diverge_at = None
            await tick(30.0)
            assert firing() == [("ExactnessBroken", "pool=p", True)]  # not due yet
            await tick(31.0)

        asyncio.run(scenario())
        assert firing() == [("ExactnessBroken", "pool=p", False)]  # resolved
        (alert,) = service.store.alerts()
        assert alert.severity == "critical" and "token 20 of 32" in alert.message
    finally:
        service.close()
