"""The first release's schema: jobs, events, workers, effects and locks.

Frozen: this is what celery_lease 0.1 created, and a store made by it is stamped with
this revision, never recreated. Changes land in later revisions.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

from celery_lease.store.migrations import prefix
from celery_lease.store.migrations.first_release import tables

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The same DDL as the first release's create_all, and printable by `migrate --sql`.
    for table in tables(prefix()).sorted_tables:
        op.execute(CreateTable(table))
        for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
            op.execute(CreateIndex(index))


def downgrade() -> None:
    for table in reversed(tables(prefix()).sorted_tables):
        op.execute(DropTable(table))
