"""The lease store's Django admin (celery_lease.contrib.django.admin) on SQLite, PostgreSQL and MariaDB.

Django's runner runs tests/django_project/admin_cases.py in a child process (Django's settings
are process-wide) with Django's admin installed, the store following ``CELERY_LEASE_DATABASE =
"default"`` under a table prefix of its own: the lists with their filters and search, no count of
a whole table in the captured queries, running leases with their expiry, redrive and discard
audited with the admin user's name, refused for a live lease and for a user without the
permission. The MariaDB run is also the Django run of the store on a MySQL-family database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import unique_prefix

pytestmark = pytest.mark.integration
pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]
CASES = 13


def run_cases(tmp_path: Path, database: dict) -> subprocess.CompletedProcess:
    project = {"DATABASES": {"default": database}, "CELERY_LEASE_DATABASE": "default",
               "CELERY_LEASE_TABLE_PREFIX": unique_prefix(),
               "TEST_RUNNER": "celery_lease.contrib.django.testing.LeaseTestRunner"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project)}
    command = [sys.executable, "-m", "django", "test", "tests.django_project.admin_cases", "--noinput",
               "--settings", "tests.django_project.admin_settings"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def assert_all_passed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    assert f"Ran {CASES} tests" in result.stderr and "\nOK" in result.stderr, result.stderr


def server_database(url: str, engine: str) -> dict:
    parts = urlsplit(url)
    return {"ENGINE": engine, "NAME": parts.path.lstrip("/"), "USER": parts.username,
            "PASSWORD": parts.password or "", "HOST": parts.hostname, "PORT": str(parts.port or ""),
            "TEST": {"NAME": f"test_lease_admin_{uuid.uuid4().hex[:8]}"}}


def test_the_admin_reads_and_recovers_the_store_on_sqlite(tmp_path):
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3"),
                "TEST": {"NAME": str(tmp_path / "test.sqlite3")}}
    assert_all_passed(run_cases(tmp_path, database))


def test_the_admin_reads_and_recovers_the_store_on_postgresql(tmp_path, postgres_url):
    assert_all_passed(run_cases(tmp_path, server_database(postgres_url, "django.db.backends.postgresql")))


def test_the_admin_reads_and_recovers_the_store_on_mariadb(tmp_path, mysql_url):
    assert_all_passed(run_cases(tmp_path, server_database(mysql_url, "django.db.backends.mysql")))
