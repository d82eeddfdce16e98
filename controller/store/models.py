"""Tables of the store (SQLAlchemy 2 typed models). Times are seconds since the epoch.

The schema is created and changed only by the Alembic migrations in ``migrations/``;
``tests/controller/test_store.py`` checks that these models and the migrations agree.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# 64-bit ids on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY.
Id = BigInteger().with_variant(Integer(), "sqlite")
Name = String(200)


class Base(DeclarativeBase):
    pass


class ObservationRow(Base):
    """One finished request (raw; rolled up and deleted after the retention)."""

    __tablename__ = "observations"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    model: Mapped[str] = mapped_column(Name)
    workload_class: Mapped[str] = mapped_column(Name)
    bucket: Mapped[str] = mapped_column(String(32))
    pool: Mapped[str | None] = mapped_column(Name)
    arm: Mapped[str] = mapped_column(Name)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    acceptance_rate: Mapped[float | None] = mapped_column(Float)
    mean_acceptance_length: Mapped[float | None] = mapped_column(Float)


class ObservationRollupRow(Base):
    """Sums over one period for one (context, arm): what old observations become."""

    __tablename__ = "observation_rollups"
    __table_args__ = (UniqueConstraint("period_start", "model", "workload_class", "bucket", "arm"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    period_start: Mapped[float] = mapped_column(Float, index=True)
    period_s: Mapped[float] = mapped_column(Float)
    model: Mapped[str] = mapped_column(Name)
    workload_class: Mapped[str] = mapped_column(Name)
    bucket: Mapped[str] = mapped_column(String(32))
    arm: Mapped[str] = mapped_column(Name)
    requests: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    tpot_sum: Mapped[float] = mapped_column(Float)
    tpot_count: Mapped[int] = mapped_column(Integer)
    ttft_sum: Mapped[float] = mapped_column(Float)
    ttft_count: Mapped[int] = mapped_column(Integer)
    acceptance_sum: Mapped[float] = mapped_column(Float)
    acceptance_count: Mapped[int] = mapped_column(Integer)
    acceptance_length_sum: Mapped[float] = mapped_column(Float)
    acceptance_length_count: Mapped[int] = mapped_column(Integer)


class WindowStatRow(Base):
    """What one instance's metrics said over one scrape window."""

    __tablename__ = "window_stats"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    pool: Mapped[str] = mapped_column(Name)
    instance: Mapped[str] = mapped_column(String(500))
    model: Mapped[str] = mapped_column(Name)
    window_s: Mapped[float] = mapped_column(Float)
    acceptance_rate: Mapped[float | None] = mapped_column(Float)
    mean_acceptance_length: Mapped[float | None] = mapped_column(Float)
    tpot_p50_s: Mapped[float | None] = mapped_column(Float)
    requests_running: Mapped[float | None] = mapped_column(Float)
    healthy: Mapped[bool] = mapped_column(default=True)
    workload_class: Mapped[str | None] = mapped_column(Name)
    bucket: Mapped[str | None] = mapped_column(String(32))
    arm: Mapped[str | None] = mapped_column(Name)
    requests: Mapped[float | None] = mapped_column(Float)
    generation_tokens: Mapped[float | None] = mapped_column(Float)
    tpot_mean_s: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str | None] = mapped_column(Text)


class DecisionRow(Base):
    """The audit log: every change of a context's effective arm, by policy or operator."""

    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_context", "model", "workload_class", "bucket", "id"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    model: Mapped[str] = mapped_column(Name)
    workload_class: Mapped[str] = mapped_column(Name)
    bucket: Mapped[str] = mapped_column(String(32))
    arm: Mapped[str] = mapped_column(Name)
    previous_arm: Mapped[str | None] = mapped_column(Name)
    reason: Mapped[str] = mapped_column(Text)
    predicted_speedup: Mapped[float | None] = mapped_column(Float)
    measured_speedup: Mapped[float | None] = mapped_column(Float)
    actor: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(Text)
    alternatives: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    """``[{arm, predicted_speedup, low, high}]`` as the policy predicted them."""


class OverrideRow(Base):
    """An operator's pin of a config for a scope, until it expires or is deleted."""

    __tablename__ = "overrides"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    deleted_at: Mapped[float | None] = mapped_column(Float)
    model: Mapped[str] = mapped_column(Name)
    workload_class: Mapped[str] = mapped_column(Name)
    bucket: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text)


class AlertRow(Base):
    __tablename__ = "alerts"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    name: Mapped[str] = mapped_column(Name)
    severity: Mapped[str] = mapped_column(String(16))
    context: Mapped[str | None] = mapped_column(String(500))
    message: Mapped[str] = mapped_column(Text)
    resolved_at: Mapped[float | None] = mapped_column(Float)


class PolicySnapshotRow(Base):
    """The learned policy state, as the policy serialises it."""

    __tablename__ = "policy_snapshots"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)


class HandoverRow(Base):
    """A request a follower replica's gateway served, waiting for the leader to learn
    from it (``RequestObservation.to_json``); the leader deletes what it takes."""

    __tablename__ = "observation_handover"
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float)
    observation: Mapped[dict[str, Any]] = mapped_column(JSON)


class RestartLeaseRow(Base):
    """One replica's restart of its pool's vLLM (per-pod topology): a lease while
    ``released_at`` is null and ``expires_at`` lies ahead, the log of the rollout after."""

    __tablename__ = "restart_leases"
    __table_args__ = (Index("ix_restart_leases_pool", "pool", "released_at"),)
    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(Name)
    replica: Mapped[str] = mapped_column(Name)
    config: Mapped[str] = mapped_column(Text)
    """The config it restarted into (``controller.exactness.config_text``)."""
    acquired_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    released_at: Mapped[float | None] = mapped_column(Float)
    outcome: Mapped[str | None] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(Text)
    holds: Mapped[bool] = mapped_column(Boolean, default=False)
    """A failed restart whose config no other replica of the pool starts, until the
    pool is handed another config."""


class ServiceStateRow(Base):
    """Small named values that must survive restarts (e.g. whether the policy is frozen)."""

    __tablename__ = "service_state"
    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)
