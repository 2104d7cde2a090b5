"""`celery -A example_project lease reap --dry-run` on the example shop's own store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_lease.store import ClaimTerms, Store

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_reap_dry_run_on_the_example_project_says_what_the_next_run_would_do(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'lease.sqlite3'}", "shop_lease_")
    store.migrate()
    store.publishes.record("abandoned", "example_project.tasks.capture_payment", "shop", None, 5)
    claimed = store.jobs.claim("abandoned", "gone-host:1", "t" * 32,
                               ClaimTerms(duration=3.0, grace=1.0,
                                          max_attempts=5, max_expirations=3, takeover=False),
                               task_name="example_project.tasks.capture_payment", queue="shop",
                               payload=lambda: None)
    assert claimed.claimed
    with store.begin() as c:  # its lease ran out a minute ago, on the store's clock
        c.execute(sa.update(store.t.jobs).values(lease_expires_at=store.now_sql - 60))
    env = {**os.environ, "EXAMPLE_RUN_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("CELERY_BROKER_URL", None)
    env.pop("EXAMPLE_LEASE_STORE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "example_project", "lease", "reap", "--dry-run", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["dry_run"] is True
    [decision] = plan["planned"]
    assert decision["job_id"] == "abandoned" and decision["decision"] == "requeue"
    job = store.get("abandoned")
    assert job.status == "running" and job.lock_token == "t" * 32  # a dry run changes nothing
    store.engine.dispose()


def test_the_demos_lease_mode_keeps_task_reject_on_worker_lost_off_as_lease_check_advises(tmp_path):
    env = {**os.environ, "EXAMPLE_RUN_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "EXAMPLE_MODE": "lease"}
    env.pop("CELERY_BROKER_URL", None)
    env.pop("EXAMPLE_LEASE_STORE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "example_project", "lease", "check", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    findings = {f["code"]: f for f in json.loads(done.stdout)}
    assert "reject_on_worker_lost" not in findings, findings.get("reject_on_worker_lost")
    assert findings["acks_late"]["level"] == "ok"
