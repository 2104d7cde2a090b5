"""Chaos: real workers, beat and reaper processes killed on purpose (Redis db 7 broker, PostgreSQL).

Fast settings (tests/apps/reaper_app.py): 2 s leases, 0.4 s heartbeats, 0.5 s grace, reaper
every 0.5 s, owners stale after 2 s, 3 attempts. Every execution writes a row, so each test
counts starts and finishes per job: every job finishes exactly once, none is lost or stuck.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_lease.reaper.run import Reaper
from celery_lease.store import COMPLETED, FAILED
from celery_lease.vocabulary import RECOVERIES
from tests.helpers import wait_for
from tests.reaper_env import APP, ReaperEnv, reaper_loop
from tests.workers import ROOT, Proc, beat, celery_processes, worker

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

LEASE, GRACE, INTERVAL, HEARTBEAT = 2.0, 0.5, 0.5, 0.4
BOUND = LEASE + GRACE + INTERVAL + HEARTBEAT  # the "no job is stuck" bound
SLACK = 1.5  # beat's tick, the reap task's trip through the broker, a busy 2-core machine


def running_on(renv: ReaperEnv, job_ids: list[str]) -> bool:
    return all(renv.status(j) == "running" and renv.count(j, "started") == 1 for j in job_ids)


def unfinished(renv: ReaperEnv) -> int:
    j = renv.store.t.jobs
    with renv.store.begin() as c:
        return c.execute(sa.select(sa.func.count()).select_from(j)
                         .where(j.c.status.in_(["pending", "running"]))).scalar_one()


def spawn_reaper(env: dict[str, str], log_dir: Path, name: str) -> Proc:
    """``python -m tests.apps.reaper_app``: the reaper loop in a process of its own."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as handle:
        popen = subprocess.Popen([sys.executable, "-m", "tests.apps.reaper_app"], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=handle,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return Proc(popen, log, name)


@pytest.mark.parametrize("acks_late", [False, True], ids=["acks_late_off", "acks_late_on"])
def test_sigkilled_prefork_worker_jobs_complete_exactly_once_within_the_recovery_bound(renv, tmp_path,
                                                                                      acks_late):
    # Given a beat-driven reaper, and a prefork worker running two long jobs with two more queued
    # A message the victim had just popped from Redis dies with it (kombu writes its unacked copy
    # after the pop): the dispatch scan re-sends it after lease_dispatch_timeout.
    conf = {"task_acks_late": acks_late, "lease_dispatch_timeout": 10.0, "broker_transport_options": {
        "visibility_timeout": 8, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}}
    env, app = renv.env(**conf), renv.app(**conf)
    work = app.tasks["reaper_app.work"]
    with celery_processes(tmp_path) as procs:
        procs.append(beat(APP, env, tmp_path))
        procs.append(worker(APP, env, tmp_path, pool="solo", queues=renv.reaper_queue, name="reaper"))
        victim = worker(APP, env, tmp_path, pool="prefork", concurrency=2, queues=renv.queue, name="victim")
        procs.append(victim)
        long_jobs = [work.delay(60.0).id for _ in range(2)]
        wait_for(lambda: running_on(renv, long_jobs), timeout=40, message="long jobs never started")
        short_jobs = [work.delay(0.2).id for _ in range(2)]
        # When the whole worker is SIGKILLed mid-task
        killed_at = time.time()
        victim.kill()
        procs.append(worker(APP, env, tmp_path, pool="prefork", queues=renv.queue, name="rescuer"))
        # Then every job completes, the killed ones requeued by the reaper within the bound
        every = long_jobs + short_jobs
        wait_for(lambda: all(renv.status(j) == COMPLETED for j in every), timeout=40,
                 message="jobs not all completed")
        if acks_late:  # kombu restores the unacked messages later: they must not run again
            wait_for(lambda: all(renv.store.reports.events(j,
                                                           "duplicate_delivery_skipped") for j in long_jobs),
                     timeout=30, message="restored messages never came back")
            assert all(e["detail"] and '"redelivered": true' in e["detail"]
                       for j in long_jobs for e in renv.store.reports.events(j, "duplicate_delivery_skipped"))
    for job_id in long_jobs:
        [reaped] = renv.store.reports.events(job_id, "reaped_expired_lease")
        assert reaped["at"] - killed_at <= BOUND + SLACK, f"recovered after {reaped['at'] - killed_at:.2f}s"
        assert (renv.count(job_id, "started"), renv.count(job_id, "finished")) == (2, 1)
    for job_id in short_jobs:
        assert (renv.count(job_id, "started"), renv.count(job_id, "finished")) == (1, 1)
    assert unfinished(renv) == 0


def test_a_task_that_kills_its_own_process_every_time_ends_dead_lettered(renv, tmp_path):
    app = renv.app()
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, renv.env(), tmp_path, pool="prefork", queues=renv.queue))
        job = app.tasks["reaper_app.suicide"].delay()  # no reaper runs: only the main process recovers
        wait_for(lambda: renv.status(job.id) == FAILED, timeout=40, message="job never dead-lettered")
        after = Reaper(app).run_once()  # the reaper finds nothing left to do with it
    assert (after.seen, after.reaped, after.redispatched) == (0, 0, 0)
    row = renv.store.get(job.id)
    assert row.last_error == "lease expired and max attempts reached"
    assert renv.count(job.id, "started") == 3 and row.attempt_count == 3  # lease_max_attempts, no loop
    assert len(renv.store.reports.events(job.id, "reaped_expired_lease")) == 2
    assert len(renv.store.reports.events(job.id, "dead_lettered")) == 1
    # Each death was seen at once by the worker's main process, not left to the lease's expiry.
    assert all("worker process lost: WorkerLostError" in e["reason"]
               for e in renv.store.reports.events(job.id, "reaped_expired_lease"))
    assert renv.broker.llen(renv.queue) == 0


