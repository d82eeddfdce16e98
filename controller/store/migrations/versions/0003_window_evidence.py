"""Window stats carry what the policy learned from them: class, bucket, arm, requests,
tokens, mean time per output token, and why a window was not evidence.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_COLUMNS = (
    ("workload_class", sa.String(200)),
    ("bucket", sa.String(32)),
    ("arm", sa.String(200)),
    ("requests", sa.Float()),
    ("generation_tokens", sa.Float()),
    ("tpot_mean_s", sa.Float()),
    ("status", sa.Text()),
)


def upgrade() -> None:
    with op.batch_alter_table("window_stats") as batch:
        for name, kind in _COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("window_stats") as batch:
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
