"""The store: SQLite (WAL, the embedded default) or PostgreSQL, migrated on open.

Every method is one short transaction, safe to call from worker threads. A database
that cannot be reached raises ``StoreUnavailable`` (``is_unavailable`` tells such
errors from bugs); ``controller.store.buffer`` builds the write buffer on that.

A SQLite file deleted or replaced under a running store would otherwise go on taking
writes into the old file, which nothing opens again: every call first checks that the
path still names the file opened (same device and inode), and from the first time it
does not, every call raises ``StoreLost`` (an outage, for the buffer and the API) until
a restart opens what is there now.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    Engine,
    and_,
    case,
    create_engine,
    delete,
    event,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from controller.contexts import Context, bucket_order
from controller.store.models import (
    AlertRow,
    Base,
    DecisionRow,
    HandoverRow,
    ObservationRollupRow,
    ObservationRow,
    OverrideRow,
    PolicySnapshotRow,
    RestartLeaseRow,
    ServiceStateRow,
    WindowStatRow,
)
from controller.store.records import (
    AlertRecord,
    Alternative,
    DecisionRecord,
    LeaseGrant,
    LeaseOutcome,
    LeaseRecord,
    ObservationRecord,
    OverrideRecord,
    Scope,
    StatsRow,
    WindowStatRecord,
)

ROLLUP_BATCH = 50_000
"""Raw rows rolled up per call, so one call never holds a long transaction."""
HANDOVER_BATCH = 20_000
"""Handed-over observations the leader takes per iteration at most (the rest next time)."""
LEASE_LOCK_SQL = text(
    "SELECT pg_advisory_xact_lock(hashtext('specpilot-lease:' || current_schema() || ':' || :pool))"
)
"""Serialises the lease decisions of one pool across replicas, for one transaction."""
MIGRATE_LOCK_SQL = text(
    "SELECT pg_advisory_xact_lock(hashtext('specpilot-migrate:' || current_schema()))"
)


class StoreUnavailable(RuntimeError):
    """The database cannot be reached (down, refused, connection lost)."""


class StoreLost(StoreUnavailable):
    """The SQLite file the store opened was deleted or replaced: what it held is gone
    from where the next start looks, and writes would go where nothing reads them."""


def is_unavailable(error: BaseException) -> bool:
    """True for errors that mean "the database is not there right now", not a bug."""
    if isinstance(error, StoreUnavailable | OperationalError | InterfaceError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


def redact(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the API read while the loop writes; FULL syncs each commit so a crash
    # (even of the machine) never loses a recorded decision.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def make_engine(url: str, *, connect_timeout_s: float = 5.0) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            connect_args={"check_same_thread": False, "timeout": connect_timeout_s},
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        parsed,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=5,
        pool_timeout=connect_timeout_s,
        connect_args={"connect_timeout": max(1, math.ceil(connect_timeout_s))},
    )


def alembic_config(engine: Engine) -> Config:
    config = Config()
    location = resources.files("controller.store") / "migrations"
    config.set_main_option("script_location", str(location))
    return config


@dataclass(frozen=True, slots=True)
class DecisionPage:
    decisions: tuple[DecisionRecord, ...]
    next_before: int | None
    """Pass as ``before`` for the next (older) page; None on the last page."""


class Store:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        database = engine.url.database if engine.dialect.name == "sqlite" else None
        self._file = Path(database).resolve() if database and database != ":memory:" else None
        self._identity: tuple[int, int] | None = None
        self._lease_lock = threading.Lock()
        """SQLite has one process; its threads take leases one at a time."""
        self.lost: str | None = None
        """Why the store is lost (``StoreLost``), once it is; None while it is not."""

    @classmethod
    def open(cls, url: str, *, migrate: bool = True, connect_timeout_s: float = 5.0) -> Store:
        """Connect and bring the schema to the latest migration.

        Raises ``StoreUnavailable`` with the (password-free) URL and the driver's reason
        when the database cannot be reached.
        """
        try:
            engine = make_engine(url, connect_timeout_s=connect_timeout_s)
        except OSError as exc:  # the SQLite file's directory cannot be made
            raise StoreUnavailable(f"cannot reach the store at {redact(url)}: {exc}") from exc
        store = cls(engine)
        try:
            if migrate:
                store.migrate()
            else:
                with store.engine.connect():
                    pass
        except Exception as exc:
            store.close()
            if is_unavailable(exc):
                reason = getattr(exc, "orig", None) or exc
                raise StoreUnavailable(
                    f"cannot reach the store at {redact(url)}: {str(reason).strip()}"
                ) from exc
            raise
        store._identity = store._file_identity()
        return store

    def _file_identity(self) -> tuple[int, int] | None:
        if self._file is None:
            return None
        try:
            status = os.stat(self._file)
        except FileNotFoundError:
            return None
        return status.st_dev, status.st_ino

    def check_lost(self) -> str | None:
        """Why the SQLite file is lost (deleted, or another file at its path), or None;
        cheap (one ``stat``). Always None for PostgreSQL and in-memory SQLite."""
        if self.lost is None and self._file is not None:
            identity = self._file_identity()
            if self._identity is None:
                self._identity = identity  # a store made without open(): first sight
            elif identity is None:
                self.lost = f"the SQLite file {self._file} was deleted"
            elif identity != self._identity:
                self.lost = f"the SQLite file {self._file} was replaced by another file"
        return self.lost

    def _ensure_not_lost(self) -> None:
        if self.check_lost() is not None:
            raise StoreLost(f"{self.lost}; restart specpilot to open what is there now")

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def migrate(self) -> None:
        """Bring the schema to the newest migration. On PostgreSQL under a lock held to
        the end of the transaction: replicas starting together (a Deployment's pods)
        migrate one after the other, the later ones finding the work done."""
        with self.engine.begin() as connection:
            if self.dialect == "postgresql":
                connection.execute(MIGRATE_LOCK_SQL)
            config = alembic_config(self.engine)
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        self._ensure_not_lost()
        try:
            with self.engine.connect() as connection:
                connection.exec_driver_sql("SELECT 1")
        except Exception as exc:
            if is_unavailable(exc):
                raise StoreUnavailable(str(exc)) from exc
            raise

    def _session(self) -> Session:
        self._ensure_not_lost()
        return self._sessions()

    # -- observations and window stats -------------------------------------------------

    def add_observations(self, records: Sequence[ObservationRecord]) -> None:
        if not records:
            return
        with self._session() as session, session.begin():
            session.add_all(
                ObservationRow(
                    ts=r.ts,
                    model=r.context.model,
                    workload_class=r.context.workload_class,
                    bucket=r.context.bucket,
                    pool=r.pool,
                    arm=r.arm,
                    output_tokens=r.output_tokens,
                    tpot_s=r.tpot_s,
                    ttft_s=r.ttft_s,
                    acceptance_rate=r.acceptance_rate,
                    mean_acceptance_length=r.mean_acceptance_length,
                )
                for r in records
            )

    def hand_over(self, observations: Sequence[dict[str, Any]], ts: float) -> None:
        """Queue observations a follower replica's gateway saw for the leader to learn
        from (``RequestObservation.to_json``); see :meth:`take_handed_over`."""
        with self._session() as session, session.begin():
            session.add_all(HandoverRow(ts=ts, observation=o) for o in observations)

    def take_handed_over(self, limit: int = HANDOVER_BATCH) -> list[dict[str, Any]]:
        """The oldest handed-over observations, at most ``limit``, oldest first; they
        are deleted in the same transaction, so each is taken once."""
        with self._session() as session, session.begin():
            rows = session.scalars(select(HandoverRow).order_by(HandoverRow.id).limit(limit)).all()
            if rows:
                ids = [row.id for row in rows]
                session.execute(delete(HandoverRow).where(HandoverRow.id.in_(ids)))
            return [row.observation for row in rows]

    def purge_handed_over(self, before: float) -> int:
        """Drop handed-over observations no leader took before ``before`` (a follower
        whose leader was gone that long: by then they say nothing about the fleet)."""
        with self._session() as session, session.begin():
            result = session.execute(delete(HandoverRow).where(HandoverRow.ts < before))
        return int(getattr(result, "rowcount", 0) or 0)

    def add_window_stats(self, records: Sequence[WindowStatRecord]) -> None:
        if not records:
            return
        with self._session() as session, session.begin():
            session.add_all(WindowStatRow(**dataclasses.asdict(r)) for r in records)

    def latest_window_stats(self) -> list[WindowStatRecord]:
        """The newest window of every (pool, instance)."""
        newest = (
            select(WindowStatRow.instance, func.max(WindowStatRow.id).label("id"))
            .group_by(WindowStatRow.pool, WindowStatRow.instance)
            .subquery()
        )
        with self._session() as session:
            rows = session.scalars(
                select(WindowStatRow).join(newest, WindowStatRow.id == newest.c.id)
            ).all()
        return [_record(WindowStatRecord, r) for r in rows]

    def count_observations(self) -> int:
        with self._session() as session:
            return int(session.scalar(select(func.count(ObservationRow.id))) or 0)

    def roll_up(self, now: float, retention_s: float, period_s: float) -> int:
        """Fold raw observations older than the retention into per-period sums, then delete
        them; returns how many raw rows went. The cut is aligned to a period boundary so a
        period is never split between raw rows and its roll-up."""
        cutoff = math.floor((now - retention_s) / period_s) * period_s
        with self._session() as session, session.begin():
            rows = session.scalars(
                select(ObservationRow)
                .where(ObservationRow.ts < cutoff)
                .order_by(ObservationRow.id)
                .limit(ROLLUP_BATCH)
            ).all()
            sums: dict[tuple[float, str, str, str, str], dict[str, float]] = {}
            for row in rows:
                start = math.floor(row.ts / period_s) * period_s
                key = (start, row.model, row.workload_class, row.bucket, row.arm)
                acc = sums.setdefault(key, dict.fromkeys(_ROLLUP_SUMS, 0.0))
                acc["requests"] += 1
                acc["output_tokens"] += row.output_tokens or 0
                for name, value in (
                    ("tpot", row.tpot_s),
                    ("ttft", row.ttft_s),
                    ("acceptance", row.acceptance_rate),
                    ("acceptance_length", row.mean_acceptance_length),
                ):
                    if value is not None:
                        acc[f"{name}_sum"] += value
                        acc[f"{name}_count"] += 1
            for (start, model, cls, bucket, arm), acc in sums.items():
                existing = session.scalar(
                    select(ObservationRollupRow).where(
                        ObservationRollupRow.period_start == start,
                        ObservationRollupRow.model == model,
                        ObservationRollupRow.workload_class == cls,
                        ObservationRollupRow.bucket == bucket,
                        ObservationRollupRow.arm == arm,
                    )
                )
                if existing is None:
                    existing = ObservationRollupRow(
                        period_start=start,
                        period_s=period_s,
                        model=model,
                        workload_class=cls,
                        bucket=bucket,
                        arm=arm,
                        **{name: 0.0 if name.endswith("_sum") else 0 for name in _ROLLUP_SUMS},
                    )
                    session.add(existing)
                for name, value in acc.items():
                    total = getattr(existing, name) + value
                    setattr(existing, name, total if name.endswith("_sum") else int(total))
            if rows:
                session.execute(
                    delete(ObservationRow).where(ObservationRow.id.in_([r.id for r in rows]))
                )
        return len(rows)

    def stats(
        self,
        since: float,
        *,
        model: str | None = None,
        workload_class: str | None = None,
    ) -> list[StatsRow]:
        """Observed figures per (context, arm) since ``since``, raw rows and roll-ups
        (whole periods starting at or after ``since``) combined."""
        filters_raw = [ObservationRow.ts >= since]
        filters_roll = [ObservationRollupRow.period_start >= since]
        if model is not None:
            filters_raw.append(ObservationRow.model == model)
            filters_roll.append(ObservationRollupRow.model == model)
        if workload_class is not None:
            filters_raw.append(ObservationRow.workload_class == workload_class)
            filters_roll.append(ObservationRollupRow.workload_class == workload_class)
        o, r = ObservationRow, ObservationRollupRow
        raw = (
            select(
                o.model,
                o.workload_class,
                o.bucket,
                o.arm,
                func.count(o.id),
                func.coalesce(func.sum(o.output_tokens), 0),
                func.coalesce(func.sum(o.tpot_s), 0.0),
                func.count(o.tpot_s),
                func.coalesce(func.sum(o.ttft_s), 0.0),
                func.count(o.ttft_s),
                func.coalesce(func.sum(o.acceptance_rate), 0.0),
                func.count(o.acceptance_rate),
                func.coalesce(func.sum(o.mean_acceptance_length), 0.0),
                func.count(o.mean_acceptance_length),
            )
            .where(and_(*filters_raw))
            .group_by(o.model, o.workload_class, o.bucket, o.arm)
        )
        rolled = (
            select(
                r.model,
                r.workload_class,
                r.bucket,
                r.arm,
                func.sum(r.requests),
                func.sum(r.output_tokens),
                func.sum(r.tpot_sum),
                func.sum(r.tpot_count),
                func.sum(r.ttft_sum),
                func.sum(r.ttft_count),
                func.sum(r.acceptance_sum),
                func.sum(r.acceptance_count),
                func.sum(r.acceptance_length_sum),
                func.sum(r.acceptance_length_count),
            )
            .where(and_(*filters_roll))
            .group_by(r.model, r.workload_class, r.bucket, r.arm)
        )
        # Scraped windows count as the requests they cover, their means weighted so.
        w = WindowStatRow
        filters_win = [w.ts >= since, w.workload_class.is_not(None), w.requests > 0]
        if model is not None:
            filters_win.append(w.model == model)
        if workload_class is not None:
            filters_win.append(w.workload_class == workload_class)
        weighted = func.coalesce(func.sum(w.requests), 0.0)
        windows = (
            select(
                w.model,
                w.workload_class,
                func.coalesce(w.bucket, ""),
                func.coalesce(w.arm, "unknown"),
                weighted,
                func.coalesce(func.sum(w.generation_tokens), 0.0),
                func.coalesce(func.sum(w.tpot_mean_s * w.requests), 0.0),
                func.coalesce(func.sum(case((w.tpot_mean_s.is_not(None), w.requests))), 0.0),
                literal(0.0),
                literal(0.0),
                func.coalesce(func.sum(w.acceptance_rate * w.requests), 0.0),
                func.coalesce(func.sum(case((w.acceptance_rate.is_not(None), w.requests))), 0.0),
                func.coalesce(func.sum(w.mean_acceptance_length * w.requests), 0.0),
                func.coalesce(
                    func.sum(case((w.mean_acceptance_length.is_not(None), w.requests))), 0.0
                ),
            )
            .where(and_(*filters_win))
            .group_by(w.model, w.workload_class, w.bucket, w.arm)
        )
        totals: dict[tuple[str, str, str, str], list[float]] = {}
        with self._session() as session:
            for query in (raw, rolled, windows):
                for row in session.execute(query):
                    key = (row[0], row[1], row[2], row[3])
                    acc = totals.setdefault(key, [0.0] * 10)
                    for i in range(10):
                        acc[i] += float(row[4 + i] or 0)

        def mean(total: float, count: float) -> float | None:
            return total / count if count else None

        return [
            StatsRow(
                context=Context(m, c, b),
                arm=arm,
                requests=int(acc[0]),
                output_tokens=int(acc[1]),
                mean_tpot_s=mean(acc[2], acc[3]),
                mean_ttft_s=mean(acc[4], acc[5]),
                acceptance_rate=mean(acc[6], acc[7]),
                mean_acceptance_length=mean(acc[8], acc[9]),
            )
            for (m, c, b, arm), acc in sorted(
                totals.items(), key=lambda item: (item[0][:2], bucket_order(item[0][2]), item[0][3])
            )
        ]

    # -- decisions -----------------------------------------------------------------------

    def record_decision(self, decision: DecisionRecord) -> int:
        with self._session() as session, session.begin():
            row = DecisionRow(
                ts=decision.ts,
                model=decision.context.model,
                workload_class=decision.context.workload_class,
                bucket=decision.context.bucket,
                arm=decision.arm,
                previous_arm=decision.previous_arm,
                reason=decision.reason,
                predicted_speedup=decision.predicted_speedup,
                measured_speedup=decision.measured_speedup,
                actor=decision.actor,
                detail=decision.detail,
                alternatives=[dataclasses.asdict(a) for a in decision.alternatives],
            )
            session.add(row)
            session.flush()
            return row.id

    def record_decision_once(self, decision: DecisionRecord) -> bool:
        """Record unless the same decision (context, time, arm) is stored; True if new."""
        c = decision.context
        with self._session() as session:
            exists = session.scalar(
                select(func.count(DecisionRow.id)).where(
                    DecisionRow.model == c.model,
                    DecisionRow.workload_class == c.workload_class,
                    DecisionRow.bucket == c.bucket,
                    DecisionRow.ts == decision.ts,
                    DecisionRow.arm == decision.arm,
                )
            )
        if exists:
            return False
        self.record_decision(decision)
        return True

    def set_measured_speedup(self, context: Context, decided_at: float, value: float) -> None:
        """Fill in what a decision (known by its context and time) turned out to buy."""
        with self._session() as session, session.begin():
            session.execute(
                update(DecisionRow)
                .where(
                    DecisionRow.model == context.model,
                    DecisionRow.workload_class == context.workload_class,
                    DecisionRow.bucket == context.bucket,
                    DecisionRow.ts == decided_at,
                )
                .values(measured_speedup=value)
            )

    def decisions(
        self,
        *,
        limit: int = 50,
        before: int | None = None,
        context: Context | None = None,
        model: str | None = None,
        workload_class: str | None = None,
        bucket: str | None = None,
    ) -> DecisionPage:
        """Newest first; ``before`` is the id the previous page ended after. Filter by a
        whole ``context`` or by any of its fields."""
        if context is not None:
            model, workload_class, bucket = context.model, context.workload_class, context.bucket
        query = select(DecisionRow).order_by(DecisionRow.id.desc()).limit(limit + 1)
        if before is not None:
            query = query.where(DecisionRow.id < before)
        for column, value in (
            (DecisionRow.model, model),
            (DecisionRow.workload_class, workload_class),
            (DecisionRow.bucket, bucket),
        ):
            if value is not None:
                query = query.where(column == value)
        with self._session() as session:
            rows = session.scalars(query).all()
        page = tuple(_decision(r) for r in rows[:limit])
        return DecisionPage(page, page[-1].id if len(rows) > limit and page else None)

    def latest_decisions(self) -> dict[Context, DecisionRecord]:
        """The newest decision of every context: what each context runs now."""
        d = DecisionRow
        newest = (
            select(func.max(d.id).label("id"))
            .group_by(d.model, d.workload_class, d.bucket)
            .subquery()
        )
        with self._session() as session:
            rows = session.scalars(select(d).where(d.id.in_(select(newest.c.id)))).all()
        return {record.context: record for record in map(_decision, rows)}

    # -- overrides -----------------------------------------------------------------------

    def add_override(self, override: OverrideRecord) -> None:
        with self._session() as session, session.begin():
            session.add(
                OverrideRow(
                    id=override.id,
                    created_at=override.created_at,
                    expires_at=override.expires_at,
                    deleted_at=override.deleted_at,
                    model=override.scope.model,
                    workload_class=override.scope.workload_class,
                    bucket=override.scope.bucket,
                    config=override.config,
                    reason=override.reason,
                )
            )

    def active_overrides(self, now: float) -> list[OverrideRecord]:
        """Not deleted and not expired, oldest first."""
        with self._session() as session:
            rows = session.scalars(
                select(OverrideRow)
                .where(OverrideRow.deleted_at.is_(None), OverrideRow.expires_at > now)
                .order_by(OverrideRow.created_at, OverrideRow.id)
            ).all()
        return [_override(r) for r in rows]

    def delete_override(self, override_id: str, now: float) -> bool:
        """End an override now; False when there is no active one with that id."""
        with self._session() as session, session.begin():
            result = session.execute(
                update(OverrideRow)
                .where(
                    OverrideRow.id == override_id,
                    OverrideRow.deleted_at.is_(None),
                    OverrideRow.expires_at > now,
                )
                .values(deleted_at=now)
            )
            return bool(getattr(result, "rowcount", 0))

    # -- alerts, snapshots, service state ------------------------------------------------

    def record_alert(self, alert: AlertRecord) -> int:
        with self._session() as session, session.begin():
            row = AlertRow(**dataclasses.asdict(alert))
            session.add(row)
            session.flush()
            return row.id

    def record_alert_once(self, alert: AlertRecord) -> bool:
        """Record unless the same alert (time, name, message) is stored; True if new."""
        with self._session() as session:
            exists = session.scalar(
                select(func.count(AlertRow.id)).where(
                    AlertRow.ts == alert.ts,
                    AlertRow.name == alert.name,
                    AlertRow.message == alert.message,
                )
            )
        if exists:
            return False
        self.record_alert(alert)
        return True

    def resolve_alerts(self, name: str, context: str | None, ts: float) -> int:
        """Mark every unresolved alert of this name and context resolved at ``ts``."""
        with self._session() as session, session.begin():
            result = session.execute(
                update(AlertRow)
                .where(
                    AlertRow.name == name,
                    AlertRow.context == context
                    if context is not None
                    else AlertRow.context.is_(None),
                    AlertRow.resolved_at.is_(None),
                )
                .values(resolved_at=ts)
            )
        return int(getattr(result, "rowcount", 0) or 0)

    def alerts(self, *, limit: int = 100, unresolved_only: bool = False) -> list[AlertRecord]:
        query = select(AlertRow).order_by(AlertRow.id.desc()).limit(limit)
        if unresolved_only:
            query = query.where(AlertRow.resolved_at.is_(None))
        with self._session() as session:
            rows = session.scalars(query).all()
        return [_record(AlertRecord, r) for r in rows]

    def save_snapshot(self, ts: float, state: dict[str, Any], keep: int = 20) -> None:
        """Save the learned state and drop all but the ``keep`` newest snapshots."""
        with self._session() as session, session.begin():
            session.add(PolicySnapshotRow(ts=ts, state=state))
            session.flush()
            keep_ids = (
                select(PolicySnapshotRow.id).order_by(PolicySnapshotRow.id.desc()).limit(keep)
            )
            session.execute(
                delete(PolicySnapshotRow).where(
                    PolicySnapshotRow.id.not_in(select(keep_ids.subquery().c.id))
                )
            )

    def latest_snapshot(self) -> tuple[float, dict[str, Any]] | None:
        with self._session() as session:
            row = session.scalar(
                select(PolicySnapshotRow).order_by(PolicySnapshotRow.id.desc()).limit(1)
            )
        return None if row is None else (row.ts, row.state)

    def get_state(self, key: str, default: Any = None) -> Any:
        with self._session() as session:
            row = session.get(ServiceStateRow, key)
        return default if row is None else row.value

    def set_state(self, key: str, value: Any, now: float) -> None:
        with self._session() as session, session.begin():
            row = session.get(ServiceStateRow, key)
            if row is None:
                session.add(ServiceStateRow(key=key, value=value, updated_at=now))
            else:
                row.value, row.updated_at = value, now

    # -- restart leases (per-pod topology) ----------------------------------------------

    def acquire_lease(
        self,
        pool: str,
        replica: str,
        config: str,
        clock: Callable[[], float],
        ttl_s: float,
        max_unavailable: int,
    ) -> LeaseGrant:
        """A lease to restart ``replica``'s vLLM of ``pool`` into ``config``, unless a
        failed restart of that config holds the pool or ``max_unavailable`` other
        replicas hold one. Leases past their expiry are closed as ``expired``, this
        replica's own open ones (a previous life's) as ``abandoned``, and holds on
        other configs of the pool lifted (it was handed another config since).
        ``clock`` is read once the pool's lock is held, so a lease granted after
        another's release never starts before it in the log."""
        with self._lease_lock, self._session() as session, session.begin():
            if self.dialect == "postgresql":
                session.execute(LEASE_LOCK_SQL, {"pool": pool})
            now = clock()
            _close_stale_leases(session, pool, replica, now)
            _lift_holds(session, pool, config)
            held = session.scalar(
                select(RestartLeaseRow)
                .where(
                    RestartLeaseRow.pool == pool,
                    RestartLeaseRow.holds.is_(True),
                    RestartLeaseRow.config == config,
                )
                .order_by(RestartLeaseRow.id.desc())
                .limit(1)
            )
            if held is not None:
                return LeaseGrant(held=_lease(held))
            holders = session.scalars(
                select(RestartLeaseRow.replica).where(
                    RestartLeaseRow.pool == pool,
                    RestartLeaseRow.released_at.is_(None),
                    RestartLeaseRow.expires_at > now,
                )
            ).all()
            if len(holders) >= max_unavailable:
                return LeaseGrant(holders=tuple(sorted(holders)))
            row = RestartLeaseRow(
                pool=pool,
                replica=replica,
                config=config,
                acquired_at=now,
                expires_at=now + ttl_s,
                holds=False,
            )
            session.add(row)
            session.flush()
            return LeaseGrant(lease=_lease(row))

    def renew_lease(self, lease_id: int, now: float, ttl_s: float) -> bool:
        """Push an open lease's expiry to ``now + ttl_s``; False if it is no longer
        open (it expired, and another replica may be restarting now)."""
        with self._session() as session, session.begin():
            result = session.execute(
                update(RestartLeaseRow)
                .where(
                    RestartLeaseRow.id == lease_id,
                    RestartLeaseRow.released_at.is_(None),
                    RestartLeaseRow.expires_at > now,
                )
                .values(expires_at=now + ttl_s)
            )
        return bool(getattr(result, "rowcount", 0))

    def release_lease(
        self,
        lease_id: int,
        now: float,
        outcome: LeaseOutcome,
        detail: str | None = None,
        *,
        holds: bool = False,
        config: str | None = None,
    ) -> None:
        """Close a lease; ``holds``: no other replica of the pool starts its config
        (in the same transaction, so a replica waiting for the lease sees the hold);
        ``config``: what the restart went to, where a newer wish replaced the one the
        lease was granted for."""
        with self._lease_lock, self._session() as session, session.begin():
            row = session.get(RestartLeaseRow, lease_id)
            if row is None:
                return
            if self.dialect == "postgresql":
                session.execute(LEASE_LOCK_SQL, {"pool": row.pool})
            if row.released_at is None:
                row.released_at = now
                row.outcome = outcome
            row.detail, row.holds = detail, holds
            if config is not None:
                row.config = config

    def lift_holds(self, pool: str, config: str) -> int:
        """Lift the holds on ``pool`` of configs other than ``config`` (the pool was
        handed another config); returns how many."""
        with self._lease_lock, self._session() as session, session.begin():
            if self.dialect == "postgresql":
                session.execute(LEASE_LOCK_SQL, {"pool": pool})
            return _lift_holds(session, pool, config)

    def leases(self, pool: str | None = None, *, limit: int = 100) -> list[LeaseRecord]:
        """The lease log, newest first."""
        query = select(RestartLeaseRow).order_by(RestartLeaseRow.id.desc()).limit(limit)
        if pool is not None:
            query = query.where(RestartLeaseRow.pool == pool)
        with self._session() as session:
            return [_lease(row) for row in session.scalars(query).all()]

    def purge_window_stats(self, before: float) -> int:
        with self._session() as session, session.begin():
            result = session.execute(delete(WindowStatRow).where(WindowStatRow.ts < before))
            return int(getattr(result, "rowcount", 0))