def test_a_reaper_killed_between_publish_and_cas_leaves_nothing_stuck(renv, tmp_path):
    env, app = renv.env(), renv.app()
    work = app.tasks["reaper_app.work"]
    pause = tmp_path / "paused"
    with celery_processes(tmp_path) as procs:
        victim = worker(APP, env, tmp_path, pool="prefork", concurrency=2, queues=renv.queue, name="victim")
        procs.append(victim)
        jobs = [work.delay(60.0).id for _ in range(2)]
        wait_for(lambda: running_on(renv, jobs), timeout=40, message="jobs never started")
        victim.kill()
        # A reaper that stops right after publishing the first message, before its CAS
        paused = spawn_reaper({**env, "REAPER_PAUSE_FILE": str(pause)}, tmp_path, "paused-reaper")
        procs.append(paused)
        wait_for(pause.exists, timeout=20, message="reaper never published")
        first = wait_for(pause.read_text, timeout=5, message="pause file empty")
        paused.kill()
        assert renv.store.reports.events(first, "reaped_expired_lease") == []  # the CAS never happened
        # The early message finds the lease claimable; the next reaper takes the lock after its TTL
        procs.append(worker(APP, env, tmp_path, pool="prefork", queues=renv.queue, name="rescuer"))
        with reaper_loop(app):
            wait_for(lambda: all(renv.status(j) == COMPLETED for j in jobs), timeout=40,
                     message="jobs stuck after the reaper died")
    # Whichever took each job back first (the early message's claim or the next reaper: on a
    # loaded machine either wins), each was recovered once and finished once, never run by two
    # live owners: its second run is a new lease in another process, after the victim died.
    for job_id in jobs:
        recoveries = [e for name in RECOVERIES for e in renv.store.reports.events(job_id, name)]
        assert len(recoveries) == 1, recoveries
        assert (renv.count(job_id, "started"), renv.count(job_id, "finished")) == (2, 1)
        assert len(set(renv.pids(job_id))) == 2
        assert sorted(renv.attempts(job_id)) == [1, 2]
    assert unfinished(renv) == 0


def test_jobs_whose_messages_vanished_from_the_broker_are_redispatched_and_complete(renv, tmp_path):
    quick = {"lease_dispatch_timeout": 3.0}
    app = renv.app(**quick)
    jobs = [app.tasks["reaper_app.work"].delay(0.1).id for _ in range(10)]
    assert renv.broker.llen(renv.queue) == 10
    # What a Redis restart without persistence does to them. (Not FLUSHDB: db 7 is shared with
    # the other reaper tests, which may run in parallel processes.)
    renv.broker.delete(renv.queue)
    with celery_processes(tmp_path) as procs:
        procs.append(worker(APP, renv.env(**quick), tmp_path, pool="prefork", queues=renv.queue))
        with reaper_loop(app):
            wait_for(lambda: all(renv.status(j) == COMPLETED for j in jobs), timeout=40,
                     message="jobs with lost messages not all completed")
    for job_id in jobs:
        # Sent again at least once; a slow worker may see a second copy (skipped as a duplicate).
        dispatched = renv.store.get(job_id).dispatch_count
        assert dispatched >= 1 and len(renv.store.reports.events(job_id, "redispatched")) == dispatched
        assert (renv.count(job_id, "started"), renv.count(job_id, "finished")) == (1, 1)
    assert unfinished(renv) == 0
