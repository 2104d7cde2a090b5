"""`celery -A app lease ...` sees the app a worker sees: its task modules, its -A name; no app, no command.

Run as real ``celery`` subprocesses, so that nothing in the test process imports the app's
``include=`` module before the command does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_lease.store import Store
from tests.apps import ops_app

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.apps.include_app"
DEAD = "dead@inc:9"


def celery(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CELERY_APP", "CELERY_LEASE_STORE_URL")}
    return subprocess.run([sys.executable, "-m", "celery", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**clean, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def include_store(tmp_path_factory):
    """A store with one expired lease of each include-module task, owned by a worker gone an hour ago."""
    url = f"sqlite:///{tmp_path_factory.mktemp('inc') / 'lease.sqlite3'}"
    store = Store(url, "inc_")
    store.migrate()
    store.workers.touch_worker(DEAD, "inc", 9)
    now = store.now()
    with store.begin() as c:
        c.execute(sa.update(store.t.workers).values(last_seen_at=now - 3600))
    for job_id, task in (("strict-1", "inc.strict"), ("reports-1", "inc.reports")):
        ops_app._running(store, job_id, task, "celery", DEAD, lease_expires_at=now - 100,
                         started_at=now - 200, last_heartbeat_at=now - 150)
    yield {"INC_STORE": url, "INC_PREFIX": "inc_"}
    store.engine.dispose()


def lease(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return celery("-A", APP, "lease", *args, env=env)


def test_reap_dry_run_applies_the_policy_of_a_task_defined_in_an_include_module(include_store):
    result = lease(include_store, "reap", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    decisions = {d["job_id"]: d for d in json.loads(result.stdout)["planned"]}
    assert decisions["strict-1"]["decision"] == "dead_letter"  # the task's lease_on_expired
    assert "lease_on_expired='dead_letter'" in decisions["strict-1"]["reason"]
    assert decisions["reports-1"]["decision"] == "requeue"


def test_check_and_tune_see_the_tasks_of_an_include_module(include_store):
    check = lease(include_store, "check", "--json")
    findings = json.loads(check.stdout)
    named = json.dumps(findings)
    assert "inc.strict" in named and "inc.reports" in named
    grace = next(f for f in findings if f["values"] and f["values"].get("task") == "inc.reports")
    assert grace["values"]["lease_heartbeat_interval"] == 60.0  # the task's own option
    tune = {t["task"]: t for t in json.loads(lease(include_store, "tune", "--json").stdout)}
    assert tune["inc.strict"]["current"]["lease_duration"] == 45.0
    assert tune["inc.reports"]["current"]["lease_duration"] == 600.0


def test_only_the_command_output_goes_to_stdout(include_store):
    result = lease(include_store, "reap", "--dry-run", "--json")
    json.loads(result.stdout)  # nothing else on stdout


def test_a_command_without_an_app_refuses_with_a_hint_and_creates_no_file(tmp_path):
    for verb in ("status", "migrate", "check"):
        result = celery("lease", verb, cwd=tmp_path)
        assert result.returncode != 0, result.stdout
        assert "celery -A proj lease" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_needs_no_app(tmp_path):
    result = celery("lease", "requeue", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--yes" in result.stdout


def test_hints_name_the_app_given_with_dash_a(tmp_path):
    env = {"INC_STORE": f"sqlite:///{tmp_path / 'empty.sqlite3'}"}
    result = lease(env, "status")
    assert result.returncode == 69
    assert f"celery -A {APP} lease migrate" in result.stderr
    assert "celery -A proj" not in result.stderr
