"""When the store's schema is created, recognised, upgraded, or refused.

Only ``migrate`` changes a schema (a worker start may create an empty one); ``ensure`` refuses a revision
outside those this code runs against, naming both and what to run."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.engine import Connection

import celery_lease.store.migrations as migrations
import celery_lease.store.schema as schema

from ..errors import LeaseConfigError, SchemaMismatch, StoreRejected, StoreUnavailable
from ..version import __version__

__all__ = ["migrate", "sql", "ensure", "describe", "drop", "clear"]

log = logging.getLogger(__name__)
MIGRATE_HINT = "run `celery -A proj lease migrate`"


def _first_release_tables(prefix: str) -> sa.MetaData:
    import celery_lease.store.migrations.first_release as first_release

    return first_release.tables(prefix)


def _has_tables(conn: Connection, prefix: str) -> list[str]:
    """The first release's tables that exist under this prefix."""
    existing = set(sa.inspect(conn).get_table_names())
    return [t.name for t in _first_release_tables(prefix).sorted_tables if t.name in existing]


def _recognise_first_release(conn: Connection, prefix: str) -> list[str]:
    """Stamp an unversioned first-release store as 0001 after checking its columns; like that release
    on its starts, create what is missing, so a half-made store is finished, not refused."""
    done: list[str] = []
    inspector = sa.inspect(conn)
    existing = set(inspector.get_table_names())
    for table in _first_release_tables(prefix).sorted_tables:
        if table.name not in existing:
            table.create(conn)
            done.append(f"created table {table.name} (missing from the first release's schema)")
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in have]
        if missing:
            raise SchemaMismatch(
                f"table {table.name} matches no known schema revision: columns {', '.join(missing)} are "
                "missing; restore them from a backup or recreate the store (its data is the lease history)"
            )
        indexes = {ix["name"] for ix in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(conn)
                done.append(f"created index {index.name}")
    migrations.stamp(conn, prefix, migrations.FIRST)
    done.append(f"recognised the first release's tables and stamped them as revision {migrations.FIRST}")
    return done


def _target(to: str) -> str:
    """The revision ``to`` names ("head": the newest); LeaseConfigError for one that is none."""
    target = migrations.head() if to == "head" else to
    if target not in migrations.revisions():
        raise LeaseConfigError("--to", to, "is not a schema revision",
                               "Revisions: " + ", ".join(migrations.revisions()))
    return target


def _migrate(conn: Connection, store: object, to: str, downgrade: bool) -> list[str]:
    prefix = store.prefix  # type: ignore[attr-defined]
    target = _target(to)
    revision = migrations.current(conn, prefix)
    collation = store.dialect.key_collation()  # type: ignore[attr-defined]
    if revision is None and not _has_tables(conn, prefix):
        if target == migrations.head():
            # The same schema as upgrading through every revision (the migration tests prove it).
            schema.tables(prefix, collation).metadata.create_all(conn)
            migrations.stamp(conn, prefix, target)
        else:
            migrations.upgrade(conn, prefix, target, key_collation=collation)
        return [f"created the schema at revision {target}"]
    done: list[str] = []
    if revision is None:
        done += _recognise_first_release(conn, prefix)
        revision = migrations.FIRST
    order = migrations.revisions()
    if not downgrade and (revision not in order or order.index(revision) >= order.index(target)):
        return done  # already at or past ``to`` (a newer release's revision is past every one known here)
    if order.index(target) > order.index(revision):
        migrations.upgrade(conn, prefix, target, key_collation=collation)
        done.append(f"upgraded revision {revision} -> {target}")
    elif order.index(target) < order.index(revision):
        migrations.downgrade(conn, prefix, target, key_collation=collation)
        done.append(f"downgraded revision {revision} -> {target}")
    return done


def migrate(store: object, to: str = "head", *, downgrade: bool = True) -> list[str]:
    """Bring the store to revision ``to``; returns what was done (empty: already there).

    ``downgrade=False`` only upgrades: a store already at or past ``to`` is left as it is (a Django
    forwards migration, run after a worker start or `lease migrate` brought the store further)."""
    for attempt in (1, 2):
        try:
            # DDL is no lease's business: it gets the long bound of operators' calls.
            with store.begin(long=True) as conn:  # type: ignore[attr-defined]
                done = _migrate(conn, store, to, downgrade)
            break
        except (SchemaMismatch, LeaseConfigError):
            raise
        except (StoreUnavailable, StoreRejected) as exc:
            # Two processes creating one store race; MySQL's DDL is not transactional: look again.
            if attempt == 2:
                raise type(exc)(
                    f"cannot migrate lease store {store.safe_url}: {exc}",  # type: ignore[attr-defined]
                    **exc.context) from exc
            log.debug("migrate raced (%s); looking again", exc)
    store.revision = None  # type: ignore[attr-defined]
    return done


def sql(store: object, to: str = "head") -> str:
    """The DDL that moves the store from its revision (an unversioned one with tables: 0001) to ``to``,
    read without changing it."""
    target = _target(to)
    revision, has_tables = describe(store)
    if revision is None and has_tables:
        revision = migrations.FIRST
    if revision == target:
        return f"-- lease store already at revision {target}: nothing to run\n"
    url, prefix = store.url, store.prefix  # type: ignore[attr-defined]
    # describe() has connected: the dialect knows MySQL from MariaDB.
    collation = store.dialect.key_collation()  # type: ignore[attr-defined]
    from alembic.util import CommandError

    try:
        return migrations.sql(url, prefix, target, start=revision, key_collation=collation)
    except CommandError as exc:
        # SQLite's older downgrades rebuild tables from the live ones (alembic's batch mode): no script
        # can be written for them without running them.
        raise LeaseConfigError("--to", to, "with --sql: this downgrade rebuilds tables from the live ones, "
                               "so it cannot be printed as a script",
                               f"back up the store, then run `celery lease migrate --to {to} --yes`") from exc


def describe(store: object) -> tuple[str | None, bool]:
    """(revision, has tables) of a store, read without changing it."""
    prefix = store.prefix  # type: ignore[attr-defined]
    with store.begin(long=True, read=True) as conn:  # type: ignore[attr-defined]
        revision = migrations.current(conn, prefix)
        return revision, revision is not None or bool(_has_tables(conn, prefix))


def ensure(store: object, create: bool = False) -> str:
    """The store's revision, once it is one this code runs against; SchemaMismatch otherwise."""
    revision, has_tables = describe(store)
    url = store.safe_url  # type: ignore[attr-defined]
    if not has_tables:
        if not create:
            raise SchemaMismatch(
                f"lease store {url} has no celery_lease tables (prefix "
                f"{store.prefix!r}); start a worker or {MIGRATE_HINT}"  # type: ignore[attr-defined]
            )
        migrate(store)
        revision = migrations.head()
    oldest, newest = migrations.supported()
    order = migrations.revisions()
    if revision is None or revision not in order or order.index(revision) < order.index(oldest):
        have = f"revision {revision}" if revision else f"the first release's schema ({migrations.FIRST})"
        if revision is not None and revision not in order:
            fix = "upgrade celery_lease on this host to the release that made it"
        else:
            fix = MIGRATE_HINT
        raise SchemaMismatch(
            f"lease store {url} is at {have}; celery_lease {__version__} runs against revisions "
            f"{oldest} to {newest}: {fix}"
        )
    store.revision = revision  # type: ignore[attr-defined]
    return revision


def drop(store: object) -> list[str]:
    """Drop the store's own tables, its version table included; the tables dropped.

    Its own: the newest schema's tables (every revision only added tables) and the version table, as
    they exist now. An application's table that merely starts with the prefix (``shop_order`` beside
    the store's ``shop_jobs``) is not the store's and stays."""
    own = {table.name for table in store.t.metadata.tables.values()}  # type: ignore[attr-defined]
    own.add(migrations.version_table(store.prefix))  # type: ignore[attr-defined]
    tables = sa.MetaData()
    with store.begin(long=True) as conn:  # type: ignore[attr-defined]
        tables.reflect(conn, only=lambda name, _: name in own)
        tables.drop_all(conn)
    store.revision = None  # type: ignore[attr-defined]
    return sorted(tables.tables)


def clear(store: object) -> int:
    """Delete every row of the store's tables, its version table kept (tests sharing one database)."""
    deleted = 0
    with store.begin(long=True) as conn:  # type: ignore[attr-defined]
        for table in reversed(store.t.metadata.sorted_tables):  # type: ignore[attr-defined]
            deleted += conn.execute(table.delete()).rowcount
    return deleted
