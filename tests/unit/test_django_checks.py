"""celery_lease.contrib.django: ``manage.py check`` reports every lease setting problem as a Django Error.

Django's settings are process-wide, so each check runs ``django-admin check`` in a child
process on the tiny project under tests/django_project (its Celery app configured from Django's
settings under the CELERY namespace, as Celery's Django guide does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]


def manage_check(tmp_path: Path, **lease: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(lease)}
    command = [sys.executable, "-m", "django", "check", "--settings", "tests.django_project.settings"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_valid_lease_settings_pass_the_check(tmp_path):
    result = manage_check(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_every_lease_setting_problem_is_a_django_error_named_as_written_with_its_fix(tmp_path):
    result = manage_check(tmp_path, CELERY_LEASE_DURATON=60, CELERY_LEASE_HEARTBEAT_INTERVL=5,
                          CELERY_LEASE_MAX_ATTEMPTS=0)
    assert result.returncode == 1
    out = result.stderr
    assert ("CELERY_LEASE_DURATON: (celery_lease.E001) CELERY_LEASE_DURATON=60 is invalid: unknown "
            "celery_lease setting. Did you mean CELERY_LEASE_DURATION?") in out
    assert "HINT: rename CELERY_LEASE_DURATON to CELERY_LEASE_DURATION" in out
    assert "CELERY_LEASE_HEARTBEAT_INTERVL: (celery_lease.E001)" in out
    assert "HINT: rename CELERY_LEASE_HEARTBEAT_INTERVL to CELERY_LEASE_HEARTBEAT_INTERVAL" in out
    assert "CELERY_LEASE_MAX_ATTEMPTS: (celery_lease.E002) lease_max_attempts=0 is invalid" in out
    assert "System check identified 3 issues" in out


@pytest.mark.parametrize(("lease", "named"), [
    ({"CELERY_LEASE_DATABASE": "defualt"},
     "lease_database='defualt' is invalid: names no database of settings.DATABASES. Set it to one of: "
     "default"),
    ({"CELERY_LEASE_DATABASE": "default",
      "DATABASES": {"default": {"ENGINE": "django.db.backends.oracle", "NAME": "shop"}}},
     "lease_database='default' is invalid: is a django.db.backends.oracle database"),
    ({"CELERY_LEASE_DATABASE": "default"},  # the project's database is SQLite's private :memory:
     "lease_database='default' is invalid: is a private in-memory SQLite database (:memory:)"),
], ids=["unknown-alias", "unsupported-engine", "private-memory-sqlite"])
def test_a_database_the_store_cannot_open_is_a_django_error_naming_it_and_the_fix(tmp_path, lease, named):
    result = manage_check(tmp_path, **lease)
    assert result.returncode == 1, result.stdout
    assert f"CELERY_LEASE_DATABASE: (celery_lease.E003) {named}" in result.stderr
    assert ("HINT: point CELERY_LEASE_DATABASE at a PostgreSQL, MySQL/MariaDB or SQLite-file entry of "
            "settings.DATABASES that the store can open, or put the store on CELERY_LEASE_STORE_URL "
            "instead") in result.stderr


def test_a_database_the_store_can_open_passes_the_check(tmp_path):
    result = manage_check(tmp_path, CELERY_LEASE_DATABASE="default", DATABASES={"default": {
        "ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}})
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout
