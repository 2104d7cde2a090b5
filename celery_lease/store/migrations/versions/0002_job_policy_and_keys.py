"""Jobs carry their recovery policy; idempotency keys get a table of their own.

The policy columns let a reaper that does not import a job's task apply the task's own policy; keys
copied from existing jobs outlive those jobs' pruning.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from celery_lease.store.migrations import prefix

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = 255
POLICY_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ("on_expired", sa.String(16)),
    ("max_expirations", sa.Integer()),
    ("backoff_base", sa.Double()),
    ("backoff_max", sa.Double()),
    ("backoff_jitter", sa.Boolean(create_constraint=False)),
    ("dead_letter_queue", sa.String(ID)),
    ("dispatch_timeout", sa.Double()),
)


def upgrade() -> None:
    p = prefix()
    for name, type_ in POLICY_COLUMNS:
        op.add_column(f"{p}jobs", sa.Column(name, type_, nullable=True))
    key = sa.String(ID).with_variant(mysql.VARCHAR(ID, collation="utf8mb4_bin"), "mysql", "mariadb")
    keys = op.create_table(
        f"{p}idempotency_keys",
        sa.Column("key", key, primary_key=True),
        sa.Column("job_id", sa.String(ID), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
    )
    op.create_index(f"{p}idempotency_keys_created_ix", f"{p}idempotency_keys", ["created_at"])
    jobs = sa.table(f"{p}jobs", sa.column("id"), sa.column("idempotency_key"), sa.column("created_at"))
    op.execute(keys.insert().from_select(
        ["key", "job_id", "created_at"],
        sa.select(jobs.c.idempotency_key, jobs.c.id, jobs.c.created_at)
        .where(jobs.c.idempotency_key.is_not(None)),
    ))


def downgrade() -> None:
    p = prefix()
    op.drop_index(f"{p}idempotency_keys_created_ix", table_name=f"{p}idempotency_keys")
    op.drop_table(f"{p}idempotency_keys")
    with op.batch_alter_table(f"{p}jobs") as batch:
        for name, _ in reversed(POLICY_COLUMNS):
            batch.drop_column(name)
