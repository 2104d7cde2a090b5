"""The lease store on a Django database: ``CELERY_LEASE_DATABASE = "default"`` (store.database_url).

The URL follows the alias's settings_dict (the test database under Django's test runner); the store opens its
own connections, so a heartbeat never waits on (or commits) a request's transaction. A ``HOST`` that starts
with ``/`` is a Unix socket, as Django takes it; every driver ``OPTIONS`` entry reaches the URL or is refused,
never dropped."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa

from ..errors import LeaseConfigError

__all__ = ["store_url", "url_from_settings", "in_own_transaction"]

log = logging.getLogger(__name__)

SETTING = "lease_database"
# OPTIONS keys that are Django's own, not the driver's connection parameters.
DJANGO_OPTIONS = frozenset({"isolation_level", "pool", "server_side_binding", "assume_role", "cursor_factory",
                            "context", "init_command", "transaction_mode", "timeout", "check_same_thread",
                            "detect_types", "uri", "cached_statements", "factory"})
# The last part of each ENGINE the store runs on, by database family.
FAMILIES = {"postgresql": ("postgresql", "postgis", "postgresql_psycopg2"), "mysql": ("mysql",),
            "sqlite": ("sqlite3", "spatialite")}
# The keys of MySQL's OPTIONS["ssl"] (Django's documented form) that SQLAlchemy's MySQL drivers take in a URL,
# as ``ssl_<key>``; check_hostname is a bool.
MYSQL_SSL_KEYS = ("ca", "cert", "key", "capath", "cipher", "check_hostname")
# MySQL OPTIONS that SQLAlchemy's MySQL dialects convert from a URL's "true"/"false" themselves.
MYSQL_BOOL_KEYS = ("compress", "local_infile", "use_unicode")


def store_url(alias: str) -> str:
    """The store URL of Django database ``alias`` as it is configured now (the test database in tests)."""
    from django.db import connections

    if alias not in connections.settings:
        raise LeaseConfigError(SETTING, alias, "names no database of settings.DATABASES",
                               "Set it to one of: " + ", ".join(connections))
    # Another kind of database is named before connections[alias] loads Django's backend for it (whose
    # driver may not even be installed: `manage.py check` would end in an ImportError).
    _family(alias, connections.settings[alias])
    return url_from_settings(alias, connections[alias].settings_dict)


def url_from_settings(alias: str, settings_dict: Mapping[str, Any]) -> str:
    """The SQLAlchemy URL of one ``DATABASES`` entry (PostgreSQL, MySQL/MariaDB or SQLite)."""
    family = _family(alias, settings_dict)
    if family == "postgresql":
        return _server_url(_postgres_driver(), settings_dict, _driver_options(alias, settings_dict), "host")
    if family == "mysql":
        query = _driver_options(alias, settings_dict, ssl=True)
        return _server_url(_mysql_driver(), settings_dict, query, "unix_socket")
    return _sqlite_url(alias, str(settings_dict.get("NAME") or ""))


def _family(alias: str, settings_dict: Mapping[str, Any]) -> str:
    """"postgresql", "mysql" or "sqlite" for an entry's ENGINE; LeaseConfigError for any other."""
    engine = str(settings_dict.get("ENGINE") or "")
    vendor = engine.rsplit(".", 1)[-1]
    for family, vendors in FAMILIES.items():
        if vendor in vendors:
            return family
    raise LeaseConfigError(SETTING, alias, f"is a {engine or 'ENGINE-less'} database",
                           "The store runs on PostgreSQL, MySQL/MariaDB or SQLite: name such an alias, "
                           "or set lease_store_url instead.")


def _server_url(drivername: str, settings_dict: Mapping[str, Any], query: dict[str, str], socket: str) -> str:
    """``socket``: the driver's URL parameter for a Unix socket ``HOST`` (PostgreSQL's directory, MySQL's
    socket file), which as the URL's host would be read as a host name and a database path."""
    host = str(settings_dict.get("HOST") or "") or None
    if host is not None and host.startswith("/"):
        query[socket], host = host, None
    port = settings_dict.get("PORT")
    url = sa.engine.URL.create(drivername, username=settings_dict.get("USER") or None,
                               password=settings_dict.get("PASSWORD") or None,
                               host=host, port=int(port) if port else None,
                               database=str(settings_dict.get("NAME") or "") or None, query=query)
    return url.render_as_string(hide_password=False)


