"""The control loop, isolated from the real policy and collectors.

The policy and the collector here are the fakes of ``tests/controller/fakes.py``, used
ONLY to isolate the loop's own logic (ordering of record and act, overrides, freeze,
guard rails, measurement, restart, leadership, outages); the store, the file actuator
and PostgreSQL are real.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.file import FileActuator
from controller.contexts import Context
from controller.fleet import PoolConfig
from controller.ports import Collected, InstanceSeen
from controller.service import Service, build_service
from controller.settings import Settings, StoreSettings
from controller.store.db import Store
from controller.store.leader import AdvisoryLockLeader
from controller.store.records import OverrideRecord, Scope
from tests.controller.conftest import PgDatabase, make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy, observation
from tests.controller.test_settings_modes import routing

CODE_LOW = Context("m", "code", "1-3")
CODE_HIGH = Context("m", "code", "4+")
CHAT_LOW = Context("m", "chat", "1-3")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingActuator:
    """Remembers what it was handed and which decisions the store held at that moment."""

    name = "recording"

    def __init__(self, store: Store | None = None) -> None:
        self.store = store
        self.calls: list[tuple[list[PoolConfig], list[str]]] = []

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        try:
            arms = [d.arm for d in self.store.decisions().decisions] if self.store else []
        except Exception:  # the store is down (outage test): the loop must act anyway
            arms = []
        self.calls.append((list(configs), arms))


class Harness:
    def __init__(self, settings: Settings, leadership: Any = None, *, exclusive: bool = False):
        self.clock = Clock()
        self.policy = ScriptedPolicy(settings.buckets)
        self.source = QueueSource(exclusive=exclusive)
        self.actuator = RecordingActuator()
        self.service: Service = build_service(
            settings,
            self.policy,
            self.source,
            actuators=[self.actuator, FileActuator(settings.actuator_dir)],
            leadership=leadership,
            clock=self.clock,
        )
        self.actuator.store = self.service.store
        self.store = self.service.store
        self.loop = self.service.loop
        asyncio.run(self.loop.start())

    def tick(self, at: float | None = None) -> None:
        if at is not None:
            self.clock.now = at
        asyncio.run(self.loop.tick())

    def decisions(self) -> list[Any]:
        return list(self.store.decisions(limit=100).decisions)

    def close(self) -> None:
        self.service.close()


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    h = Harness(make_settings(tmp_path))
    yield h  # type: ignore[misc]
    h.close()


def test_first_tick_pushes_every_pool_and_records_nothing_without_change(harness: Harness) -> None:
    harness.tick()
    assert harness.decisions() == []
    [(configs, _)] = harness.actuator.calls
    assert configs[0].pool == "p" and configs[0].config is None
    assert json.loads((harness.service.settings.actuator_dir / "p.json").read_text()) is None


def test_decision_is_recorded_before_the_actuators_act(harness: Harness) -> None:
    harness.tick()
    harness.policy.script[CODE_LOW] = "ngram:3"
    harness.tick(1010.0)
    [decision] = harness.decisions()
    assert (decision.context, decision.arm, decision.previous_arm) == (CODE_LOW, "ngram:3", "off")
    assert decision.actor == "policy" and decision.predicted_speedup == 1.5
    configs, arms_in_store_when_acting = harness.actuator.calls[-1]
    assert arms_in_store_when_acting == ["ngram:3"]
    expected = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 256, 0]],
    }
    assert configs[0].config == expected
    path = harness.service.settings.actuator_dir / "p.json"
    assert json.loads(path.read_text()) == expected
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no temporary left over


def test_metrics_show_the_running_arms_prediction_and_events_that_have_not_happened(
    harness: Harness,
) -> None:
    registry = harness.service.registry
    labels = {"model_name": "m", "workload_class": "code", "bucket": "1-3"}

    def sample(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, labels | extra)

    harness.tick()
    # Counters of known labels start at 0: Prometheus' increase() sees the first event.
    zero = [
        ("specpilot_alerts_total", {"alert": "ExactnessBroken"}),
        ("specpilot_decisions_total", {"actor": "operator"}),
        ("specpilot_guard_rail_rejections_total", {"rule": "min_dwell"}),
        ("specpilot_actuations_total", {"actuator": "recording", "outcome": "error"}),
    ]
    for name, zero_labels in zero:
        assert registry.get_sample_value(name, zero_labels) == 0, name
    assert sample("specpilot_context_arm", arm="off") == 1
    assert sample("specpilot_context_predicted_speedup") == 1.0  # off, by definition
    # The policy decides ngram:3; until vLLM shows it running, the context runs off.
    harness.policy.script[CODE_LOW] = "ngram:3"
    harness.tick(1010.0)
    assert [d.arm for d in harness.decisions()] == ["ngram:3"]
    assert sample("specpilot_context_arm", arm="off") == 1
    assert sample("specpilot_context_predicted_speedup") == 1.0
    # The instance restarted into it: the running arm's prediction is shown.
    harness.source.batches.append(
        Collected(instances=[InstanceSeen("p", "http://127.0.0.1:9", 3, True, 1015.0)])
    )
    harness.tick(1020.0)
    assert sample("specpilot_context_arm", arm="ngram:3") == 1
    assert sample("specpilot_context_arm", arm="off") is None
    assert sample("specpilot_context_predicted_speedup") == 1.5
    del harness.policy.script[CODE_LOW]  # the policy predicts nothing for it any more
    harness.tick(1030.0)
    assert sample("specpilot_context_predicted_speedup") is None


def test_chat_decisions_do_not_touch_a_pool_whose_primary_class_is_code(harness: Harness) -> None:
    harness.tick()
    harness.policy.script[CHAT_LOW] = "tiny:2"
    harness.tick(1010.0)
    assert [d.context for d in harness.decisions()] == [CHAT_LOW]
    assert len(harness.actuator.calls) == 1  # only the first, full push


def test_override_pins_then_hands_back_when_it_expires(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpilot.actions")
    harness.store.add_override(
        OverrideRecord(
            "o1",
            1000.0,
            1100.0,
            Scope("*", "code", "*"),
            {"method": "ngram", "num_speculative_tokens": 2},
            "incident 42",
        )
    )
    harness.policy.script[CODE_LOW] = "tiny:2"
    harness.tick(1010.0)
    pinned = {d.context: d for d in harness.decisions()}
    assert set(pinned) == {CODE_LOW, CODE_HIGH}
    assert all(d.actor == "operator" and d.arm == "ngram:2" for d in pinned.values())
    assert pinned[CODE_LOW].reason == "override"
    assert "incident 42" in pinned[CODE_LOW].detail
    assert harness.policy.pins == {CODE_LOW: "ngram:2", CODE_HIGH: "ngram:2"}
    harness.tick(1200.0)  # expired
    newest = harness.decisions()[:2]
    back = {d.context: d for d in newest}
    assert back[CODE_LOW].arm == "tiny:2" and back[CODE_LOW].actor == "policy"
    assert back[CODE_LOW].reason == "override_ended"
    assert back[CODE_LOW].detail == "then plugin: scripted"
    assert harness.policy.pins == {}
    logged = [r.getMessage() for r in caplog.records if r.name == "specpilot.actions"]
    assert [line.split(" [")[0] for line in logged if line.startswith("override_")] == [
        "override_set: override o1 in force: incident 42",
        "override_ended: override o1 expired: incident 42",
    ]


def test_most_specific_override_wins(harness: Harness) -> None:
    broad = Scope("*", "*", "*")
    narrow = Scope("m", "code", "1-3")
    harness.store.add_override(OverrideRecord("n", 999.0, 2000.0, narrow, {"method": "off"}, "n"))
    harness.store.add_override(
        OverrideRecord(
            "b", 1000.0, 2000.0, broad, {"method": "ngram", "num_speculative_tokens": 4}, "b"
        )
    )
    harness.tick(1010.0)
    arms = {d.context: d.arm for d in harness.decisions()}
    assert CODE_LOW not in arms  # already off: pinned off, no change to record
    assert harness.loop.arms[CODE_LOW] == "off"
    assert arms[CODE_HIGH] == "ngram:4" and arms[CHAT_LOW] == "ngram:4"


def test_freeze_stops_learning_and_pushing(harness: Harness) -> None:
    harness.store.set_state("frozen", True, now=0.0)
    harness.source.batches.append(Collected((observation("off", 0.02),)))
    harness.policy.script[CODE_LOW] = "ngram:3"
    harness.tick(1010.0)
    assert harness.policy.observed == 0 and harness.decisions() == []
    assert harness.store.count_observations() == 1  # still recorded
    harness.store.set_state("frozen", False, now=0.0)
    harness.tick(1020.0)
    assert [d.arm for d in harness.decisions()] == ["ngram:3"]


def test_guard_rails(tmp_path: Path) -> None:
    h = Harness(make_settings(tmp_path, min_dwell_s=60))
    try:
        h.policy.script[CODE_LOW] = "eagle3:2"  # no such proposer on the pool
        h.tick(1000.0)
        assert h.decisions() == []
        h.policy.script[CODE_LOW] = "ngram:9"  # out of the proposer's γ range
        h.tick(1001.0)
        assert h.decisions() == []
        h.policy.script[CODE_LOW] = "ngram:2"
        h.tick(1002.0)
        h.policy.script[CODE_LOW] = "ngram:4"
        h.tick(1030.0)  # within the dwell time
        assert [d.arm for d in h.decisions()] == ["ngram:2"]
        h.tick(1063.0)
        assert [d.arm for d in h.decisions()] == ["ngram:4", "ngram:2"]
        text = h.service.registry.get_sample_value(
            "specpilot_guard_rail_rejections_total", {"rule": "not_runnable"}
        )
        assert text == 2
    finally:
        h.close()


def test_measured_speedup_is_filled_in_after_the_wait(harness: Harness) -> None:
    harness.source.batches.append(Collected(tuple(observation("off", 0.020) for _ in range(4))))
    harness.tick(1000.0)  # off is the only arm observed: stays
    harness.policy.script[CODE_LOW] = "ngram:3"
    harness.tick(1001.0)
    harness.source.batches.append(Collected(tuple(observation("ngram:3", 0.010) for _ in range(3))))
    harness.tick(1005.0)  # too early
    assert harness.decisions()[0].measured_speedup is None
    harness.tick(1012.0)
    assert harness.decisions()[0].measured_speedup == pytest.approx(2.0)


def test_restart_restores_arms_and_learned_state(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    first = Harness(settings)
    first.source.batches.append(Collected((observation("ngram:2", 0.01), observation("off", 0.02))))
    first.tick(1000.0)
    assert [d.arm for d in first.decisions()] == ["ngram:2"]
    learned = first.policy.state_dict()
    first.close()  # no shutdown: as after kill -9, only what the loop wrote synchronously
    second = Harness(settings)
    try:
        assert second.loop.arms[CODE_LOW] == "ngram:2"
        assert second.policy.state_dict() == learned
        second.tick(1001.0)
        assert len(second.decisions()) == 1  # nothing to redo
    finally:
        second.close()


def test_shutdown_saves_state_and_closes_the_source(harness: Harness) -> None:
    class Draining(QueueSource):
        async def collect(self) -> Collected:
            batch = await super().collect()
            self.drained.set()
            return batch

    async def run() -> None:
        source = Draining()
        source.drained = asyncio.Event()
        source.batches.append(Collected((observation("off", 0.02),)))
        harness.loop.source = harness.source = source
        stop = asyncio.Event()
        task = asyncio.create_task(harness.loop.run(stop))
        await source.drained.wait()
        stop.set()
        await task

    asyncio.run(run())
    assert harness.source.closed
    snapshot = harness.store.latest_snapshot()
    assert snapshot is not None and snapshot[1] == harness.policy.state_dict()


class Follower:
    is_leader = False

    def __init__(self) -> None:
        self.leading = False

    def check(self) -> bool:
        return self.leading

    def release(self) -> None:
        pass


def test_follower_reads_and_takes_over_warm(tmp_path: Path) -> None:
    leadership = Follower()
    h = Harness(make_settings(tmp_path), leadership=leadership)
    try:
        h.source.batches.append(Collected((observation("off", 0.02),)))
        h.policy.script[CODE_LOW] = "ngram:3"
        h.tick(1000.0)
        assert h.decisions() == [] and len(h.source.batches) == 1  # follows: no collect
        # The leader (another replica) decided and saved its learning.
        other = ScriptedPolicy()
        other.tpot = {"m/code/1-3|tiny:2": [0.03, 3]}
        h.store.save_snapshot(1000.5, other.state_dict())
        h.store.record_decision(h.loop._decision(CODE_LOW, _target("tiny:2"), 1000.5))
        h.store.add_override(OverrideRecord("o", 1000.6, 2000.0, Scope(), {"method": "off"}, "r"))
        h.tick(1001.0)
        assert h.loop.arms[CODE_LOW] == "tiny:2" and h.policy.tpot == other.tpot
        assert [o.id for o in h.loop.overrides] == ["o"]  # the follower's API shows them
        h.store.delete_override("o", now=1001.5)
        leadership.leading = True
        h.tick(1002.0)
        assert h.decisions()[0].arm == "ngram:3" and h.decisions()[0].previous_arm == "tiny:2"
        assert len(h.actuator.calls) == 1  # the new leader pushes every pool once
    finally:
        h.close()


def test_followers_hand_their_gateways_observations_to_the_leader(
    tmp_path: Path, pg: PgDatabase
) -> None:
    """Two replicas on one PostgreSQL, each with its own gateway (an exclusive source):
    what the follower's gateway served reaches the leader's policy, once."""
    leader = Harness(
        make_settings(tmp_path / "a", pg.url), AdvisoryLockLeader(pg.url), exclusive=True
    )
    follower = Harness(
        make_settings(tmp_path / "b", pg.url), AdvisoryLockLeader(pg.url), exclusive=True
    )
    try:
        leader.tick(1000.0)
        follower.tick(1000.0)
        assert leader.loop.is_leader and not follower.loop.is_leader
        served = observation("ngram:3", 0.01, finished_at=1000.5)
        follower.source.batches.append(Collected((served, observation("off", 0.02))))
        leader.source.batches.append(Collected((observation("off", 0.03),)))
        follower.tick(1001.0)
        assert not follower.source.batches  # collected, not left to pile up
        assert follower.policy.observed == 0  # a follower does not learn
        leader.tick(1002.0)
        assert leader.policy.observed == 3
        assert leader.policy.mean(CODE_LOW, "ngram:3") == 0.01
        assert leader.store.count_observations() == 3
        leader.tick(1003.0)
        assert leader.policy.observed == 3  # taken once
    finally:
        follower.close()
        leader.close()


def test_a_follower_leaves_a_shared_source_to_the_leader(tmp_path: Path) -> None:
    """A source every replica sees (scraping the fleet) is the leader's to read."""
    h = Harness(make_settings(tmp_path), leadership=Follower())
    try:
        h.source.batches.append(Collected((observation("off", 0.02),)))
        h.tick(1000.0)
        assert len(h.source.batches) == 1 and h.store.take_handed_over() == []
    finally:
        h.close()


