"""celery_lease.ops.reaper_checks: the reaper's schedule read where it is held.

django-celery-beat's DatabaseScheduler keeps the schedule in PeriodicTask rows. Django's
settings are process-wide, so the Django case runs in a child process of its own: SQLite
settings configured in code (no project), django_celery_beat's tables migrated, one row.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("django_celery_beat")

SCRIPT = r"""
import json, sys
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
)
import django

django.setup()
from django.core.management import call_command

call_command("migrate", "django_celery_beat", verbosity=0)
from django_celery_beat.models import IntervalSchedule, PeriodicTask

every = IntervalSchedule.objects.create(every=20, period=IntervalSchedule.SECONDS)
PeriodicTask.objects.create(name="lease-reaper", task="celery_lease.reap", interval=every,
                            queue=sys.argv[3] or None, expire_seconds=int(sys.argv[4]) or None)
from celery import Celery

from celery_lease.ops.checks import run_checks
from celery_lease.store import Store

app = Celery("dj", broker="memory://", set_as_current=False)
app.conf.update(lease_store_url=sys.argv[2], beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler")
store = Store(sys.argv[2], "dj_")
store.migrate()
store.runs.record_reaper_run(0.1, {}, "reaper@host:1", keep=10)
wanted = ("reaper_scheduled", "reaper_routing", "reaper_running")
print(json.dumps([f.as_dict() for f in run_checks(app, store) if f.code in wanted]))
"""


def checks_with_django_beat(tmp_path: Path, queue: str, expires: int) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "django.sqlite3"),
         f"sqlite:///{tmp_path / 'lease.sqlite3'}", queue, str(expires)],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return {f["code"]: f for f in json.loads(out.stdout.strip().splitlines()[-1])}


def test_lease_check_finds_the_reaper_in_django_celery_beats_periodic_tasks(tmp_path):
    found = checks_with_django_beat(tmp_path, "lease-maintenance", 15)
    scheduled = found["reaper_scheduled"]
    assert scheduled["level"] == "ok"
    assert scheduled["values"] == {"entries": {"lease-reaper": 20.0}, "sources": ["django_celery_beat"]}
    assert found["reaper_routing"]["level"] == "ok"
    assert found["reaper_running"]["level"] == "ok"
    assert found["reaper_running"]["values"]["interval"] == 20.0


def test_a_periodic_task_on_the_work_queue_without_expires_is_flagged(tmp_path):
    found = checks_with_django_beat(tmp_path, "", 0)
    routing = found["reaper_routing"]
    assert routing["level"] == "warning"
    assert routing["values"]["problems"] == [
        "lease-reaper (django_celery_beat) goes to the work queue 'celery'",
        "lease-reaper (django_celery_beat) has no expires"]
    # The hint names the admin's fields, where this entry is edited, not beat_schedule.
    assert "Expires timedelta with seconds" in routing["fix"] and "Queue Override" in routing["fix"]
    assert "lease_schedule_reaper" in routing["fix"] and "beat_schedule" not in routing["fix"]


COMMAND_SCRIPT = r"""
import io, json, sys
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django_celery_beat", "celery_lease.contrib.django"], USE_TZ=True, TIME_ZONE="UTC",
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
)
import django

django.setup()
from django.core.management import call_command

call_command("migrate", "django_celery_beat", verbosity=0)
from django_celery_beat.models import IntervalSchedule, PeriodicTask

# A reaper first added by hand in the admin: on the work queue, no expiry.
every = IntervalSchedule.objects.create(every=5, period=IntervalSchedule.SECONDS)
PeriodicTask.objects.create(name="lease-reaper", task="celery_lease.reap", interval=every)
said = []
for _ in range(2):
    out = io.StringIO()
    call_command("lease_schedule_reaper", stdout=out)
    said.append(out.getvalue().strip())
from celery import Celery

from celery_lease.ops.checks import run_checks
from celery_lease.store import Store

app = Celery("dj", broker="memory://", set_as_current=False)
app.conf.update(lease_store_url=sys.argv[2], beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler")
store = Store(sys.argv[2], "dj_")
store.migrate()
rows = [(r.name, r.task, r.interval.every, r.queue, r.expire_seconds, r.enabled)
        for r in PeriodicTask.objects.filter(task="celery_lease.reap")]
routing = [f.as_dict() for f in run_checks(app, store) if f.code == "reaper_routing"]
print(json.dumps({"said": said, "rows": rows, "routing": routing}))
"""


def test_the_schedule_command_sets_the_admin_reaper_right_and_a_second_run_changes_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", COMMAND_SCRIPT, str(tmp_path / "django.sqlite3"),
         f"sqlite:///{tmp_path / 'lease.sqlite3'}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == [["lease-reaper", "celery_lease.reap", 15, "lease-maintenance", 10, True]]
    assert got["said"][0].startswith("updated periodic task 'lease-reaper'")
    assert got["said"][1] == "periodic task 'lease-reaper' is already set: nothing to change"
    [routing] = got["routing"]
    assert routing["level"] == "ok", routing


def test_with_djangos_database_scheduler_and_no_reaper_the_hint_is_the_schedule_command(tmp_path):
    from celery import Celery

    from celery_lease.ops.checks import run_checks
    from celery_lease.store import Store

    app = Celery("dbsched", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}",
                    beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler")
    store = Store(app.conf.lease_store_url, "dbsched_")
    store.migrate()
    [scheduled] = [f for f in run_checks(app, store) if f.code == "reaper_scheduled"]
    assert scheduled.level == "error"
    assert "python manage.py lease_schedule_reaper" in scheduled.fix and "beat_schedule" not in scheduled.fix