def _driver_options(alias: str, settings_dict: Mapping[str, Any], ssl: bool = False) -> dict[str, str]:
    """The driver's ``OPTIONS`` as URL query parameters (Django's own left out, an unset one too), with
    ``ssl`` (MySQL): its ``OPTIONS["ssl"]`` dict as the ``ssl_*`` parameters, a key of which the URL cannot
    carry a LeaseConfigError (the store would connect without TLS). Another option a URL cannot carry is
    left out with a WARNING, as Django-only settings are."""
    query: dict[str, str] = {}
    for key, value in (settings_dict.get("OPTIONS") or {}).items():
        if key in DJANGO_OPTIONS or value is None:
            continue
        if ssl and key == "ssl" and isinstance(value, Mapping):
            query.update(_mysql_ssl(alias, value))
        elif isinstance(value, bool) and ssl and key in MYSQL_BOOL_KEYS:
            query[key] = "true" if value else "false"  # SQLAlchemy's MySQL dialects read these as booleans
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            query[key] = str(value)
        else:
            # Not as a string ("False" would be true), nor silently: the value is not shown (a secret?).
            log.warning("Django database %r: OPTIONS[%r], a %s, is not passed to the lease store's own "
                        "connections (their URL carries strings and numbers); set CELERY_LEASE_STORE_URL "
                        "for a store that needs it", alias, key, type(value).__name__,
                        extra={"action": "store_option_left_out"})
    return query


def _mysql_ssl(alias: str, ssl: Mapping[str, Any]) -> dict[str, str]:
    """MySQL's ``OPTIONS["ssl"]`` dict as the ``ssl_*`` URL parameters SQLAlchemy's MySQL drivers take."""
    query = {}
    for key, value in ssl.items():
        valid = isinstance(value, bool) if key == "check_hostname" else isinstance(value, (str, os.PathLike))
        if key not in MYSQL_SSL_KEYS or not valid:
            what = f"a {type(value).__name__}" if key in MYSQL_SSL_KEYS else "a key"
            raise LeaseConfigError(SETTING, alias, f"has OPTIONS['ssl'][{key!r}], {what} the store's own "
                                   "connections cannot take",
                                   f"They take the keys {', '.join(MYSQL_SSL_KEYS)} (check_hostname True or "
                                   "False, the others a path or a name): write the TLS settings so, or put "
                                   "the store on CELERY_LEASE_STORE_URL instead of CELERY_LEASE_DATABASE.")
        query[f"ssl_{key}"] = ("true" if value else "false") if key == "check_hostname" else str(value)
    return query


def _sqlite_url(alias: str, name: str) -> str:
    private = name.startswith("file:") and "mode=memory" in name and "cache=shared" not in name
    if name in ("", ":memory:") or private:
        # Every connection to a private in-memory database opens a database of its own.
        raise LeaseConfigError(SETTING, alias, f"is a private in-memory SQLite database "
                               f"({name or 'no NAME'}) that no other connection can open",
                               "Give the database a file NAME, or run under Django's test runner (its "
                               "in-memory test database is shared).")
    path, query = name, ""
    if name.startswith("file:"):  # a URI: its path is SQLite's to percent-decode, its query SQLite's options
        path, _, options = name.partition("?")
        query = f"?{options}&uri=true" if options else "?uri=true"
    # SQLAlchemy 2.1 percent-decodes a URL's database, so the path goes quoted (else "%41" opens "A" and "?"
    # starts the query); 2.0 takes it as it is, and cannot carry a "?" at all.
    for database in (quote(path, safe="/: "), path):
        url = f"sqlite:///{database}{query}"
        if sa.engine.make_url(url).database == path:
            return url
    raise LeaseConfigError(SETTING, alias, f"is a SQLite file ({name}) whose path SQLAlchemy "
                           f"{sa.__version__} cannot carry in a URL: the store would open another file",
                           "Upgrade SQLAlchemy to 2.1, or rename the file without '?' in its path.")


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
    db, conf = sys.modules.get("django.db"), sys.modules.get("django.conf")
    if db is None or not database or database.startswith("file:"):
        return False
    if conf is None or not conf.settings.configured:  # imported by some library, never set up: no connection
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
