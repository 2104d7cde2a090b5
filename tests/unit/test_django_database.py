"""celery_lease.store.django_database: the store URL of a Django ``DATABASES`` entry.

Pure unit tests of the URL each backend's settings give (the drivers of this venv: psycopg 3 and
PyMySQL), and ``manage.py check`` refusing the store on both a database alias and a URL. The
store opening those databases for real is shown by test_django_testing.py and test_django_schema.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_lease.errors import LeaseConfigError

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
