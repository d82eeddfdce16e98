"""Decisions carry the reason's detail and every alternative's prediction: ``reason``
becomes a word of the vocabulary (``policies.reasons``), its free text moves to
``detail``.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.add_column(sa.Column("detail", sa.Text(), nullable=True))
        batch.add_column(sa.Column("alternatives", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("alternatives")
        batch.drop_column("detail")
