"""The lease store on a Django database: ``CELERY_LEASE_DATABASE = "default"`` (store.database_url).

The URL follows the alias's settings_dict (the test database under Django's test runner); the store opens its
own connections, so a heartbeat never waits on (or commits) a request's transaction."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from ..errors import LeaseConfigError

__all__ = ["store_url", "url_from_settings", "in_own_transaction"]

SETTING = "lease_database"
# OPTIONS keys that are Django's own, not the driver's connection parameters.
DJANGO_OPTIONS = frozenset({"isolation_level", "pool", "server_side_binding", "assume_role", "cursor_factory",
                            "context", "init_command", "transaction_mode", "timeout", "check_same_thread",
                            "detect_types", "uri", "cached_statements", "factory"})


def store_url(alias: str) -> str:
    """The store URL of Django database ``alias`` as it is configured now (the test database in tests)."""
    from django.db import connections
    from django.utils.connection import ConnectionDoesNotExist

    try:
        settings_dict = connections[alias].settings_dict
    except ConnectionDoesNotExist:
        raise LeaseConfigError(SETTING, alias, "names no database of settings.DATABASES",
                               "Set it to one of: " + ", ".join(connections)) from None
    return url_from_settings(alias, settings_dict)


def url_from_settings(alias: str, settings_dict: Mapping[str, Any]) -> str:
    """The SQLAlchemy URL of one ``DATABASES`` entry (PostgreSQL, MySQL/MariaDB or SQLite)."""
    engine = str(settings_dict.get("ENGINE") or "")
    vendor = engine.rsplit(".", 1)[-1]
    if vendor in ("postgresql", "postgis", "postgresql_psycopg2"):
        return _server_url(_postgres_driver(), settings_dict)
    if vendor == "mysql":
        return _server_url(_mysql_driver(), settings_dict)
    if vendor in ("sqlite3", "spatialite"):
        return _sqlite_url(alias, str(settings_dict.get("NAME") or ""))
    raise LeaseConfigError(SETTING, alias, f"is a {engine or 'ENGINE-less'} database",
                           "The store runs on PostgreSQL, MySQL/MariaDB or SQLite: name such an alias, "
                           "or set lease_store_url instead.")


def _server_url(drivername: str, settings_dict: Mapping[str, Any]) -> str:
    options = settings_dict.get("OPTIONS") or {}
    query = {key: str(value) for key, value in options.items()
             if key not in DJANGO_OPTIONS and isinstance(value, (str, int)) and not isinstance(value, bool)}
    port = settings_dict.get("PORT")
    url = sa.engine.URL.create(drivername, username=settings_dict.get("USER") or None,
                               password=settings_dict.get("PASSWORD") or None,
                               host=settings_dict.get("HOST") or None, port=int(port) if port else None,
                               database=str(settings_dict.get("NAME") or "") or None, query=query)
    return url.render_as_string(hide_password=False)


def _sqlite_url(alias: str, name: str) -> str:
    private = name.startswith("file:") and "mode=memory" in name and "cache=shared" not in name
    if name in ("", ":memory:") or private:
        # Every connection to a private in-memory database opens a database of its own.
        raise LeaseConfigError(SETTING, alias, f"is a private in-memory SQLite database "
                               f"({name or 'no NAME'}) that no other connection can open",
                               "Give the database a file NAME, or run under Django's test runner (its "
                               "in-memory test database is shared).")
    if name.startswith("file:"):
        return f"sqlite:///{name}{'&' if '?' in name else '?'}uri=true"
    return f"sqlite:///{name}"


def _postgres_driver() -> str:
    # Django itself takes psycopg 3 when both are installed.
    for module, driver in (("psycopg", "postgresql+psycopg"), ("psycopg2", "postgresql+psycopg2")):
        if _importable(module):
            return driver
    raise LeaseConfigError(SETTING, "postgresql", "needs a PostgreSQL driver",
                           "pip install 'psycopg[binary]'")


def _mysql_driver() -> str:
    import importlib

    try:
        MySQLdb = importlib.import_module("MySQLdb")  # noqa: N806 - the driver's module name
    except ImportError:
        pass
    else:
        # PyMySQL's install_as_MySQLdb() puts itself in MySQLdb's place.
        return "mysql+pymysql" if MySQLdb.__name__ == "pymysql" else "mysql+mysqldb"
    if _importable("pymysql"):
        return "mysql+pymysql"
    raise LeaseConfigError(SETTING, "mysql", "needs a MySQL driver", "pip install mysqlclient (or PyMySQL)")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def in_own_transaction(database: str | None) -> bool:
    """Whether a Django connection of this thread to the SQLite file ``database`` is inside a transaction (a
    ``transaction.atomic()``): the store's own connections to that file wait for it to end before they write,
    and this thread would wait on itself."""
    db = sys.modules.get("django.db")
    if db is None or not database or database.startswith("file:"):
        return False
    target = os.path.realpath(database)
    for conn in db.connections.all(initialized_only=True):
        raw = conn.connection
        if (conn.vendor == "sqlite" and raw is not None and getattr(raw, "in_transaction", False)
                and os.path.realpath(str(conn.settings_dict.get("NAME") or "")) == target):
            return True
    return False


def holds_store_file(store: Any) -> bool:
    """Whether ``store`` is a SQLite file this thread's own Django transaction holds: a write of the store's
    own would wait on that transaction, which waits on the write (no outage: the caller's own lock)."""
    return bool(store.dialect.single_writer) and in_own_transaction(store.engine.url.database)
