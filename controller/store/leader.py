"""Which replica leads: runs the policy and pushes to the fleet. The others serve reads.

On PostgreSQL the leader holds a session-level advisory lock (keyed by the schema, so
two deployments in one database do not contend) on a connection of its own. When the
leader dies its connection closes and PostgreSQL releases the lock; a follower that
polls every ``check_interval_s`` takes it over. On SQLite there is one process: it leads.

While the database cannot be reached at all, a leader keeps leading (the loop must keep
deciding through an outage); it steps down as soon as the database answers and the lock
is held elsewhere.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from controller.store.db import is_unavailable

log = logging.getLogger(__name__)

LOCK_SQL = text("SELECT pg_try_advisory_lock(hashtext('specpilot:' || current_schema()))")


class Leadership(Protocol):
    @property
    def is_leader(self) -> bool: ...

    def check(self) -> bool:
        """Renew or try to take the leadership (blocking, short); returns ``is_leader``."""
        ...

    def release(self) -> None: ...


class SoleLeader:
    """One process per store (SQLite): always the leader."""

    @property
    def is_leader(self) -> bool:
        return True

    def check(self) -> bool:
        return True

    def release(self) -> None:
        pass


class AdvisoryLockLeader:
    def __init__(self, url: str, connect_timeout_s: float = 3.0) -> None:
        # No pool: closing the lock's connection must end the session (and free the lock).
        self._engine = create_engine(
            make_url(url),
            poolclass=NullPool,
            connect_args={"connect_timeout": max(1, int(connect_timeout_s))},
        )
        self._connection: Connection | None = None
        self._leader = False
        self._lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self._leader

    def check(self) -> bool:
        with self._lock:  # the loop and its leadership watcher both check
            return self._check()

    def _check(self) -> bool:
        if self._connection is not None:
            try:
                self._connection.exec_driver_sql("SELECT 1")
                self._connection.commit()
                return True
            except Exception as exc:
                log.warning("leader lock connection lost: %s", exc)
                self._drop_connection()
        try:
            connection = self._engine.connect()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return self._leader  # nobody can be confirmed: keep what we had
        try:
            got = bool(connection.execute(LOCK_SQL).scalar())
            connection.commit()
        except Exception as exc:
            connection.close()
            if not is_unavailable(exc):
                raise
            return self._leader
        if got:
            if not self._leader:
                log.info("became leader")
            self._connection, self._leader = connection, True
        else:
            connection.close()
            if self._leader:
                log.warning("lost leadership to another replica")
            self._leader = False
        return self._leader

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.invalidate()
                connection.close()
            except Exception:  # already broken: nothing to release
                log.debug("closing a broken lock connection failed", exc_info=True)

    def release(self) -> None:
        with self._lock:
            self._drop_connection()
            self._leader = False
            self._engine.dispose()


def leadership_for(url: str) -> Leadership:
    if make_url(url).get_backend_name() == "postgresql":
        return AdvisoryLockLeader(url)
    return SoleLeader()
