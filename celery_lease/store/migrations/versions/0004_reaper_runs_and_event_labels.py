"""The reaper records its runs; events carry their job's queue and task; a key/value meta table.

The reaper's liveness is read from the store, whichever scheduler runs it; event counters are labelled
without a join.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.store.migrations import prefix

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ID = 255


def upgrade() -> None:
    p = prefix()
    op.add_column(f"{p}events", sa.Column("queue_name", sa.String(ID), nullable=True))
    op.add_column(f"{p}events", sa.Column("task_name", sa.String(ID), nullable=True))
    op.create_table(
        f"{p}reaper_runs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("duration", sa.Double(), nullable=False),
        sa.Column("worker", sa.String(ID), nullable=True),
        sa.Column("counts", sa.Text(), nullable=True),
    )
    op.create_index(f"{p}reaper_runs_finished_ix", f"{p}reaper_runs", ["finished_at"])
    op.create_table(
        f"{p}meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    p = prefix()
    op.drop_table(f"{p}meta")
    op.drop_index(f"{p}reaper_runs_finished_ix", table_name=f"{p}reaper_runs")
    op.drop_table(f"{p}reaper_runs")
    with op.batch_alter_table(f"{p}events") as batch:
        batch.drop_column("task_name")
        batch.drop_column("queue_name")
