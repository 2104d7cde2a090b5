"""MySQL/MariaDB: the columns that hold a message, a result, a checkpoint or an error are LONGTEXT.

``TEXT`` there holds 64 KB, less than Celery sends; ``LONGTEXT`` holds 4 GB (a statement is bounded by
``max_allowed_packet``). Nothing changes on the other databases.

One ``ALTER TABLE`` rewrites the jobs table, holding writes (seconds for millions of rows): migrate with the
workers quiet.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

from celery_lease.store.migrations import prefix

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

LONG = ("mysql", "mariadb")
COLUMNS = ("payload", "checkpoint", "last_error", "result")


def _modify(column_type: str) -> None:
    if op.get_bind().dialect.name not in LONG:
        return
    changes = ", ".join(f"MODIFY {column} {column_type} NULL" for column in COLUMNS)
    op.execute(f"ALTER TABLE {prefix()}jobs {changes}")


def upgrade() -> None:
    _modify("LONGTEXT")


def downgrade() -> None:
    _modify("TEXT")
