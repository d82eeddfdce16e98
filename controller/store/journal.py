"""Decisions and alerts the database could not take yet, kept on local disk.

While the store is unreachable, writes wait in memory (``BufferedWriter``); a crash
then would lose them. The loop therefore also appends every decision and alert it
could not store to this journal — one JSON line each, fsynced before it acts — and
replays the journal into the store at the next start. Replay is idempotent (a record
already stored is skipped), so a crash between flushing and clearing is harmless.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from controller.contexts import Context
from controller.store.db import Store
from controller.store.records import AlertRecord, Alternative, DecisionRecord

Entry = DecisionRecord | AlertRecord


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, record: Entry) -> None:
        kind = "decision" if isinstance(record, DecisionRecord) else "alert"
        line = json.dumps({"kind": kind, "record": dataclasses.asdict(record)}) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def entries(self) -> list[Entry]:
        if not self.path.exists():
            return []
        entries: list[Entry] = []
        for line in self.path.read_text().splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-append: its write never completed
            entries.append(_entry(item["kind"], item["record"]))
        return entries

    def replay(self, store: Store) -> int:
        """Store every journalled record not stored yet, then empty the journal."""
        stored = 0
        for entry in self.entries():
            if isinstance(entry, DecisionRecord):
                stored += store.record_decision_once(entry)
            else:
                stored += store.record_alert_once(entry)
        self.clear()
        return stored

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def __bool__(self) -> bool:
        return self.path.exists()


def _entry(kind: str, record: dict[str, Any]) -> Entry:
    if kind == "decision":
        alternatives = tuple(Alternative(**a) for a in record.get("alternatives", ()))
        return DecisionRecord(
            **{
                **record,
                "context": Context(**record["context"]),
                "alternatives": alternatives,
                "id": None,
            }
        )
    return AlertRecord(**{**record, "id": None})
