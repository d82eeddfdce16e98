"""Observations a follower replica's gateway hands over to the leader.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "observation_handover",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("observation", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("observation_handover")
