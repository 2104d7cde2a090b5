"""The scans' jobs indexes hold one status each, where the database has partial indexes.

PostgreSQL writes a new entry in every index of a row it updates when an indexed column
changes, and a claim or a completion changes the status. The expired-lease scan only
reads running jobs and the dispatch scan only pending ones, so their indexes now hold only
those rows (PostgreSQL and SQLite): a claim adds no entry to the pending index and a
completion none to either, and neither index grows with the finished history. MySQL has no
partial indexes and keeps the (status, ...) ones; nothing changes there.

Building the two indexes reads the jobs table once and blocks its writes meanwhile (on
PostgreSQL, seconds for millions of rows): run it with the workers stopped or quiet.

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
