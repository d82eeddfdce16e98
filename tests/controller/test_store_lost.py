"""A SQLite file deleted or replaced under a running store is noticed: every call then
fails as an outage (``StoreLost``), /readyz says so, the loop raises a ``StoreLost``
alert that the journal carries to the next start, and writes wait in the buffer, where
policy snapshots keep only the newest."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import httpx
import pytest

from controller.store.buffer import BufferedWriter
from controller.store.db import Store, StoreLost, StoreUnavailable
from controller.store.records import AlertRecord
from tests.controller.conftest import make_settings
from tests.controller.test_api import NGRAM3, WRITE, serve
from tests.controller.test_loop import Harness


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'specpilot.db'}"


def alert(ts: float) -> AlertRecord:
    return AlertRecord(ts, "Test", "warning", "a test alert")


def test_a_deleted_sqlite_file_makes_every_call_fail_as_lost(tmp_path: Path) -> None:
    store = Store.open(sqlite_url(tmp_path))
    try:
        store.record_alert(alert(1.0))
        assert store.check_lost() is None
        (tmp_path / "data" / "specpilot.db").unlink()
        with pytest.raises(StoreLost, match="was deleted"):
            store.record_alert(alert(2.0))
        with pytest.raises(StoreLost):
            store.ping()
        with pytest.raises(StoreUnavailable):  # what the buffer and the API treat as an outage
            store.alerts()
    finally:
        store.close()


def test_a_replaced_sqlite_file_is_lost_too(tmp_path: Path) -> None:
    store = Store.open(sqlite_url(tmp_path))
    try:
        other = tmp_path / "other.db"
        sqlite3.connect(other).close()
        os.replace(other, tmp_path / "data" / "specpilot.db")
        reason = store.check_lost()
        assert reason is not None and "replaced" in reason
        with pytest.raises(StoreLost, match="replaced by another file"):
            store.alerts()
    finally:
        store.close()


def test_queued_snapshots_keep_only_the_newest(tmp_path: Path) -> None:
    store = Store.open(sqlite_url(tmp_path))
    reachable = False
    saved: list[int] = []

    def snapshot(number: int) -> None:
        def write(_: Store) -> None:
            if not reachable:
                raise StoreUnavailable("down")
            saved.append(number)

        writer.write(write, droppable=True, key="snapshot")

    writer = BufferedWriter(store, max_records=10_000)
    try:
        for number in range(5):
            snapshot(number)
        writer.write(lambda s: s.record_alert(alert(1.0)) if reachable else _down())
        assert writer.pending_records == 2, "one snapshot and the alert"
        reachable = True
        assert writer.flush()
        assert saved == [4]
        assert [a.name for a in store.alerts()] == ["Test"]
    finally:
        store.close()


def _down() -> None:
    raise StoreUnavailable("down")


def test_the_loop_raises_store_lost_once_and_a_restart_finds_it(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    harness = Harness(settings)
    try:
        harness.tick(1000.0)
        (settings.data_dir / "specpilot.db").unlink()
        for second in range(1, 6):
            harness.tick(1000.0 + second)
        loop = harness.loop
        assert not loop.store_reachable
        # The alert once, and of the five snapshots taken meanwhile only the newest.
        assert loop.writer.pending_records == 2
        journalled = loop.journal.entries()
        assert [(e.name, e.severity) for e in journalled if isinstance(e, AlertRecord)] == [
            ("StoreLost", "critical")
        ]
        asyncio.run(loop.shutdown())  # its final snapshot replaces the queued one
        assert loop.writer.pending_records == 2
    finally:
        harness.close()
    restarted = Harness(settings)  # opens a new, empty file there and replays the journal
    try:
        [found] = [a for a in restarted.store.alerts() if a.name == "StoreLost"]
        assert "was deleted" in found.message
    finally:
        restarted.close()


def test_readyz_is_503_and_writes_are_refused_once_the_file_is_deleted(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    with serve(tmp_path, url, {"token": "rw-secret"}) as api:
        api.until(lambda: api.client.get("/readyz").status_code == 200)
        (tmp_path / "data" / "specpilot.db").unlink()
        response: httpx.Response = api.until(
            lambda: (r := api.client.get("/readyz")).status_code == 503 and r
        )
        assert response.json()["checks"]["store"].startswith("lost: the SQLite file")
        assert api.client.post("/v1/overrides", json=NGRAM3, headers=WRITE).status_code == 503
