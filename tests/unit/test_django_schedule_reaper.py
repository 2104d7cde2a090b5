"""``manage.py lease_schedule_reaper``: the reaper's django-celery-beat periodic task, or an error that says
what to do, never a traceback.

Django's settings are process-wide, so each command runs in a child process on the tiny project under
tests/django_project with django_celery_beat installed, its database a SQLite file of the test's own.
(The command setting an admin-made reaper right is shown by test_reaper_checks.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("django_celery_beat")

ROOT = Path(__file__).resolve().parents[2]


def manage(database: Path, *args: str) -> subprocess.CompletedProcess:
    project = {"INSTALLED_APPS": ["django_celery_beat", "celery_lease.contrib.django"],
               "DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(database)}}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_PROJECT_LEASE": json.dumps(project)}
    command = [sys.executable, "-m", "django", *args, "--settings", "tests.django_project.settings"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def shell(database: Path, code: str) -> str:
    result = manage(database, "shell", "-c", code)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]  # Django 5.2's shell first says what it imported


READ_SCHEDULES = """
import json
from django_celery_beat.models import IntervalSchedule, PeriodicTask
tasks = [[t.name, t.interval_id, t.queue, t.expire_seconds] for t in PeriodicTask.objects.all()]
print(json.dumps({"schedules": IntervalSchedule.objects.count(), "tasks": tasks}))
"""


def test_two_equal_interval_schedules_are_shared_not_a_traceback(tmp_path):
    # Given django-celery-beat's tables holding the same 15s schedule twice (its admin allows it)
    database = tmp_path / "db.sqlite3"
    assert manage(database, "migrate", "django_celery_beat").returncode == 0
    first = shell(database, "from django_celery_beat.models import IntervalSchedule as I\n"
                            "print([I.objects.create(every=15, period=I.SECONDS).pk for _ in range(2)][0])")

    # When the command sets the reaper, twice
    runs = [manage(database, "lease_schedule_reaper") for _ in range(2)]

    # Then it took one of them, made no third, and the second run changed nothing
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.startswith("created periodic task 'lease-reaper'")
    assert "nothing to change" in runs[1].stdout
    assert json.loads(shell(database, READ_SCHEDULES)) == {
        "schedules": 2, "tasks": [["lease-reaper", int(first), "lease-maintenance", 10]]}


def test_before_django_celery_beat_is_migrated_the_command_says_to_migrate_it(tmp_path):
    result = manage(tmp_path / "db.sqlite3", "lease_schedule_reaper")
    assert result.returncode == 1
    assert "CommandError: cannot read or write django-celery-beat's tables" in result.stderr
    assert "run manage.py migrate django_celery_beat" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_one_second_interval_is_refused_naming_the_interval_not_an_expiry_never_given(tmp_path):
    database = tmp_path / "db.sqlite3"
    assert manage(database, "migrate", "django_celery_beat").returncode == 0
    result = manage(database, "lease_schedule_reaper", "--interval", "1")
    assert result.returncode == 1
    assert "CommandError: --interval 1: give a whole number of seconds, at least 2" in result.stderr
    assert "--expires" not in result.stderr
    assert json.loads(shell(database, READ_SCHEDULES)) == {"schedules": 0, "tasks": []}
