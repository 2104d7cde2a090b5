"""docs/django.md, run: the project its code blocks make survives a worker SIGKILLed mid-job,
and its admin shows the recovered job and redrives a dead letter.

The files come from the page's own fenced blocks (```python title=PATH), extracted at test
time, so the page cannot drift from what works. Django's ``startproject``/``startapp`` make the
rest, as for a reader. A settings module of the test's own imports the page's settings and
only shortens the timings and picks queues of its own (Redis db 7, never flushed). The admin
is driven with Django's test client inside ``manage.py shell``: sign-in, the pages and the
redrive action go through the page's settings and URLs, as a browser's requests would.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.ops.checks import run_checks
from celery_lease.store import Store
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.workers import beat, celery_processes, worker

pytestmark = pytest.mark.integration
pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "django.md"
BLOCK = re.compile(r"^```python title=(?P<path>\S+)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)

TEST_SETTINGS = """
from proj.settings import *  # noqa: F403 - the page's settings, then the test's timings and queues

CELERY_TASK_DEFAULT_QUEUE = {queue!r}
CELERY_BEAT_SCHEDULE = {{"lease-reaper": {{**CELERY_BEAT_SCHEDULE["lease-reaper"], "schedule": 0.5,
                                          "options": {{"queue": {queue!r} + ".reaper", "expires": 0.4}}}}}}
CELERY_LEASE_DURATION = 2.0
CELERY_LEASE_HEARTBEAT_INTERVAL = 0.4
CELERY_LEASE_GRACE_PERIOD = 0.5
CELERY_LEASE_WORKER_STALE_AFTER = 2.0
CELERY_LEASE_BACKOFF_BASE = 0.1
CELERY_LEASE_BACKOFF_MAX = 0.2
SHOP_RENDER_SECONDS = 0.3
"""

ADMIN = "alice"
# Run by ``manage.py shell -c``: signs in through the admin's login form, opens the pages and
# redrives the dead letter (plan, then confirmation), and writes what each request returned.
ADMIN_VISIT = """
import json, os, re
from django.test import Client
from django.test.utils import setup_test_environment

setup_test_environment()  # lets the test client's host in, as Django's test runner does
client = Client()  # REMOTE_ADDR 127.0.0.1
recovered, dead = os.environ["RECOVERED_JOB"], os.environ["DEAD_LETTER"]
jobs, dead_letters = "/admin/celery_lease_admin/job/", "/admin/celery_lease_admin/deadletter/"
redrive = {"action": "redrive", "_selected_action": [dead], "index": 0}
pages = {}
pages["index"] = client.post("/admin/login/", {"username": os.environ["DJANGO_SUPERUSER_USERNAME"],
                                               "password": os.environ["DJANGO_SUPERUSER_PASSWORD"],
                                               "next": "/admin/"}, follow=True)
pages["jobs"] = client.get(jobs)
pages["recovered job"] = client.get(f"{jobs}{recovered}/change/")
pages["dead letters"] = client.get(dead_letters)
pages["plan"] = client.post(dead_letters, redrive)
# The confirmation carries what the plan page holds: each job as the plan showed it.
stamps = re.findall(r'name="stamp" value="([^"]*)"', pages["plan"].content.decode())
pages["redriven"] = client.post(dead_letters, {**redrive, "post": "yes", "confirm": "yes", "stamp": stamps},
                                follow=True)
with open(os.environ["ADMIN_PAGES"], "w") as out:
    json.dump({name: [page.status_code, page.content.decode()] for name, page in pages.items()}, out)
"""


def page_files() -> dict[str, str]:
    """The page's files: each ```python title=PATH block, by path."""
    return {m["path"]: m["code"] for m in BLOCK.finditer(PAGE.read_text())}


def test_the_page_names_the_files_of_its_project():
    assert set(page_files()) == {"proj/settings.py", "proj/urls.py", "proj/celery.py", "proj/__init__.py",
                                 "shop/models.py", "shop/reports.py", "shop/tasks.py"}


def test_the_pages_reaper_schedule_and_acks_are_what_lease_check_asks_for(tmp_path):
    namespace: dict = {"__file__": str(tmp_path / "proj" / "settings.py")}
    exec(page_files()["proj/settings.py"], namespace)  # noqa: S102 - the page's settings module
    conf = {key[len("CELERY_"):].lower(): value for key, value in namespace.items()
            if key.startswith("CELERY_")}
    assert conf.pop("lease_database") == "default"  # the store on Django's database; here a URL instead
    conf.update(lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}", broker_url="memory://")
    app = Celery("page", set_as_current=False)
    app.conf.update(conf)

    @app.task(base=LeaseTask, shared=False, name="shop.tasks.build_report")
    def build_report(report_id):
        return report_id

    store = Store(conf["lease_store_url"], "celery_lease_")
    store.migrate()
    store.runs.record_reaper_run(0.1, {}, "reaper@host:1", keep=10)
    found = {f.code: f for f in run_checks(app, store)}
    assert found["reaper_scheduled"].level == "ok"
    assert found["reaper_routing"].level == "ok", found["reaper_routing"].fix
    assert found["acks_late"].level == "ok", found["acks_late"].fix


