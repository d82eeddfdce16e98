"""Initial schema: observations, roll-ups, window stats, decisions, overrides, alerts,
policy snapshots, service state.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
NAME = sa.String(200)


def _id() -> sa.Column[int]:
    return sa.Column("id", ID, primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "observations",
        _id(),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("model", NAME, nullable=False),
        sa.Column("workload_class", NAME, nullable=False),
        sa.Column("bucket", sa.String(32), nullable=False),
        sa.Column("pool", NAME, nullable=True),
        sa.Column("arm", NAME, nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("tpot_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("acceptance_rate", sa.Float(), nullable=True),
        sa.Column("mean_acceptance_length", sa.Float(), nullable=True),
    )
    op.create_index("ix_observations_ts", "observations", ["ts"])
    op.create_table(
        "observation_rollups",
        _id(),
        sa.Column("period_start", sa.Float(), nullable=False),
        sa.Column("period_s", sa.Float(), nullable=False),
        sa.Column("model", NAME, nullable=False),
        sa.Column("workload_class", NAME, nullable=False),
        sa.Column("bucket", sa.String(32), nullable=False),
        sa.Column("arm", NAME, nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("tpot_sum", sa.Float(), nullable=False),
        sa.Column("tpot_count", sa.Integer(), nullable=False),
        sa.Column("ttft_sum", sa.Float(), nullable=False),
        sa.Column("ttft_count", sa.Integer(), nullable=False),
        sa.Column("acceptance_sum", sa.Float(), nullable=False),
        sa.Column("acceptance_count", sa.Integer(), nullable=False),
        sa.Column("acceptance_length_sum", sa.Float(), nullable=False),
        sa.Column("acceptance_length_count", sa.Integer(), nullable=False),
        sa.UniqueConstraint("period_start", "model", "workload_class", "bucket", "arm"),
    )
    op.create_index("ix_observation_rollups_period_start", "observation_rollups", ["period_start"])
    op.create_table(
        "window_stats",
        _id(),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("pool", NAME, nullable=False),
        sa.Column("instance", sa.String(500), nullable=False),
        sa.Column("model", NAME, nullable=False),
        sa.Column("window_s", sa.Float(), nullable=False),
        sa.Column("acceptance_rate", sa.Float(), nullable=True),
        sa.Column("mean_acceptance_length", sa.Float(), nullable=True),
        sa.Column("tpot_p50_s", sa.Float(), nullable=True),
        sa.Column("requests_running", sa.Float(), nullable=True),
        sa.Column("healthy", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_window_stats_ts", "window_stats", ["ts"])
    op.create_table(
        "decisions",
        _id(),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("model", NAME, nullable=False),
        sa.Column("workload_class", NAME, nullable=False),
        sa.Column("bucket", sa.String(32), nullable=False),
        sa.Column("arm", NAME, nullable=False),
        sa.Column("previous_arm", NAME, nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("predicted_speedup", sa.Float(), nullable=True),
        sa.Column("measured_speedup", sa.Float(), nullable=True),
        sa.Column("actor", sa.String(16), nullable=False),
    )
    op.create_index("ix_decisions_ts", "decisions", ["ts"])
    op.create_index(
        "ix_decisions_context", "decisions", ["model", "workload_class", "bucket", "id"]
    )
    op.create_table(
        "overrides",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("deleted_at", sa.Float(), nullable=True),
        sa.Column("model", NAME, nullable=False),
        sa.Column("workload_class", NAME, nullable=False),
        sa.Column("bucket", sa.String(32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )
    op.create_index("ix_overrides_expires_at", "overrides", ["expires_at"])
    op.create_table(
        "alerts",
        _id(),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("context", sa.String(500), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("resolved_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_alerts_ts", "alerts", ["ts"])
    op.create_table(
        "policy_snapshots",
        _id(),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
    )
    op.create_index("ix_policy_snapshots_ts", "policy_snapshots", ["ts"])
    op.create_table(
        "service_state",
        sa.Column("key", sa.String(100), primary_key=True),
        sa.Column("value", sa.JSON(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    for table in (
        "service_state",
        "policy_snapshots",
        "alerts",
        "overrides",
        "decisions",
        "window_stats",
        "observation_rollups",
        "observations",
    ):
        op.drop_table(table)
