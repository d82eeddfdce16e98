"""The managed actuator's rollout logic on fake instances: start, canary, switch, drain,
stop; and every way back (start failure, failed or slower canary, in-place restore)."""

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
from controller.actuators.preflight import Preflight
from controller.fleet import PoolConfig
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.actuators.test_preflight import make_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
NGRAM_2 = {**NGRAM, "num_speculative_tokens": 2}


def make(
    launcher: FakeLauncher,
    *,
    mode: Any = "blue_green",
    max_slowdown: float | None = 0.25,
    preflight: Preflight | None = None,
    exactness: bool = False,
) -> tuple[ManagedActuator, list[tuple[str, tuple[str, ...]]]]:
    """``exactness`` off by default: these tests count the latency canary's requests;
    the exactness canary has its own (test_managed_exactness.py)."""
    switches: list[tuple[str, tuple[str, ...]]] = []

    def on_switch(pool: str, urls: tuple[str, ...]) -> None:
        switches.append((pool, urls))
        launcher.events.append(f"switch {','.join(urls) or '-'}")

    actuator = ManagedActuator(
        launcher,
        settings=ManagedSettings(
            mode=mode,
            switch_grace_s=0.0,
            drain_poll_s=0.0,
            canary=CanarySettings(requests=3, max_slowdown=max_slowdown, exactness=exactness),
        ),
        preflight=preflight,
        on_switch=on_switch,
        in_flight=launcher.in_flight,
        timer=launcher.clock,
        transport=launcher.transport(),
    )
    return actuator, switches


def apply(actuator: ManagedActuator, config: SpecConfig, pool: str = "p") -> None:
    asyncio.run(actuator.apply([PoolConfig(pool, config, ())]))


def started(launcher: FakeLauncher, *configs: SpecConfig) -> ManagedActuator:
    actuator, _ = make(launcher)
    for config in configs:
        apply(actuator, config)
    launcher.events.clear()
    return actuator


def test_blue_green_switches_after_the_canary_and_stops_the_old_one_once_drained() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator, switches = make(launcher)
    apply(actuator, NGRAM)
    assert actuator.urls("p") == ("http://i1",) and switches == [("p", ("http://i1",))]
    launcher.events.clear()
    launcher.instances["i1"].in_flight = [2, 1, 0, 3, 0, 0]  # busy, then quiet twice

    apply(actuator, None)

    assert actuator.urls("p") == ("http://i2",) and actuator.config("p") is None
    events = launcher.events
    assert events[0] == "launch off"
    # canaries on the new one, compared with the old one, before traffic moves
    assert events[1:7] == ["canary i2", "canary i1"] * 3
    assert events[7:] == ["switch http://i2", "stop i1"]
    assert launcher.instances["i1"].in_flight == []  # stopped only after two quiet reads


def test_same_config_again_does_nothing() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator = started(launcher, NGRAM)
    apply(actuator, dict(NGRAM))
    assert launcher.events == []


@pytest.mark.parametrize(
    ("launcher_kwargs", "stage", "new_started"),
    [
        ({"fail_start": {"draft_model": "vLLM exited with 1 during start"}}, "start", False),
        ({"behaviour": {"draft_model": {"status": 500}}}, "canary", True),
        ({"behaviour": {"draft_model": {"latency_s": 0.5}}}, "slower", True),
    ],
)
def test_a_failed_rollout_keeps_the_old_instance_serving(
    launcher_kwargs: dict[str, Any], stage: str, new_started: bool, tmp_path: Path
) -> None:
    launcher = FakeLauncher(FakeClock(), **launcher_kwargs)
    target, draft = make_checkpoint(tmp_path / "t"), make_checkpoint(tmp_path / "d")
    actuator, switches = make(launcher, preflight=Preflight({"p": str(target)}))
    apply(actuator, NGRAM)
    launcher.events.clear()
    draft_config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}

    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, draft_config)

    (failure,) = raised.value.failures
    assert (failure.pool, failure.stage, failure.config) == ("p", stage, draft_config)
    assert failure.still_serving and failure.serving == NGRAM
    assert "old instance kept serving" in str(raised.value)
    assert actuator.urls("p") == ("http://i1",) and actuator.config("p") == NGRAM
    assert len(switches) == 1  # only the first start; traffic never moved
    assert not launcher.instances["i1"].stopped
    if new_started:
        assert launcher.instances["i2"].stopped
        assert launcher.events[-1] == "stop i2"