def _target(arm: str) -> Any:
    from controller.loop import Target

    return Target(arm, "other replica", "policy")


def test_loop_keeps_deciding_through_a_postgresql_outage(tmp_path: Path, pg: PgDatabase) -> None:
    h = Harness(make_settings(tmp_path, pg.url), leadership=AdvisoryLockLeader(pg.url))
    try:
        h.tick(1000.0)
        assert h.loop.is_leader
        pg.refuse_logins()
        h.policy.script[CODE_LOW] = "ngram:3"
        h.source.batches.append(Collected((observation("off", 0.02),)))
        h.tick(1010.0)
        assert h.loop.is_leader and h.loop.arms[CODE_LOW] == "ngram:3"
        assert h.actuator.calls[-1][0][0].config is not None  # acted
        registry = h.service.registry
        assert registry.get_sample_value("specpilot_store_up") == 0
        assert registry.get_sample_value("specpilot_store_buffered_records") >= 2
        h.policy.script[CODE_LOW] = "ngram:4"
        h.tick(1020.0)
        pg.allow_logins()
        h.tick(1030.0)
        assert [d.arm for d in h.decisions()] == ["ngram:4", "ngram:3"]
        assert h.store.count_observations() == 1
        assert registry.get_sample_value("specpilot_store_up") == 1
        assert registry.get_sample_value("specpilot_store_buffered_records") == 0
        assert not (h.service.settings.data_dir / "journal.jsonl").exists()  # all stored
    finally:
        pg.allow_logins()
        asyncio.run(h.loop.shutdown())
        h.close()


