"""Shutdown and lost children under real ``celery worker`` subprocesses (Redis db 7, PostgreSQL)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_lease.store import COMPLETED, FAILED, PENDING
from tests.helpers import wait_for
from tests.reaper_env import APP, ReaperEnv, reaper_loop
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration

LONG_LEASE = {"lease_duration": 30.0, "lease_heartbeat_interval": 1.0}


def wait_running(renv: ReaperEnv, job_id: str, timeout: float = 30.0) -> None:
    wait_for(lambda: renv.count(job_id, "started") >= 1 and renv.status(job_id) == "running",
             timeout=timeout, message=f"job {job_id} never started")


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_warm_shutdown_lets_the_running_job_finish(renv, tmp_path, pool):
    app = renv.app()
    with celery_processes(tmp_path) as procs:
        proc = worker(APP, renv.env(), tmp_path, pool=pool)
        procs.append(proc)
        job = app.tasks["reaper_app.work"].delay(2.0)
        wait_running(renv, job.id)
        proc.popen.send_signal(signal.SIGTERM)  # the main process only: a warm shutdown
        assert proc.popen.wait(30) == 0
    assert renv.status(job.id) == COMPLETED
    assert renv.count(job.id, "finished") == 1
    assert renv.store.reports.events(job.id, "released_on_shutdown") == []


@pytest.mark.parametrize(("pool", "acks_late"), [("prefork", True), ("solo", True), ("prefork", False)])
def test_cold_shutdown_releases_the_lease_so_the_job_does_not_wait_for_expiry(renv, tmp_path, pool,
                                                                              acks_late):
    # The dispatch scan stays out of it (10 min): the release itself brings the job back.
    conf = {**LONG_LEASE, "task_acks_late": acks_late, "lease_dispatch_timeout": 600.0}
    app = renv.app(**conf)
    with celery_processes(tmp_path) as procs:
        first = worker(APP, renv.env(**conf), tmp_path, pool=pool)
        procs.append(first)
        job = app.tasks["reaper_app.work"].delay(60.0)
        wait_running(renv, job.id)
        quit_at = time.time()
        first.popen.send_signal(signal.SIGQUIT)
        first.popen.wait(30)
        # Released at once, with a 30 s lease that has not expired.
        wait_for(lambda: renv.status(job.id) == PENDING, timeout=10, message="lease not released")
        released_at = renv.first_event_at(job.id, "released_on_shutdown")
        assert released_at is not None and released_at - quit_at < 5.0
        assert renv.store.get(job.id).lock_token is None
        # The job runs again: its message came back (acks_late), or the release re-sent it.
        procs.append(worker(APP, renv.env(**conf), tmp_path, pool="solo"))
        with reaper_loop(app):
            wait_for(lambda: renv.status(job.id) == COMPLETED, timeout=30, message="released job never ran")
    assert (renv.count(job.id, "started"), renv.count(job.id, "finished")) == (2, 1)
    assert renv.store.reports.events(job.id, "redispatched") == []


def test_a_child_killed_under_a_job_is_requeued_by_the_main_process_at_once(renv, tmp_path):
    app = renv.app(**LONG_LEASE)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, renv.env(**LONG_LEASE), tmp_path, pool="prefork"))
        job = app.tasks["reaper_app.work"].delay(60.0)
        wait_running(renv, job.id)
        [child] = renv.pids(job.id)
        killed_at = time.time()
        os.kill(child, signal.SIGKILL)  # the pool child only; the main process sees WorkerLostError
        wait_for(lambda: renv.status(job.id) == COMPLETED, timeout=20, message="job not recovered")
    requeued = renv.store.reports.events(job.id, "reaped_expired_lease")
    assert len(requeued) == 1 and "worker process lost: WorkerLostError" in requeued[0]["reason"]
    assert requeued[0]["at"] - killed_at < 5.0  # seconds, not the 30 s lease
    assert (renv.count(job.id, "started"), renv.count(job.id, "finished")) == (2, 1)
    assert renv.store.get(job.id).expired_count == 1


def test_a_job_that_outlives_its_hard_time_limit_fails_at_once_and_never_runs_again(renv, tmp_path):
    app = renv.app(**LONG_LEASE)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, renv.env(**LONG_LEASE), tmp_path, pool="prefork"))
        job = app.tasks["reaper_app.overrun"].delay()
        wait_for(lambda: renv.status(job.id) == FAILED, timeout=40, message="job never failed")
    row = renv.store.get(job.id)
    assert "TimeLimitExceeded" in row.last_error and "a final failure" in row.last_error
    assert renv.count(job.id, "started") == 1  # a final failure, as in plain Celery
    assert renv.store.reports.events(job.id, "reaped_expired_lease") == []
    assert len(renv.store.reports.events(job.id, "dead_lettered")) == 1
