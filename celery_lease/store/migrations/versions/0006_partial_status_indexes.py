"""The scans' jobs indexes hold one status each, where the database has partial indexes.

PostgreSQL writes an entry in every index of a row whose indexed column changes, and claims and
completions change the status: partial indexes (PostgreSQL, SQLite) take fewer writes and do not grow
with the finished history. MySQL has no partial indexes: nothing changes there.

Building them blocks writes to the jobs table (seconds for millions of rows): migrate with the workers quiet.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.store.migrations import prefix

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PARTIAL = ("postgresql", "sqlite")
# (old index, new index, status, column)
CHANGES = (("status_lease_ix", "running_lease_ix", "running", "lease_expires_at"),
           ("status_available_ix", "pending_at_ix", "pending", "available_at"))


def upgrade() -> None:
    if op.get_bind().dialect.name not in PARTIAL:
        return
    p = prefix()
    for old, new, status, column in CHANGES:
        where = sa.text(f"status = '{status}'")
        op.create_index(f"{p}jobs_{new}", f"{p}jobs", [column, "id"], postgresql_where=where,
                        sqlite_where=where)
        op.drop_index(f"{p}jobs_{old}", table_name=f"{p}jobs")


def downgrade() -> None:
    if op.get_bind().dialect.name not in PARTIAL:
        return
    p = prefix()
    for old, new, _status, column in CHANGES:
        op.create_index(f"{p}jobs_{old}", f"{p}jobs", ["status", column, "id"])
        op.drop_index(f"{p}jobs_{new}", table_name=f"{p}jobs")
