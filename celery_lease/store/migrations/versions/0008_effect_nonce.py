"""An effect key carries the mark of the call that recorded it.

A worker whose commit of a key went through but whose answer was lost (the connection dropped at the
commit) tries again and finds the key; with the mark it knows the key is its own and runs the effect,
where before it read the key as another attempt's and skipped an effect that never happened. One
nullable column: no rewrite of existing rows on any of the databases.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_lease.store.migrations import prefix

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(f"{prefix()}effects", sa.Column("nonce", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(f"{prefix()}effects") as batch:
        batch.drop_column("nonce")