def test_decisions_made_during_an_outage_survive_a_crash(tmp_path: Path, pg: PgDatabase) -> None:
    settings = make_settings(tmp_path, pg.url)
    first = Harness(settings, leadership=AdvisoryLockLeader(pg.url))
    try:
        first.tick(1000.0)
        pg.refuse_logins()
        first.policy.script[CODE_LOW] = "ngram:3"
        first.tick(1010.0)
        assert first.loop.arms[CODE_LOW] == "ngram:3"  # decided and acted, store away
        journal = settings.data_dir / "journal.jsonl"
        assert journal.exists()
    finally:
        first.loop.leadership.release()
        first.close()  # crash: the in-memory buffer is gone, nothing was flushed
    pg.allow_logins()
    second = Harness(settings, leadership=AdvisoryLockLeader(pg.url))
    try:
        [decision] = second.decisions()
        assert (decision.context, decision.arm, decision.ts) == (CODE_LOW, "ngram:3", 1010.0)
        assert second.loop.arms[CODE_LOW] == "ngram:3"
        assert not journal.exists()
        second.loop.journal.append(decision)  # a replay after a flush stores nothing twice
        asyncio.run(second.loop.start())
        assert len(second.decisions()) == 1
    finally:
        second.loop.leadership.release()
        second.close()


def test_old_observations_are_rolled_up_by_the_loop(tmp_path: Path) -> None:
    base = make_settings(tmp_path)
    settings = base.model_copy(
        update={"store": StoreSettings(observation_retention_s=60, rollup_period_s=60)}
    )
    h = Harness(settings)
    try:
        old = tuple(observation("off", 0.02, finished_at=1000.0 + i) for i in range(5))
        h.source.batches.append(Collected(old))
        h.tick(1010.0)
        assert h.store.count_observations() == 5  # still within the retention
        h.tick(1200.0)
        assert h.store.count_observations() == 0
        [row] = h.store.stats(since=0.0)
        assert (row.requests, row.mean_tpot_s) == (5, pytest.approx(0.02))
    finally:
        h.close()


def test_a_stored_arm_the_fleet_no_longer_offers_is_not_restored(tmp_path: Path) -> None:
    first = Harness(make_settings(tmp_path))
    first.policy.script[CODE_LOW] = "tiny:3"
    first.tick(1000.0)
    first.close()
    narrower = make_settings(tmp_path)
    pool = narrower.fleet.pools["p"].model_copy(
        update={"proposers": {"ngram": narrower.fleet.pools["p"].proposers["ngram"]}}
    )
    fleet = narrower.fleet.model_copy(update={"pools": {"p": pool}})
    second = Harness(narrower.model_copy(update={"fleet": fleet}))
    try:
        assert second.loop.arms[CODE_LOW] == "off"  # what pool p runs, not the dropped draft
        second.tick(1001.0)  # raises if it tried to push the unknown proposer
        assert second.actuator.calls[-1][0][0].config is None
    finally:
        second.close()