def test_slowdown_is_not_judged_when_comparison_is_off() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"latency_s": 5.0}})
    actuator, _ = make(launcher, max_slowdown=None)
    apply(actuator, None)
    apply(actuator, NGRAM)
    assert actuator.config("p") == NGRAM
    assert "canary i1" not in launcher.events[launcher.events.index("launch ngram") :]


def test_in_place_stops_first_and_restores_the_old_config_on_failure() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"draft_model": {"status": 500}})
    actuator, _ = make(launcher, mode="in_place", preflight=Preflight({"p": "/target"}))
    apply(actuator, NGRAM)
    launcher.events.clear()

    apply(actuator, NGRAM_2)  # succeeds: one instance at a time
    assert launcher.events == [
        "switch -",
        "stop i1",
        "launch ngram",
        *["canary i2"] * 3,
        "switch http://i2",
    ]

    launcher.events.clear()
    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, {"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 2})
    assert launcher.events == []  # the unverifiable draft never started (preflight)
    assert raised.value.failures[0].stage == "preflight"

    launcher.fail_start = {"off": "out of memory"}
    with pytest.raises(RolloutFailed) as raised:
        apply(actuator, None)
    assert launcher.events == [
        "switch -",
        "stop i2",
        "launch off",
        "launch ngram",
        *["canary i3"] * 3,
        "switch http://i3",
    ]
    (failure,) = raised.value.failures
    assert failure.stage == "start" and failure.still_serving and failure.serving == NGRAM_2
    assert actuator.config("p") == NGRAM_2


def test_several_pools_roll_out_independently() -> None:
    launcher = FakeLauncher(FakeClock(), behaviour={"off": {"status": 503}})
    actuator, _ = make(launcher)
    asyncio.run(actuator.apply([PoolConfig("a", NGRAM, ()), PoolConfig("b", NGRAM_2, ())]))
    with pytest.raises(RolloutFailed) as raised:
        asyncio.run(actuator.apply([PoolConfig("a", None, ()), PoolConfig("b", NGRAM, ())]))
    assert [f.pool for f in raised.value.failures] == ["a"]
    assert actuator.running() == {"a": NGRAM, "b": NGRAM}


def test_aclose_stops_everything() -> None:
    launcher = FakeLauncher(FakeClock())
    actuator = started(launcher, NGRAM)
    asyncio.run(actuator.aclose())
    assert launcher.instances["i1"].stopped and actuator.urls("p") == ()


def test_one_config_for_every_concurrency_carries_the_learned_gamma_table(tmp_path: Path) -> None:
    """The fleet turns per-bucket choices into vLLM's batch-size table; the managed
    actuator starts vLLM with exactly that config."""
    from controller.fleet import Fleet
    from tests.controller.conftest import make_settings

    fleet = Fleet(make_settings(tmp_path))  # buckets 1-3 and 4+, max_num_seqs 256
    arms = {
        context: "ngram:4" if context.bucket == "1-3" else "off"
        for context in fleet.contexts
        if context.workload_class == "code"
    }
    pool_config = fleet.pool_config("p", arms)
    launcher = FakeLauncher(FakeClock())
    actuator, _ = make(launcher)
    asyncio.run(actuator.apply([pool_config]))
    config = actuator.config("p")
    assert config is not None
    assert config["num_speculative_tokens"] == 4
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 256, 0]]
    assert launcher.instances["i1"].config == config
