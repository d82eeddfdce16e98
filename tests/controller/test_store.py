"""The store on SQLite and PostgreSQL: migrations, records, roll-up, outages."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from controller.contexts import Context
from controller.store.buffer import BufferedWriter
from controller.store.db import Store, StoreUnavailable
from controller.store.journal import Journal
from controller.store.models import Base
from controller.store.records import (
    AlertRecord,
    Alternative,
    DecisionRecord,
    ObservationRecord,
    OverrideRecord,
    Scope,
    WindowStatRecord,
)
from tests.controller.conftest import PgDatabase, free_port

CODE = Context("m", "code", "1")
CHAT = Context("m", "chat", "2-3")


@pytest.fixture
def store(store_url: str) -> Store:
    store = Store.open(store_url)
    yield store  # type: ignore[misc]
    store.close()


def test_migrations_create_the_models_schema(store: Store) -> None:
    with store.engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == []
        tables = set(inspect(connection).get_table_names())
    assert {"decisions", "overrides", "alerts", "observations", "policy_snapshots"} <= tables
    store.migrate()  # idempotent


def test_replicas_starting_together_migrate_one_after_the_other(pg: PgDatabase) -> None:
    """A Deployment's pods open a fresh PostgreSQL schema at once: each must come up."""
    opened: list[Store] = []
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            opened.append(Store.open(pg.url))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_store, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a migration never finished"
    for store in opened:
        store.close()
    assert errors == [] and len(opened) == 4


def test_handed_over_observations_are_taken_once_in_order(store: Store) -> None:
    full = RequestObservation(
        model="m",
        prompt_tokens=300,
        output_tokens=48,
        ttft_s=0.04,
        mean_itl_s=0.0015,
        generation_time_s=0.07,
        spec=SpecDecodeRequestStats(11, 44, 30, (10, 8, 7, 5)),
        workload_class="code",
        pool="p",
        arm="ngram:4",
        concurrency=3,
        finished_at=1000.5,
        e2e_s=0.12,
    )
    bare = RequestObservation("m", None, None, None, None, None, None)
    store.hand_over([full.to_json(), bare.to_json()], ts=1000.0)
    store.hand_over([bare.to_json()], ts=1001.0)
    taken = store.take_handed_over(limit=2)
    assert [RequestObservation.from_json(o) for o in taken] == [full, bare]
    assert len(store.take_handed_over()) == 1
    assert store.take_handed_over() == []
    store.hand_over([bare.to_json()], ts=1000.0)
    store.hand_over([bare.to_json()], ts=2000.0)
    assert store.purge_handed_over(before=1500.0) == 1
    assert len(store.take_handed_over()) == 1


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path}/d/s.db")
    with store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    store.close()


def decision(ts: float, arm: str, previous: str | None, context: Context = CODE) -> DecisionRecord:
    return DecisionRecord(
        ts=ts,
        context=context,
        arm=arm,
        previous_arm=previous,
        reason="r",
        actor="policy",
        predicted_speedup=1.3,
    )


def test_decisions_newest_first_paginated(store: Store) -> None:
    arms = ["ngram:2", "ngram:3", "ngram:4", "off", "ngram:5"]
    for i, arm in enumerate(arms):
        store.record_decision(decision(100.0 + i, arm, arms[i - 1] if i else None))
    store.record_decision(decision(200.0, "ngram:1", None, CHAT))
    first = store.decisions(limit=4)
    assert [d.arm for d in first.decisions] == ["ngram:1", "ngram:5", "off", "ngram:4"]
    assert first.next_before is not None
    second = store.decisions(limit=4, before=first.next_before)
    assert [d.arm for d in second.decisions] == ["ngram:3", "ngram:2"]
    assert second.next_before is None
    latest = store.latest_decisions()
    assert latest[CODE].arm == "ngram:5" and latest[CHAT].arm == "ngram:1"
    store.set_measured_speedup(CODE, 104.0, 1.21)
    assert store.decisions(limit=1, context=CODE).decisions[0].measured_speedup == 1.21


def test_a_decision_keeps_its_detail_and_alternatives(store: Store, tmp_path: Path) -> None:
    alternatives = (Alternative("off", 1.0, 1.0, 1.0), Alternative("ngram:2", 1.4, 1.1, 1.7))
    made = dataclasses.replace(
        decision(100.0, "ngram:2", "off"), detail="predicted 1.40x", alternatives=alternatives
    )
    store.record_decision(made)
    [got] = store.decisions(limit=1).decisions
    assert (got.detail, got.alternatives) == ("predicted 1.40x", alternatives)
    # What the journal keeps while the store is away comes back the same.
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append(made)
    [replayed] = journal.entries()
    assert replayed == dataclasses.replace(made, id=None)


def test_overrides_expire_and_delete(store: Store) -> None:
    scope = Scope("*", "code", "*")
    store.add_override(OverrideRecord("a", 0.0, 600.0, scope, {"method": "off"}, "incident 42"))
    store.add_override(
        OverrideRecord(
            "b", 1.0, 60.0, Scope(), {"method": "ngram", "num_speculative_tokens": 3}, "x"
        )
    )
    assert [o.id for o in store.active_overrides(now=30.0)] == ["a", "b"]
    assert [o.id for o in store.active_overrides(now=61.0)] == ["a"]
    got = store.active_overrides(now=0.5)[0]
    assert got.scope == scope and got.config == {"method": "off"} and got.reason == "incident 42"
    assert store.delete_override("a", now=100.0) is True
    assert store.delete_override("a", now=101.0) is False
    assert store.delete_override("b", now=100.0) is False  # already expired
    assert store.active_overrides(now=100.0) == []


