"""celery_lease.contrib.django.pytest_plugin: ``lease_store`` puts eager leases on the test database.

The cases of tests/django_project/plugin_cases.py run in a child pytest (Django's settings are
process-wide) with pytest-django, on SQLite and PostgreSQL, the store following
``CELERY_LEASE_DATABASE``: each test that takes the fixture sees the test database's store, empty.
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

pytest.importorskip("django")
pytest.importorskip("pytest_django")

ROOT = Path(__file__).resolve().parents[2]


def run_cases(tmp_path: Path, database: dict) -> subprocess.CompletedProcess:
    project = {"DATABASES": {"default": database}, "CELERY_LEASE_DATABASE": "default",
               "CELERY_TASK_ALWAYS_EAGER": True}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project),
           "DJANGO_SETTINGS_MODULE": "tests.django_project.settings"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_django",
               "-p", "celery_lease.contrib.django.pytest_plugin", "--rootdir", str(tmp_path),
               str(ROOT / "tests" / "django_project" / "plugin_cases.py")]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_the_fixture_gives_each_test_an_empty_store_on_the_sqlite_test_database(tmp_path):
    result = run_cases(tmp_path, {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_the_fixture_gives_each_test_an_empty_store_on_the_postgresql_test_database(tmp_path, postgres_url):
    url = urlsplit(postgres_url)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"), "USER": url.username,
                "PASSWORD": url.password or "", "HOST": url.hostname, "PORT": str(url.port or 5432),
                "TEST": {"NAME": f"test_lease_{uuid.uuid4().hex[:8]}"}}
    result = run_cases(tmp_path, database)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout
