"""A completed job keeps its result, so a delivery after a crash can finish Celery's post-run work.

The completion writes it in the same statement; a delivery that finds the job completed but the result
backend empty stores it and lets Celery send the chain's next step and the link callbacks.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.store.migrations import prefix

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(f"{prefix()}jobs", sa.Column("result", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(f"{prefix()}jobs") as batch:
        batch.drop_column("result")
