"""MySQL/MariaDB: job ids, worker ids, idempotency and effect keys and lock names compare byte for byte.

The id columns took the server's default collation (``utf8mb4_general_ci`` and the like), which ignores
case, accents and trailing spaces: ``Order-42`` and ``order-42`` were one job, and the second one's delivery
found the first's row and never ran. The keys' ``utf8mb4_bin`` ignores trailing spaces: ``k`` and ``k ``
were one effect key. Each such column now takes the server's binary NO PAD collation (``utf8mb4_nopad_bin``
on MariaDB, ``utf8mb4_0900_bin`` on MySQL).
Nothing changes on the other databases, which compare bytes already.

One ``ALTER TABLE`` per table rewrites it (jobs and events hold most rows), holding its writes meanwhile:
migrate with the workers quiet. Going back refuses while two ids or keys would become one under the old
collations, naming them: delete or rename one of each first.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import itertools

import sqlalchemy as sa
from alembic import context, op

from celery_lease.errors import SchemaMismatch
from celery_lease.store.migrations import key_collation, prefix

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

MYSQL = ("mysql", "mariadb")
ID = 255
BIN = "utf8mb4_bin"
# (table, column, nullable, unique, collation before this revision: None for the table's default)
COLUMNS = (
    ("jobs", "id", False, True, None),
    ("jobs", "idempotency_key", True, True, BIN),
    ("jobs", "locked_by", True, False, None),
    ("events", "job_id", True, False, None),
    ("events", "worker", True, False, None),
    ("workers", "worker_id", False, True, None),
    ("effects", "key", False, True, BIN),
    ("effects", "job_id", False, False, None),
    ("locks", "resource", False, True, BIN),
    ("locks", "job_id", True, False, None),
    ("locks", "owner", True, False, None),
    ("idempotency_keys", "key", False, True, BIN),
    ("idempotency_keys", "job_id", False, False, None),
    ("reaper_runs", "worker", True, False, None),
)


def _modify(collation_of: dict[str | None, str]) -> None:
    """One ALTER TABLE per table; a column whose collation maps to "" takes the table's default."""
    for table, columns in itertools.groupby(COLUMNS, key=lambda c: c[0]):
        changes = []
        for _, column, nullable, _unique, before in columns:
            collation = collation_of[before]
            charset = f" CHARACTER SET utf8mb4 COLLATE {collation}" if collation else ""
            changes.append(f"MODIFY `{column}` VARCHAR({ID}){charset} {'NULL' if nullable else 'NOT NULL'}")
        op.execute(f"ALTER TABLE {prefix()}{table} {', '.join(changes)}")


def _table_collation(table: str) -> str:
    return op.get_bind().execute(sa.text(
        "SELECT TABLE_COLLATION FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
        "AND TABLE_NAME = :name"), {"name": f"{prefix()}{table}"}).scalar_one()


def _refuse_collisions() -> None:
    """SchemaMismatch naming the unique values that the old collations would make one, before any change."""
    found = []
    for table, column, _nullable, unique, before in COLUMNS:
        if not unique:
            continue
        collation = before or _table_collation(table)
        charset = collation.split("_", 1)[0]
        rows = op.get_bind().execute(sa.text(
            f"SELECT MIN(`{column}`), MAX(`{column}`) FROM {prefix()}{table} WHERE `{column}` IS NOT NULL "
            f"GROUP BY CONVERT(`{column}` USING {charset}) COLLATE {collation} HAVING COUNT(*) > 1 LIMIT 3"))
        found += [f"{table}.{column} {low!r} and {high!r}" for low, high in rows]
    if found:
        raise SchemaMismatch(
            "cannot go back to revision 0008: its collations would make these values one (they differ only "
            f"by case, accents or trailing spaces): {'; '.join(found)}; delete or rename one of each first")


def upgrade() -> None:
    if op.get_bind().dialect.name not in MYSQL:
        return
    exact = key_collation() or BIN
    _modify({None: exact, BIN: exact})


def downgrade() -> None:
    if op.get_bind().dialect.name not in MYSQL:
        return
    if not context.is_offline_mode():
        _refuse_collisions()
    _modify({None: "", BIN: BIN})