def test_routed_share_counts_the_requests_finished_since_the_arm_changed(tmp_path: Path) -> None:
    """Routing mode's ``routed_requests`` and ``explored_share``: a request the gateway
    hands over after the decision but that finished before it belongs to the old arm's
    share, not the new one's, however late its batch arrives."""
    settings = Settings(
        data_dir=tmp_path / "data",
        classes=["code", "chat"],
        buckets=[1, 4],
        policy={"min_dwell_s": 0},
        **routing(),
    )
    harness = Harness(settings)
    try:
        harness.tick(1000.0)
        harness.policy.script[CODE_LOW] = "ngram:4"
        harness.tick(1010.0)
        assert harness.loop.changed_at[CODE_LOW] == 1010.0
        late = observation("off", 0.02, finished_at=1009.9)
        after = [observation("ngram:4", 0.01, finished_at=1010.5 + i) for i in range(3)]
        explored = observation("off", 0.02, finished_at=1011.0)
        harness.source.batches.append(Collected((late, *after, explored)))
        harness.tick(1012.0)
        share = harness.loop.routes[CODE_LOW]
        assert (share.requests, share.elsewhere) == (4, 1)
    finally:
        harness.close()


def test_a_failover_is_counted_and_logged_as_one_not_as_exploration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request the table routed to n-gram that the gateway served on the off pool
    (n-gram's had no instance up) is a failover: ``failover_share``, its metric and an
    action line say so, and ``explored_share`` holds only what the table explored."""
    settings = Settings(
        data_dir=tmp_path / "data",
        classes=["code", "chat"],
        buckets=[1, 4],
        policy={"min_dwell_s": 0},
        **routing(),
    )
    harness = Harness(settings)
    try:
        harness.tick(1000.0)
        harness.policy.script[CODE_LOW] = "ngram:4"
        harness.tick(1010.0)
        served = [observation("ngram:4", 0.01, finished_at=1010.5 + i) for i in range(2)]
        explored = replace(observation("off", 0.02, finished_at=1011.0), routed_arm="off")
        failed_over = replace(
            observation("off", 0.02, finished_at=1011.5), routed_arm="ngram:4", pool="plain"
        )
        harness.source.batches.append(Collected((*served, explored, failed_over)))
        with caplog.at_level(logging.INFO, logger="specpilot.actions"):
            harness.tick(1012.0)
        share = harness.loop.routes[CODE_LOW]
        assert (share.requests, share.elsewhere, share.failovers) == (4, 1, 1)
        assert (share.explored, share.failed_over) == (0.25, 0.25)
        labels = {"model_name": "m", "workload_class": "code", "bucket": "1-3"}
        registry = harness.service.metrics.registry
        assert registry.get_sample_value("specpilot_context_failover_ratio", labels) == 0.25
        assert registry.get_sample_value("specpilot_context_explored_ratio", labels) == 0.25
        (line,) = [r for r in caplog.records if getattr(r, "action", None) == "failover"]
        assert line.levelno == logging.WARNING
        assert line.fields == {"routed_arm": "ngram:4", "served_pool": "plain", "requests": 1}
    finally:
        harness.close()


def test_a_push_vllm_never_shows_raises_push_not_applied_until_it_does(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpilot.actions")
    registry = harness.service.registry
    instance = "http://127.0.0.1:9"

    def shows(positions: int, at: float, *, restarted: bool = False) -> None:
        harness.source.batches.append(
            Collected(instances=[InstanceSeen("p", instance, positions, restarted, at)])
        )

    def firing() -> list[str]:
        return [a.message for a in harness.store.alerts(unresolved_only=True)]

    shows(0, 999.0)
    harness.tick()
    harness.policy.script[CODE_LOW] = "ngram:3"
    harness.policy.script[CODE_HIGH] = "ngram:3"
    harness.tick(1010.0)  # decided and handed to the file actuator
    assert registry.get_sample_value("specpilot_push_applied", {"pool": "p"}) == 0
    for at in (1100.0, 1200.0, 1300.0):
        shows(0, at)  # vLLM runs no speculation: no spec-decode series
        harness.tick(at)
    assert firing() == []  # within actuators.confirm_within_s (300 s)
    shows(0, 1311.0)
    harness.tick(1311.0)
    [message] = firing()
    assert "pushed ngram:3, running off" in message
    [alert] = harness.store.alerts(unresolved_only=True)
    assert (alert.name, alert.context) == ("SpecpilotPushNotApplied", "pool=p")
    # Windows of this time are the running arm's: the policy learned nothing of ngram:3.
    assert harness.loop.running_arm(CODE_LOW) == "off"
    shows(0, 1320.0)
    harness.tick(1320.0)
    assert len(harness.store.alerts()) == 1  # raised once, not every iteration
    # The orchestrator restarts vLLM with it at last: confirmed, resolved.
    shows(3, 1330.0, restarted=True)
    harness.tick(1330.0)
    assert firing() == []
    assert harness.loop.running_arm(CODE_LOW) == "ngram:3"
    assert registry.get_sample_value("specpilot_push_applied", {"pool": "p"}) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "specpilot.actions"]
    assert any(line.startswith("push_not_applied: pool p: pushed ngram:3") for line in logged)
    assert any(line.startswith("alert_raised: SpecpilotPushNotApplied") for line in logged)
    assert any(line.startswith("push_confirmed: p: vLLM reports ngram:3") for line in logged)
    assert any(line.startswith("alert_resolved: SpecpilotPushNotApplied") for line in logged)