def _run(project: Path, env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


def build_project(tmp_path: Path, env: dict) -> Path:
    """startproject and startapp as a reader would, then the page's files over theirs."""
    env = {key: value for key, value in env.items() if key != "DJANGO_SETTINGS_MODULE"}
    _run(tmp_path, env, "-m", "django", "startproject", "proj", str(tmp_path))
    _run(tmp_path, env, "manage.py", "startapp", "shop")
    for path, code in page_files().items():
        (tmp_path / path).write_text(code)
    return tmp_path


def query(db: Path, sql: str, *args: object) -> list[tuple]:
    with sqlite3.connect(db, timeout=10) as c:
        return c.execute(sql, args).fetchall()


def status(db: Path, job_id: str) -> str | None:
    found = query(db, "SELECT status FROM celery_lease_jobs WHERE id = ?", job_id)
    return found[0][0] if found else None


def test_the_pages_project_recovers_a_killed_workers_job_and_its_admin_shows_it_and_redrives_a_dead_letter(
        tmp_path, redis_url):
    queue = f"djpage-{unique_prefix()}"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
           "DJANGO_SETTINGS_MODULE": "proj.test_settings",
           "CELERY_BROKER_URL": redis_url.rsplit("/", 1)[0] + "/7"}
    env.pop("CELERY_LEASE_STORE_URL", None)
    project = build_project(tmp_path, env)
    (project / "proj" / "test_settings.py").write_text(TEST_SETTINGS.format(queue=queue))
    _run(project, env, "manage.py", "makemigrations", "shop")
    _run(project, env, "manage.py", "migrate")  # the store's tables too, as the page says
    db = project / "db.sqlite3"
    queues = f"{queue},{queue}.reaper"
    with celery_processes(tmp_path) as procs:
        procs.append(beat("proj", env, tmp_path))
        procs.append(first := worker("proj", env, tmp_path, pool="prefork", queues=queues))
        job_id = _run(project, env, "manage.py", "shell", "-c",
                      "from shop.tasks import build_report; print(build_report.delay('r-1').id)").split()[-1]
        # Killed mid-body: after its first checkpoint, long before its last.
        wait_for(lambda: query(db, "SELECT 1 FROM celery_lease_jobs WHERE id = ? AND status = 'running' "
                                   "AND checkpoint IS NOT NULL", job_id),
                 timeout=30, interval=0.05, message="the job never checkpointed")
        first.kill()
        assert query(db, "SELECT count(*) FROM shop_report") == [(0,)]
        procs.append(worker("proj", env, tmp_path, pool="prefork", queues=queues))
        # A report without an id fails for good (shop_report.report_id is NOT NULL): a dead letter.
        dead = _run(project, env, "manage.py", "shell", "-c",
                    "from shop.tasks import build_report; print(build_report.delay(None).id)").split()[-1]
        wait_for(lambda: (status(db, job_id), status(db, dead)) == ("completed", "failed"), timeout=30,
                 message="the killed worker's job was not recovered and completed, "
                         "or the job without a report id did not fail")
    assert query(db, "SELECT report_id, attempt FROM shop_report") == [("r-1", 2)]
    [(resumed_at,)] = query(db, "SELECT resumed_at_part FROM shop_report")
    assert resumed_at >= 1  # the second run started from the first one's checkpoint
    assert query(db, "SELECT count(*) FROM celery_lease_events WHERE job_id = ? "
                     "AND event = 'reaped_expired_lease'", job_id) == [(1,)]

    # The admin, with the workers stopped: the redriven job stays pending for the assertions.
    admin_env = {**env, "DJANGO_SUPERUSER_USERNAME": ADMIN, "DJANGO_SUPERUSER_PASSWORD": "page-test-pw",
                 "DJANGO_SUPERUSER_EMAIL": f"{ADMIN}@example.com", "RECOVERED_JOB": job_id,
                 "DEAD_LETTER": dead, "ADMIN_PAGES": str(tmp_path / "admin_pages.json")}
    _run(project, admin_env, "manage.py", "createsuperuser", "--noinput")
    _run(project, admin_env, "manage.py", "shell", "-c", ADMIN_VISIT)
    pages = json.loads((tmp_path / "admin_pages.json").read_text())
    assert {name: code for name, (code, _) in pages.items()} == dict.fromkeys(pages, 200)
    page = {name: html for name, (_, html) in pages.items()}
    assert "Celery leases" in page["index"] and "Dead letters" in page["index"], page["index"]
    assert job_id in page["jobs"] and dead in page["jobs"]
    assert "reaped_expired_lease" in page["recovered job"] and "completed" in page["recovered job"]
    assert dead in page["dead letters"] and "NOT NULL" in page["dead letters"]
    assert "Redrive dead letters?" in page["plan"] and dead in page["plan"]
    # The dead letter is pending again with fresh attempts, audited with the signed-in user.
    assert query(db, "SELECT status, attempt_count FROM celery_lease_jobs WHERE id = ?",
                 dead) == [("pending", 0)]
    assert query(db, "SELECT worker FROM celery_lease_events WHERE job_id = ? AND event = 'dlq_redriven'",
                 dead) == [(f"admin:{ADMIN}@127.0.0.1",)]
