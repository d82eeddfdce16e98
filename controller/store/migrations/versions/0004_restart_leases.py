"""Restart leases of the per-pod topology: one row per replica's restart of its pool's
vLLM, the lease while it runs and the log after (``controller.actuators.rolling``).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "restart_leases",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("pool", sa.String(200), nullable=False),
        sa.Column("replica", sa.String(200), nullable=False),
        sa.Column("config", sa.Text(), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("released_at", sa.Float(), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("holds", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_restart_leases_pool", "restart_leases", ["pool", "released_at"])


def downgrade() -> None:
    op.drop_index("ix_restart_leases_pool", table_name="restart_leases")
    op.drop_table("restart_leases")
