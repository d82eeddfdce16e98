"""Writes that outlive a database outage: held in memory (bounded), replayed in order.

The control loop must keep deciding while the store is away. Each write is tried at
once; when the database is unreachable it is queued and the queue is replayed, oldest
first, before any newer write, so the audit log keeps its order. The queue holds at
most ``max_records`` records (a batch of observations counts as its size); past that
the oldest droppable writes (observations, window stats) go first, and only if nothing
droppable is left does the oldest of the rest. Every dropped record is counted.

A write given a ``key`` supersedes the queued one with the same key: a policy snapshot
is the whole learned state, so during an outage only the newest is worth keeping (each
is a full copy; queueing every one held up to ``max_records`` of them).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from controller.store.db import Store, is_unavailable

Write = Callable[[Store], object]


@dataclass(frozen=True, slots=True)
class _Pending:
    write: Write
    records: int
    droppable: bool
    key: str | None = None


class BufferedWriter:
    def __init__(
        self,
        store: Store,
        max_records: int,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.max_records = max_records
        self._on_drop = on_drop or (lambda _n: None)
        self._pending: deque[_Pending] = deque()
        self._pending_records = 0
        self._lock = threading.Lock()

    @property
    def pending_records(self) -> int:
        return self._pending_records

    def write(
        self,
        write: Write,
        *,
        records: int = 1,
        droppable: bool = False,
        key: str | None = None,
    ) -> bool:
        """Apply ``write`` now if the store is reachable (after anything queued), else
        queue it (replacing a queued write with the same ``key``). True when it reached
        the database. Errors that are not about reachability propagate: they are bugs,
        not outages."""
        with self._lock:
            if self._flush_locked():
                try:
                    write(self.store)
                    return True
                except Exception as exc:
                    if not is_unavailable(exc):
                        raise
            self._enqueue(_Pending(write, records, droppable, key))
            return False

    def flush(self) -> bool:
        """Replay queued writes in order; True when the queue is empty afterwards."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        while self._pending:
            pending = self._pending[0]
            try:
                pending.write(self.store)
            except Exception as exc:
                if is_unavailable(exc):
                    return False
                raise
            self._pending.popleft()
            self._pending_records -= pending.records
        return True

    def _enqueue(self, pending: _Pending) -> None:
        if pending.key is not None:
            for superseded in [p for p in self._pending if p.key == pending.key]:
                self._pending.remove(superseded)
                self._pending_records -= superseded.records
        self._pending.append(pending)
        self._pending_records += pending.records
        while self._pending_records > self.max_records and len(self._pending) > 1:
            victim = next((p for p in self._pending if p.droppable), self._pending[0])
            self._pending.remove(victim)
            self._pending_records -= victim.records
            self._on_drop(victim.records)
