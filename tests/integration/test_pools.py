"""Interruption and time limits in each pool, under real workers (Redis db 13, PostgreSQL).

``lease_on_lost='raise'`` reaches a gevent greenlet; a hard time limit ends the job as plain
Celery does (FAILURE stored, errback fired once, the job failed, never re-run); a pool child
lost by accident is re-run by the lease without a FAILURE or an errback; a body's own
SystemExit is a failed attempt.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.helpers import wait_for
from tests.owner_env import APP, OwnerEnv
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration


def steal(oenv: OwnerEnv, job_id: str) -> None:
    """Give the running job's lease to another owner (test-only SQL)."""
    j = oenv.store.t.jobs
    with oenv.store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lock_token="thief", locked_by="other:1"))


def test_a_lost_lease_raises_into_a_gevent_body(oenv, tmp_path):
    pytest.importorskip("gevent")
    app = oenv.app()
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, oenv.env(), tmp_path, pool="gevent", concurrency=4))
        job = app.tasks["owner.waits"].delay(30.0)
        wait_for(lambda: oenv.started(job.id), timeout=30, message="the body never started")
        steal(oenv, job.id)
        _, reason = wait_for(lambda: oenv.lost(job.id, 1), timeout=10,
                             message="LeaseLost never reached the greenlet")
    assert reason == "taken_over"
    assert len(oenv.started(job.id)) == 1


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_hard_time_limit_is_a_final_failure_as_in_plain_celery(oenv, tmp_path, pool):
    if pool == "gevent":
        pytest.importorskip("gevent")
    app = oenv.app()
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, oenv.env(), tmp_path, pool=pool))
        job = app.tasks["owner.hard_limited"].apply_async(link_error=app.tasks["owner.errback"].s())
        wait_for(lambda: job.state == "FAILURE", timeout=30, message="Celery stored no FAILURE")
        wait_for(lambda: oenv.errbacks(job.id), timeout=10, message="the errback never ran")
        wait_for(lambda: oenv.store.get(job.id).status == "failed", timeout=10, message="job not failed")
        # A short job sent after it runs to the end: the worker is past the failure's handling.
        after = app.tasks["owner.waits"].delay(0.1)
        after.get(timeout=30)
    assert "TimeLimitExceeded" in repr(job.result) or "Timeout" in repr(job.result)
    assert oenv.errbacks(job.id) == 1
    assert len(oenv.started(job.id)) == 1
    row = oenv.store.get(job.id)
    assert row.attempt_count == 1 and row.lock_token is None


def test_a_pool_child_lost_by_accident_is_rerun_without_a_celery_failure(oenv, tmp_path):
    app = oenv.app()
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, oenv.env(), tmp_path, pool="prefork"))
        job = app.tasks["owner.dies_once"].apply_async(link_error=app.tasks["owner.errback"].s())
        assert job.get(timeout=40) == 2
    assert job.state == "SUCCESS" and oenv.errbacks(job.id) == 0
    assert [attempt for attempt, _, _ in oenv.started(job.id)] == [1, 2]
    assert oenv.store.get(job.id).status == "completed"
    [recovered] = oenv.store.reports.events(job.id, "reaped_expired_lease")
    assert "worker process lost: WorkerLostError" in recovered["reason"]


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_a_bodys_own_system_exit_is_a_failed_attempt_not_a_give_back(oenv, tmp_path, pool):
    app = oenv.app()
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, oenv.env(), tmp_path, pool=pool))
        job = app.tasks["owner.exits"].delay()
        wait_for(lambda: oenv.store.get(job.id) and oenv.store.get(job.id).status == "failed", timeout=30,
                 message="the job was not failed")
    assert oenv.store.get(job.id).last_error.startswith("SystemExit")
    assert len(oenv.started(job.id)) == 1
    assert oenv.store.reports.events(job.id, "released_on_shutdown") == []
