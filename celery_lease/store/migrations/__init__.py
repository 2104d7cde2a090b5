"""The lease store's schema revisions: Alembic scripts driven from code (store/migrating.py decides when).

The version table carries the store's table prefix, so it never meets the application's own Alembic history.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

__all__ = ["FIRST", "prefix", "key_collation", "version_table", "revisions", "head", "supported", "current",
           "upgrade", "downgrade", "stamp", "sql"]

HERE = Path(__file__).parent
FIRST = "0001"


def prefix() -> str:
    """The table prefix of the store being migrated (for the revision scripts)."""
    from alembic import context

    return context.config.attributes["prefix"]


def key_collation() -> str | None:
    """The MySQL/MariaDB collation of the id and key columns on the server being migrated
    (Dialect.key_collation); None on the other databases."""
    from alembic import context

    return context.config.attributes["key_collation"]


def version_table(table_prefix: str) -> str:
    return f"{table_prefix}alembic_version"


def _config(table_prefix: str, **attributes: Any) -> Config:
    buffer = io.StringIO()
    cfg = Config(output_buffer=buffer, stdout=buffer)
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes.update(prefix=table_prefix, version_table=version_table(table_prefix), **attributes)
    return cfg


@functools.cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config(""))


@functools.cache
def revisions() -> tuple[str, ...]:
    """Every revision id, oldest first."""
    return tuple(reversed([script.revision for script in _script().walk_revisions()]))


def head() -> str:
    return revisions()[-1]


def supported() -> tuple[str, str]:
    """The oldest and newest revision this code runs against: the head and the one before it, so a rolling
    deploy starts the new workers first and runs `lease migrate` once the old ones are gone."""
    all_revisions = revisions()
    return all_revisions[max(0, len(all_revisions) - 2)], all_revisions[-1]


@contextlib.contextmanager
def _quiet_read() -> Any:
    """Alembic logs two INFO lines for every context it configures, a read of the revision included: every
    worker start would print them. Held at WARNING for the read, unless the app set alembic's level."""
    logger = logging.getLogger("alembic.runtime.migration")
    if logger.level != logging.NOTSET:
        yield
        return
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(logging.NOTSET)


def current(conn: Connection, table_prefix: str) -> str | None:
    """The revision a store's version table names, or None when it has none."""
    with _quiet_read():
        context = MigrationContext.configure(conn, opts={"version_table": version_table(table_prefix)})
    return context.get_current_revision()


def upgrade(conn: Connection, table_prefix: str, to: str, *, key_collation: str | None) -> None:
    command.upgrade(_config(table_prefix, connection=conn, key_collation=key_collation), to)


def downgrade(conn: Connection, table_prefix: str, to: str, *, key_collation: str | None) -> None:
    command.downgrade(_config(table_prefix, connection=conn, key_collation=key_collation), to)


def stamp(conn: Connection, table_prefix: str, revision: str) -> None:
    command.stamp(_config(table_prefix, connection=conn), revision)


def sql(url: str, table_prefix: str, to: str, start: str | None = None, *, key_collation: str | None) -> str:
    """The DDL that moves a store from ``start`` (None: empty) to ``to``, for a DBA to run; ``key_collation``
    is the server's (Dialect.key_collation), which a script printed without a connection cannot ask."""
    cfg = _config(table_prefix, url=url, key_collation=key_collation)
    target = f"{start}:{to}" if start else to
    going_down = start is not None and revisions().index(to) < revisions().index(start)
    (command.downgrade if going_down else command.upgrade)(cfg, target, sql=True)
    buffer = cfg.output_buffer
    assert isinstance(buffer, io.StringIO)  # _config gives every offline run one
    return buffer.getvalue()