def test_alerts_snapshots_state(store: Store) -> None:
    store.record_alert(AlertRecord(5.0, "AcceptanceDrift", "warning", "0.8 → 0.4", "m/code/1"))
    assert store.alerts()[0].message == "0.8 → 0.4"
    assert store.latest_snapshot() is None
    for i in range(5):
        store.save_snapshot(float(i), {"n": i, "arms": {"m/code/1": [1, 2]}}, keep=3)
    assert store.latest_snapshot() == (4.0, {"n": 4, "arms": {"m/code/1": [1, 2]}})
    assert store.get_state("frozen", False) is False
    store.set_state("frozen", True, now=1.0)
    store.set_state("frozen", {"by": "op"}, now=2.0)
    assert store.get_state("frozen") == {"by": "op"}
    store.add_window_stats([WindowStatRecord(1.0, "p", "http://i", "m", 15.0, 0.7, 2.1)])
    store.add_window_stats([WindowStatRecord(2.0, "p", "http://i", "m", 15.0, 0.6, 2.0)])
    assert [w.acceptance_rate for w in store.latest_window_stats()] == [0.6]


def observations(start: float, n: int, arm: str = "ngram:3") -> list[ObservationRecord]:
    return [
        ObservationRecord(
            ts=start + i,
            context=CODE,
            arm=arm,
            pool="p",
            output_tokens=100,
            tpot_s=0.01 * (1 + i % 3),
            ttft_s=0.1,
            acceptance_rate=0.5 + 0.1 * (i % 2),
            mean_acceptance_length=2.0,
        )
        for i in range(n)
    ]


def test_roll_up_bounds_raw_rows_and_keeps_the_figures(store: Store) -> None:
    store.add_observations(observations(0.0, 120))  # two 60 s periods
    store.add_observations(observations(1000.0, 10))
    before = store.stats(since=0.0)
    moved = store.roll_up(now=1000.0, retention_s=500.0, period_s=60.0)
    assert moved == 120
    assert store.count_observations() == 10
    after = store.stats(since=0.0)
    assert len(before) == len(after) == 1
    b, a = before[0], after[0]
    assert (a.requests, a.output_tokens) == (b.requests, b.output_tokens) == (130, 13000)
    assert a.mean_tpot_s == pytest.approx(b.mean_tpot_s)
    assert a.acceptance_rate == pytest.approx(b.acceptance_rate)
    # A second roll-up of later rows adds to the same period rows instead of duplicating.
    assert store.roll_up(now=3000.0, retention_s=500.0, period_s=60.0) == 10
    assert store.stats(since=0.0)[0].requests == 130
    assert store.stats(since=0.0, workload_class="chat") == []


def test_stats_list_buckets_by_concurrency(store: Store) -> None:
    labels = ["32+", "2-3", "16-31", "1", "4-7"]
    store.add_observations(
        [
            dataclasses.replace(row, context=Context("m", "code", label))
            for label in labels
            for row in observations(0.0, 1)
        ]
    )
    rows = store.stats(since=0.0)
    assert [r.context.bucket for r in rows] == ["1", "2-3", "4-7", "16-31", "32+"]


def test_unreachable_store_at_start_is_a_clear_error(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://specpilot:secret@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(StoreUnavailable) as error:
        Store.open(url, connect_timeout_s=1)
    text = str(error.value)
    assert text.startswith("cannot reach the store at postgresql+psycopg://specpilot:***@127.0.0.1")
    assert "secret" not in text
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreUnavailable, match="cannot reach the store at sqlite"):
        Store.open(f"sqlite:///{blocker}/sub/db.sqlite")


def test_writes_are_buffered_during_an_outage_and_flushed(pg: PgDatabase) -> None:
    store = Store.open(pg.url, connect_timeout_s=2)
    dropped: list[int] = []
    writer = BufferedWriter(store, max_records=25, on_drop=dropped.append)
    try:
        assert writer.write(lambda s: s.add_observations(observations(0.0, 5)), records=5)
        pg.refuse_logins()  # kills the pooled sessions and refuses new ones
        assert not writer.write(lambda s: s.record_decision(decision(10.0, "off", "ngram:3")))
        for batch in range(5):
            obs = observations(100.0 * (batch + 1), 10)
            assert not writer.write(
                lambda s, obs=obs: s.add_observations(obs), records=10, droppable=True
            )
        alert = AlertRecord(11.0, "A", "warning", "m")
        assert not writer.write(lambda s: s.record_alert(alert))
        # Bound: 1 decision + 50 observations + 1 alert > 25 → oldest observation batches went.
        assert writer.pending_records <= 25
        assert sum(dropped) == 30
        assert writer.flush() is False
        pg.allow_logins()
        assert writer.flush() is True
        assert writer.pending_records == 0
        assert [d.arm for d in store.decisions().decisions] == ["off"]
        assert [a.name for a in store.alerts()] == ["A"]
        assert store.count_observations() == 5 + 20
    finally:
        pg.allow_logins()
        store.close()
