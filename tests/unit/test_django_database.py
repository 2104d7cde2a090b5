"""celery_lease.store.django_database: the store URL of a Django ``DATABASES`` entry.

Pure unit tests of the URL each backend's settings give (the drivers of this venv: psycopg 3 and
PyMySQL), and ``manage.py check`` refusing the store on both a database alias and a URL. The
store opening those databases for real is shown by test_django_testing.py and test_django_schema.py;
here only through a Unix socket ``HOST``, where this machine has one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_lease.errors import LeaseConfigError
from celery_lease.store import Store
from tests.conftest import service_url, unique_prefix

pytest.importorskip("django")

from celery_lease.store.django_database import url_from_settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_a_postgresql_database_gives_a_psycopg_url_with_its_credentials_and_driver_options():
    url = sa.engine.make_url(url_from_settings("default", {
        "ENGINE": "django.db.backends.postgresql", "NAME": "test_shop", "USER": "shop", "PASSWORD": "p@ss",
        "HOST": "db", "PORT": "5433", "OPTIONS": {"sslmode": "require", "isolation_level": 1}}))
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg", "shop", "p@ss", "db", 5433, "test_shop")
    assert dict(url.query) == {"sslmode": "require"}  # Django's own options stay Django's


def mysql_driver() -> str:
    try:
        import MySQLdb
    except ImportError:
        return "mysql+pymysql"
    return "mysql+pymysql" if MySQLdb.__name__ == "pymysql" else "mysql+mysqldb"


def test_a_mysql_database_gives_a_url_of_the_installed_driver():
    url = sa.engine.make_url(url_from_settings("default", {
        "ENGINE": "django.db.backends.mysql", "NAME": "test_shop", "USER": "root", "PASSWORD": "",
        "HOST": "127.0.0.1", "PORT": "", "OPTIONS": {"charset": "utf8mb4"}}))
    assert (url.drivername, url.username, url.password, url.port, url.database) == (
        mysql_driver(), "root", None, None, "test_shop")
    assert dict(url.query) == {"charset": "utf8mb4"}


def test_a_sqlite_file_and_djangos_shared_in_memory_test_database_are_opened_by_name():
    assert url_from_settings("default", {"ENGINE": "django.db.backends.sqlite3",
                                         "NAME": Path("/srv/db.sqlite3")}) == "sqlite:////srv/db.sqlite3"
    shared = url_from_settings("default", {"ENGINE": "django.db.backends.sqlite3",
                                           "NAME": "file:memorydb_default?mode=memory&cache=shared"})
    url = sa.engine.make_url(shared)
    assert (url.database, dict(url.query)) == ("file:memorydb_default",
                                               {"mode": "memory", "cache": "shared", "uri": "true"})


@pytest.mark.parametrize("file_name",
                         ["dev%41.sqlite3", "dev?x=1.sqlite3", "dev#1.sqlite3", "my dev.sqlite3"],
                         ids=["percent", "question-mark", "hash", "space"])
def test_a_sqlite_name_with_url_characters_is_the_file_the_store_opens(tmp_path, file_name):
    # Django's backend opens NAME as it is: the store must open that file, no other.
    settings = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / file_name)}
    if "?" in file_name and sa.engine.make_url("sqlite:///a%3F").database != "a?":
        # SQLAlchemy 2.0 neither decodes a URL's database nor ends it anywhere but at a "?".
        with pytest.raises(LeaseConfigError, match=r"cannot carry in a URL.*Upgrade SQLAlchemy to 2\.1"):
            url_from_settings("default", settings)
        return
    store = Store(url_from_settings("default", settings))
    try:
        store.migrate()
    finally:
        store.dispose()
    assert [p.name for p in tmp_path.iterdir()] == [file_name]


def test_a_sqlite_uri_name_keeps_its_percent_encoded_path_for_sqlite_to_decode(tmp_path):
    settings = {"ENGINE": "django.db.backends.sqlite3", "NAME": f"file:{tmp_path}/dev%2541.sqlite3?mode=rwc",
                "OPTIONS": {"uri": True}}
    store = Store(url_from_settings("default", settings))
    try:
        store.migrate()
    finally:
        store.dispose()
    assert [p.name for p in tmp_path.iterdir()] == ["dev%41.sqlite3"]


def test_a_private_in_memory_sqlite_database_is_refused_with_the_fix():
    with pytest.raises(LeaseConfigError, match=r"private in-memory SQLite database .* Give the database a "
                                               r"file NAME"):
        url_from_settings("default", {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})


def test_a_database_of_another_kind_is_refused_naming_the_alias():
    with pytest.raises(LeaseConfigError, match=r"lease_database='legacy' is invalid: is a "
                                               r"django.db.backends.oracle database"):
        url_from_settings("legacy", {"ENGINE": "django.db.backends.oracle", "NAME": "x"})


def test_manage_check_refuses_a_store_on_both_a_database_alias_and_a_url(tmp_path):
    lease = {"CELERY_LEASE_DATABASE": "default", "CELERY_LEASE_STORE_URL": "sqlite:///other.sqlite3"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(lease)}
    command = [sys.executable, "-m", "django", "check", "--settings", "tests.django_project.settings"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert ("CELERY_LEASE_DATABASE: (celery_lease.E002) lease_database='default' is invalid: is set together "
            "with CELERY_LEASE_STORE_URL") in result.stderr


def test_a_socket_host_reaches_the_driver_as_its_socket_parameter_not_as_a_host_name():
    postgres = sa.engine.make_url(url_from_settings("default", {
        "ENGINE": "django.db.backends.postgresql", "NAME": "app", "USER": "shop",
        "HOST": "/cloudsql/proj:region:inst", "PORT": "5432"}))
    assert (postgres.host, postgres.port, postgres.database) == (None, 5432, "app")
    assert dict(postgres.query) == {"host": "/cloudsql/proj:region:inst"}
    mysql = sa.engine.make_url(url_from_settings("default", {
        "ENGINE": "django.db.backends.mysql", "NAME": "app", "USER": "root", "HOST": "/run/mysqld/db.sock"}))
    assert (mysql.host, mysql.database) == (None, "app")
    assert dict(mysql.query) == {"unix_socket": "/run/mysqld/db.sock"}


# Where this machine's servers listen on a Unix socket (the Debian packages' places).
SOCKETS = {"postgres": ("/var/run/postgresql", ".s.PGSQL.5432", "postgresql"),
           "mysql": ("/run/mysqld/mysqld.sock", "", "mysql")}


@pytest.mark.parametrize("service", ["postgres", "mysql"])
def test_the_store_on_a_socket_host_connects_through_that_socket(service):
    path, socket_file, engine = SOCKETS[service]
    socket = os.path.join(path, socket_file) if socket_file else path
    if not os.path.exists(socket):
        pytest.skip(f"no {service} Unix socket at {socket} on this machine")
    server = sa.engine.make_url(service_url(service))
    if service == "mysql":
        pytest.importorskip("pymysql")
    url = url_from_settings("default", {"ENGINE": f"django.db.backends.{engine}", "NAME": server.database,
                                        "USER": server.username, "PASSWORD": server.password or "",
                                        "HOST": path, "PORT": ""})
    store = Store(url, unique_prefix())
    try:
        with store.engine.connect() as conn:
            if service == "postgres":  # no server address: the session came through the socket
                assert conn.exec_driver_sql("SELECT inet_server_addr() IS NULL").scalar() is True
            else:  # a TCP session's host is "address:port"
                assert conn.exec_driver_sql("SELECT host FROM information_schema.processlist "
                                            "WHERE id = CONNECTION_ID()").scalar() == "localhost"
    finally:
        store.dispose()


def test_mysql_ssl_options_reach_the_url_as_the_drivers_ssl_parameters():
    url = sa.engine.make_url(url_from_settings("default", {
        "ENGINE": "django.db.backends.mysql", "NAME": "app", "USER": "root", "HOST": "db",
        "OPTIONS": {"charset": "utf8mb4", "ssl": {"ca": "/etc/ca.pem", "cert": "/etc/client.pem",
                                                  "key": Path("/etc/client.key"), "check_hostname": False}}}))
    assert dict(url.query) == {"charset": "utf8mb4", "ssl_ca": "/etc/ca.pem", "ssl_cert": "/etc/client.pem",
                               "ssl_key": "/etc/client.key", "ssl_check_hostname": "false"}
    # What the driver is given: TLS, not a connection without it.
    engine = sa.create_engine(url)
    try:
        assert engine.dialect.create_connect_args(engine.url)[1]["ssl"] == {
            "ca": "/etc/ca.pem", "cert": "/etc/client.pem", "key": "/etc/client.key", "check_hostname": False}
    finally:
        engine.dispose()


def test_an_ssl_setting_the_stores_url_cannot_carry_is_refused_naming_it_and_the_fix():
    options = {"ssl": {"ca": "/etc/ca.pem", "verify_mode": 2}}  # without it the store would skip a TLS check
    named = r"OPTIONS\['ssl'\]\['verify_mode'\], a key.*CELERY_LEASE_STORE_URL"
    with pytest.raises(LeaseConfigError, match=named):
        url_from_settings("default", {"ENGINE": "django.db.backends.mysql", "NAME": "app", "HOST": "db",
                                      "OPTIONS": options})


def test_another_option_the_stores_url_cannot_carry_is_left_out_with_a_warning(caplog, monkeypatch):
    # Another test's worker or Django project may have reconfigured logging: this logger reaches caplog.
    logger = logging.getLogger("celery_lease.store.django_database")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger=logger.name)
    options = {"conv": {1: str}, "autocommit": False, "local_infile": False, "compress": True}
    settings = {"ENGINE": "django.db.backends.mysql", "NAME": "app", "HOST": "db", "OPTIONS": options}
    url = sa.engine.make_url(url_from_settings("default", settings))
    assert dict(url.query) == {"local_infile": "false", "compress": "true"}  # the dialect reads these two
    left_out = {r.args[1] for r in caplog.records if getattr(r, "action", None) == "store_option_left_out"}
    assert left_out == {"conv", "autocommit"}


def test_a_django_imported_but_never_set_up_holds_no_transaction_of_the_store(tmp_path):
    # Another library imported django.db in a Celery app that is no Django project: asking for Django's
    # connections would raise ImproperlyConfigured in an effect's or a publish's outage path.
    script = ("import django.db\n"
              "from celery_lease.store.django_database import in_own_transaction\n"
              f"print(in_own_transaction({str(tmp_path / 'store.sqlite3')!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert (result.returncode, result.stdout.strip()) == (0, "False"), result.stderr