_ROLLUP_SUMS = (
    "requests",
    "output_tokens",
    "tpot_sum",
    "tpot_count",
    "ttft_sum",
    "ttft_count",
    "acceptance_sum",
    "acceptance_count",
    "acceptance_length_sum",
    "acceptance_length_count",
)


R = TypeVar("R")


def _record(kind: type[R], row: Base) -> R:
    """A flat record from the row whose columns carry its field names."""
    return kind(**{f.name: getattr(row, f.name) for f in dataclasses.fields(kind)})  # type: ignore[arg-type]


def _close_stale_leases(session: Session, pool: str, replica: str, now: float) -> None:
    open_ = [RestartLeaseRow.pool == pool, RestartLeaseRow.released_at.is_(None)]
    session.execute(
        update(RestartLeaseRow)
        .where(*open_, RestartLeaseRow.expires_at <= now)
        .values(released_at=RestartLeaseRow.expires_at, outcome="expired")
    )
    session.execute(
        update(RestartLeaseRow)
        .where(*open_, RestartLeaseRow.replica == replica)
        .values(released_at=now, outcome="abandoned")
    )


def _lift_holds(session: Session, pool: str, config: str) -> int:
    result = session.execute(
        update(RestartLeaseRow)
        .where(
            RestartLeaseRow.pool == pool,
            RestartLeaseRow.holds.is_(True),
            RestartLeaseRow.config != config,
        )
        .values(holds=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def _lease(row: RestartLeaseRow) -> LeaseRecord:
    return _record(LeaseRecord, row)


def _decision(row: DecisionRow) -> DecisionRecord:
    return DecisionRecord(
        ts=row.ts,
        context=Context(row.model, row.workload_class, row.bucket),
        arm=row.arm,
        previous_arm=row.previous_arm,
        reason=row.reason,
        actor="operator" if row.actor == "operator" else "policy",
        predicted_speedup=row.predicted_speedup,
        measured_speedup=row.measured_speedup,
        id=row.id,
        detail=row.detail or "",
        alternatives=tuple(Alternative(**a) for a in row.alternatives or ()),
    )


def _override(row: OverrideRow) -> OverrideRecord:
    return OverrideRecord(
        id=row.id,
        created_at=row.created_at,
        expires_at=row.expires_at,
        scope=Scope(row.model, row.workload_class, row.bucket),
        config=dict(row.config),
        reason=row.reason,
        deleted_at=row.deleted_at,
    )
