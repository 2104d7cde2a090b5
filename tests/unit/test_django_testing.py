"""LeaseTestRunner: under Django's runner eager runs lease in the store on the test database.

Django's runner runs the cases of tests/django_project/lease_cases.py in a child process (Django's
settings are process-wide), with the store following ``CELERY_LEASE_DATABASE = "default"``: on
SQLite (Django's shared in-memory test database) and on PostgreSQL (``test_<name>``, and with
``--parallel 2`` each worker's clone). The cases prove the store is that process's test
database, an eager run takes a real lease there and writes its effect key once, no STARTED
result is left, and ``override_settings`` reaches the lease settings.
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
import sqlalchemy as sa

pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]
CASES = 6


def run_cases(tmp_path: Path, database: dict, *args: str,
              cases: str = "tests.django_project.lease_cases") -> subprocess.CompletedProcess:
    project = {"DATABASES": {"default": database}, "CELERY_LEASE_DATABASE": "default",
               "CELERY_TASK_ALWAYS_EAGER": True, "CELERY_RESULT_BACKEND": "cache+memory://",
               "TEST_RUNNER": "celery_lease.contrib.django.testing.LeaseTestRunner"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project)}
    command = [sys.executable, "-m", "django", "test", cases, "--noinput",
               "--settings", "tests.django_project.settings", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_eager_leases_go_to_the_sqlite_test_database(tmp_path):
    result = run_cases(tmp_path, {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})
    assert result.returncode == 0, result.stderr
    assert f"Ran {CASES} tests" in result.stderr and "\nOK" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing written beside: no development store file


def test_eager_leases_go_to_each_parallel_clone_of_the_postgresql_test_database(tmp_path, postgres_url):
    url = urlsplit(postgres_url)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"), "USER": url.username,
                "PASSWORD": url.password or "", "HOST": url.hostname, "PORT": str(url.port or 5432),
                "TEST": {"NAME": f"test_lease_{uuid.uuid4().hex[:8]}"}}  # none other runs on it
    result = run_cases(tmp_path, database, "--parallel", "2", "-v", "2")
    assert result.returncode == 0, result.stderr
    assert f"Ran {CASES} tests" in result.stderr and "\nOK" in result.stderr
    assert "Cloning test database" in result.stderr
    assert f"Destroying test database for alias 'default' ('{database['TEST']['NAME']}_2')" in result.stderr


def store_rows(postgres_url: str, names: list[str]) -> int:
    """The store rows (jobs and effect keys) left in each of these databases that exists."""
    from celery_lease.store import Store

    server = sa.create_engine(postgres_url)
    try:
        with server.connect() as conn:
            existing = set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        server.dispose()
    rows = 0
    for name in [n for n in names if n in existing]:
        database_url = sa.engine.make_url(postgres_url).set(database=name)
        store = Store(database_url.render_as_string(hide_password=False))
        try:
            with store.begin() as conn:
                for table in (store.t.jobs, store.t.effects):
                    rows += conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
        finally:
            store.dispose()
    return rows


@pytest.mark.parametrize("parallel", [1, 2], ids=["test-database", "parallel-clones"])
def test_a_kept_test_database_starts_each_run_with_an_empty_store(tmp_path, postgres_url, parallel):
    url = urlsplit(postgres_url)
    name = f"test_lease_{uuid.uuid4().hex[:8]}"
    names = [name, *(f"{name}_{n}" for n in range(1, parallel + 1) if parallel > 1)]
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"), "USER": url.username,
                "PASSWORD": url.password or "", "HOST": url.hostname, "PORT": str(url.port or 5432),
                "TEST": {"NAME": name}}
    try:
        left = []
        for run in (1, 2):
            # The cases take effect keys and an idempotency key whose first run they assert.
            result = run_cases(tmp_path, database, "--keepdb", "--parallel", str(parallel))
            assert result.returncode == 0, f"run {run}: {result.stderr}"
            assert f"Ran {CASES} tests" in result.stderr and "\nOK" in result.stderr
            left.append(store_rows(postgres_url, names))
        assert left[0] > 0 and left[1] == left[0]  # the second run's rows only, not both runs'
    finally:
        server = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
        try:
            with server.connect() as conn:
                for kept in names:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{kept}"')
        finally:
            server.dispose()


def test_a_kept_run_whose_cases_use_no_database_leaves_the_development_store_alone(tmp_path):
    # No case touches the store's alias, so Django sets up no test database: its NAME is still the
    # development database's, whose store rows are not the runner's to clear.
    from celery_lease.store import Store

    development = tmp_path / "dev.sqlite3"
    store = Store(f"sqlite:///{development}")
    store.migrate()
    store.publishes.record("j-dev", "shop.charge", "celery", None, 3)
    store.dispose()
    result = run_cases(tmp_path, {"ENGINE": "django.db.backends.sqlite3", "NAME": str(development)},
                       "--keepdb", cases="tests.django_project.simple_cases")
    assert result.returncode == 0, result.stderr
    assert "Ran 1 test" in result.stderr and "\nOK" in result.stderr
    store = Store(f"sqlite:///{development}")
    try:
        assert store.get("j-dev") is not None
    finally:
        store.dispose()


NO_DATABASE_EAGER_CASE = """
from django.test import SimpleTestCase

from tests.django_project.tasks import charge


class NoDatabase(SimpleTestCase):
    def test_an_eager_run_keeps_its_local_lease(self):
        assert charge.delay("o-1").get()["first"] is True
"""


def test_a_run_whose_cases_use_no_database_leases_eager_runs_locally_not_in_the_development_store(tmp_path):
    # Given a development database whose store is migrated, and cases that use no database: Django sets
    # up no test database, so the alias's NAME stays the development database's
    from celery_lease.store import Store

    development = tmp_path / "dev.sqlite3"
    store = Store(f"sqlite:///{development}")
    store.migrate()
    store.dispose()
    (tmp_path / "no_database_eager_cases.py").write_text(NO_DATABASE_EAGER_CASE)

    # When the runner runs an eager LeaseTask in such a case
    result = run_cases(tmp_path, {"ENGINE": "django.db.backends.sqlite3", "NAME": str(development)},
                       cases="no_database_eager_cases")

    # Then the run took its local lease: no job and no effect key reached the development store
    assert result.returncode == 0, result.stderr
    assert "Ran 1 test" in result.stderr and "\nOK" in result.stderr
    store = Store(f"sqlite:///{development}")
    try:
        with store.begin() as conn:
            for table in (store.t.jobs, store.t.effects):
                assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one() == 0
    finally:
        store.dispose()


def test_the_runner_refuses_a_store_that_follows_no_database(tmp_path):
    project = {"CELERY_TASK_ALWAYS_EAGER": True,
               "TEST_RUNNER": "celery_lease.contrib.django.testing.LeaseTestRunner"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project)}
    command = [sys.executable, "-m", "django", "test", "tests.django_project.lease_cases", "--noinput",
               "--settings", "tests.django_project.settings"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert ("lease_database=None is invalid: is not set, so eager leases would go to lease_store_url"
            in result.stderr)
