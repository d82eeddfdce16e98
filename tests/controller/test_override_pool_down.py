"""``SpecpilotOverridePoolDown``: an override in force pins an arm whose pool has no
instance up. The instances are ``httpx.MockTransport`` hosts as in test_instances.py;
the loop, the store and the API are real, on an injected clock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.actions import ACTIONS
from controller.instances import InstanceHealth
from controller.override_pools import OVERRIDE_POOL_DOWN
from controller.service import Service, build_service
from controller.settings import Settings
from controller.store.records import AlertRecord, OverrideRecord, Scope
from tests.controller.fakes import QueueSource, ScriptedPolicy
from tests.controller.test_instances import A1, A2, Clock, Instances, Served

PLAIN, FAST = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def routing_settings(tmp_path: Path) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": tmp_path / "data",
            "classes": ["code", "chat"],
            "buckets": [1, 4],
            "scrape_interval_s": 10.0,
            "alerting": {"instance_down_after_s": 15.0},
            "actuators": {"mode": "routing"},
            "fleet": {
                "pools": {
                    "plain": {"model": "m", "instances": [PLAIN]},
                    "fast": {
                        "model": "m",
                        "instances": [FAST],
                        "proposers": {"ngram": {"method": "ngram", "gamma": [4, 4]}},
                        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
                    },
                }
            },
        }
    )


class Routed:
    """A routing-mode service probing mock instances, on a test clock."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.fleet = Instances()
        self.fleet.set(PLAIN, ["m"])
        self.fleet.set(FAST, ["m"])
        settings = routing_settings(tmp_path)
        self.service: Service = build_service(
            settings, ScriptedPolicy(settings.buckets), QueueSource(), clock=self.clock
        )
        self.service.instances = self.service.loop.instances = InstanceHealth(
            settings,
            self.service.placements,
            self.service.metrics,
            clock=self.clock,
            client=self.fleet.client(),
        )
        self.loop = self.service.loop
        asyncio.run(self.loop.start())

    def tick(self, after_s: float = 10.0) -> None:
        self.clock.now += after_s
        asyncio.run(self.loop.tick())

    def pin(self, override_id: str, config: dict[str, Any]) -> None:
        self.service.store.add_override(
            OverrideRecord(
                override_id,
                self.clock.now,
                self.clock.now + 3600,
                Scope(workload_class="code"),
                config,
                "incident 7",
            )
        )

    def alerts(self) -> list[AlertRecord]:
        return [a for a in self.service.store.alerts(limit=100) if a.name == OVERRIDE_POOL_DOWN]

    def close(self) -> None:
        asyncio.run(self.loop.shutdown())
        self.service.close()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[Routed]:
    running = Routed(tmp_path)
    try:
        yield running
    finally:
        running.close()


NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4}


def test_a_pin_on_a_dead_pool_fires_once_and_resolves_when_the_pool_is_back(
    routed: Routed, caplog: pytest.LogCaptureFixture
) -> None:
    routed.pin("ov-1", NGRAM4)
    routed.tick()
    routed.fleet.set(FAST, None)  # n-gram's only instance refuses connections
    routed.tick()
    assert routed.alerts() == []  # down for 0 s: not yet
    with caplog.at_level(logging.INFO, logger=ACTIONS.name):
        routed.tick()
        routed.tick()  # 20 s >= 15 s
        routed.tick()  # still down: not raised twice
    [alert] = routed.alerts()
    assert (alert.context, alert.severity, alert.resolved_at) == (
        "pool=fast,override=ov-1",
        "warning",
        None,
    )
    assert "override ov-1 (incident 7) pins ngram:4" in alert.message
    assert "pool fast has no instance up" in alert.message
    raised = [r for r in caplog.records if getattr(r, "action", None) == "alert_raised"]
    assert [r.fields["alert"] for r in raised].count(OVERRIDE_POOL_DOWN) == 1
    registry = routed.service.registry
    assert registry.get_sample_value("specpilot_alerts_total", {"alert": OVERRIDE_POOL_DOWN}) == 1
    routed.fleet.set(FAST, ["m"])
    routed.tick()
    [alert] = routed.alerts()
    assert alert.resolved_at == routed.clock.now


def test_it_resolves_when_the_override_ends_and_a_pin_on_a_live_pool_raises_nothing(
    routed: Routed,
) -> None:
    routed.pin("ov-off", {"method": "off"})  # the off pool is up throughout
    routed.fleet.set(FAST, None)
    for _ in range(4):
        routed.tick()
    assert routed.alerts() == []
    routed.pin("ov-2", NGRAM4)  # newer, same scope: it wins
    for _ in range(3):
        routed.tick()
    [alert] = routed.alerts()
    assert alert.context == "pool=fast,override=ov-2" and alert.resolved_at is None
    routed.service.store.delete_override("ov-2", routed.clock.now)
    routed.tick()
    [alert] = routed.alerts()
    assert alert.resolved_at == routed.clock.now


def test_a_restart_keeps_it_firing_without_raising_it_again(tmp_path: Path) -> None:
    first = Routed(tmp_path)
    first.pin("ov-3", NGRAM4)
    first.fleet.set(FAST, None)
    for _ in range(4):
        first.tick()
    assert len(first.alerts()) == 1
    first.close()
    second = Routed(tmp_path)
    try:
        second.fleet.set(FAST, None)
        for _ in range(4):
            second.tick()
        [alert] = second.alerts()
        assert alert.resolved_at is None
        second.fleet.set(FAST, ["m"])
        second.tick()
        [alert] = second.alerts()
        assert alert.resolved_at is not None
    finally:
        second.close()


def test_in_push_mode_the_pools_of_the_pinned_contexts_count(tmp_path: Path) -> None:
    """Push mode: the pinned config runs on the pools serving the pinned contexts."""
    served = Served(tmp_path)
    try:
        served.fleet.set(A1, ["m"])
        served.fleet.set(A2, ["m"])  # pool a (code) up; pool b (chat) refuses
        served.service.store.add_override(
            OverrideRecord(
                "ov-b", served.clock.now, served.clock.now + 3600,
                Scope(workload_class="chat"), {"method": "off"}, "quiet chat",
            )
        )  # fmt: skip
        for _ in range(3):
            served.tick()
        alerts = [a for a in served.service.store.alerts() if a.name == OVERRIDE_POOL_DOWN]
        assert [(a.context, a.resolved_at) for a in alerts] == [("pool=b,override=ov-b", None)]
    finally:
        served.close()
