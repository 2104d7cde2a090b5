"""Workers record their pool and concurrency, so `lease check` judges the pool in use.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.store.migrations import prefix

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = prefix()
    op.add_column(f"{p}workers", sa.Column("pool", sa.String(32), nullable=True))
    op.add_column(f"{p}workers", sa.Column("concurrency", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(f"{prefix()}workers") as batch:
        batch.drop_column("concurrency")
        batch.drop_column("pool")
