"""Celery 5.5–5.7's settings that overlap the lease, under one real prefork worker (Redis db 7,
PostgreSQL store): ``task_retry_on_worker_lost``, ``task_acks_on_timeout``, ``task_acks_on_failure``.

The worker runs with all three set the way that would re-run a job in plain Celery; the lease
must keep it to one more run, with its attempts counted once.
"""

from __future__ import annotations

import json
import os
import signal
import time

import celery
import pytest

from celery_lease.ops.celery_settings import missing_features
from celery_lease.ops.checks import run_checks
from celery_lease.store import COMPLETED, FAILED
from tests.helpers import wait_for
from tests.reaper_env import APP, ReaperEnv, reaper_loop
from tests.workers import beat, celery_processes, worker

pytestmark = pytest.mark.integration

NEEDS = ("task_retry_on_worker_lost", "task_acks_on_timeout", "task_acks_on_failure")
_missing = sorted(set(NEEDS) & set(missing_features()))
if _missing:
    pytestmark = [pytestmark, pytest.mark.skip(
        reason=f"{', '.join(_missing)} first exist in Celery 5.7; installed: {celery.__version__}")]


@pytest.fixture(scope="module")
def leased(redis_url, postgres_url, tmp_path_factory):
    """One prefork worker whose settings would re-run lost, timed-out and failed jobs in plain Celery."""
    renv = ReaperEnv(redis_url, postgres_url)
    conf = {"lease_duration": 30.0, "lease_heartbeat_interval": 1.0, "task_acks_late": True,
            "task_retry_on_worker_lost": True, "task_acks_on_timeout": False, "task_acks_on_failure": False,
            "result_backend": renv.broker_url, "task_ignore_result": False, "lease_max_attempts": 2}
    logs = tmp_path_factory.mktemp("celery-settings")
    with celery_processes(logs) as procs:
        procs.append(worker(APP, renv.env(**conf), logs, pool="prefork"))
        yield renv, renv.app(**conf)
    renv.close()


def wait_started(renv: ReaperEnv, job_id: str, times: int = 1) -> None:
    wait_for(lambda: renv.count(job_id, "started") >= times and renv.status(job_id) == "running",
             timeout=30, message=f"job {job_id} never started")


def test_retry_on_worker_lost_with_a_lease_runs_a_killed_childs_job_once_more_not_twice(leased):
    renv, app = leased
    result = app.tasks["reaper_app.work"].delay(60.0)
    wait_started(renv, result.id)
    [child] = renv.pids(result.id)
    os.kill(child, signal.SIGKILL)
    assert result.get(timeout=30) == 2  # the re-run's self.lease.attempt
    assert (renv.count(result.id, "started"), renv.count(result.id, "finished")) == (2, 1)
    assert renv.attempts(result.id) == [1, 2]
    job = renv.store.get(result.id)
    assert job.status == COMPLETED and job.attempt_count == 2
    # One message ran it again: Celery's own retry was not sent beside the lease's requeue.
    assert renv.store.reports.events(result.id, "duplicate_delivery_skipped") == []


def test_retry_on_worker_lost_leaves_a_job_dead_lettered_at_lease_max_attempts_failed(leased):
    renv, app = leased
    result = app.tasks["reaper_app.suicide"].delay()  # kills its child on every attempt; 2 attempts
    wait_for(lambda: renv.status(result.id) == FAILED, timeout=40, message="job never dead-lettered")
    wait_for(lambda: result.state == "FAILURE", timeout=10,
             message="Celery's retry overwrote the dead letter's FAILURE")
    # A later job on the same single child runs after anything Celery could have re-sent.
    app.tasks["reaper_app.work"].delay(0.0).get(timeout=30)
    assert renv.count(result.id, "started") == 2
    assert renv.store.reports.events(result.id, "duplicate_delivery_skipped") == []
    assert result.state == "FAILURE"


@pytest.mark.parametrize("how", ["_exit", "sys.exit"])
def test_a_child_lost_after_celery_stored_its_success_completes_its_job_without_running_it_again(leased, how):
    renv, app = leased
    # Its completion deferred (the store did not answer), the child dies once SUCCESS is stored.
    result = app.tasks["reaper_app.dies_after_success"].delay(how)
    wait_for(lambda: renv.count(result.id, "started") and renv.status(result.id) in (COMPLETED, "pending"),
             timeout=30,
             message=f"the lost child's job was never settled: {renv.store.reports.events(result.id)}")
    job = renv.store.get(result.id)
    assert (job.status, job.attempt_count) == (COMPLETED, 1)
    assert renv.count(result.id, "started") == 1
    assert result.state == "SUCCESS"  # as Celery 5.7 keeps it, not RETRY


def test_a_lost_childs_completion_that_meets_a_store_outage_in_the_main_process_is_kept_until_written(leased):
    renv, app = leased
    # The child's completion and the main process's first one both find the store away.
    result = app.tasks["reaper_app.dies_after_success"].delay("_exit", True)
    wait_for(lambda: renv.count(result.id, "started") and renv.count(result.id, "main_outage") == 0
             and renv.status(result.id) != "running", timeout=30,
             message=f"the lost child's job was never settled: {renv.store.reports.events(result.id)}")
    job = renv.store.get(result.id)
    assert (job.status, job.attempt_count) == (COMPLETED, 1)
    assert renv.count(result.id, "started") == 1
    assert result.state == "SUCCESS"


def test_acks_on_timeout_off_requeues_a_timed_out_job_through_the_lease_once(leased):
    renv, app = leased
    # 60 s on its first run, killed at its 1.5 s hard limit; 0.1 s on the next.
    result = app.tasks["reaper_app.work"].apply_async((60.0,), time_limit=1.5)
    wait_for(lambda: renv.status(result.id) == COMPLETED, timeout=30,
             message=f"timed-out job not run again: {renv.store.reports.events(result.id)}")
    assert (renv.count(result.id, "started"), renv.count(result.id, "finished")) == (2, 1)
    assert renv.attempts(result.id) == [1, 2]
    # The job went back to pending only once the timed-out child could no longer run beside its copy.
    seen = renv.count(result.id, "timeout_alive"), renv.count(result.id, "timeout_dead")
    assert seen == (0, 1), f"(alive, dead) when the lease settled the time limit: {seen}"
    reaped = renv.store.reports.events(result.id, "reaped_expired_lease")
    assert len(reaped) == 1 and "TimeLimitExceeded" in reaped[0]["reason"]
    assert renv.store.reports.events(result.id, "duplicate_delivery_skipped") == []
    wait_for(lambda: result.state == "SUCCESS", timeout=10, message="re-run's result not stored")


def test_a_body_raising_time_limit_exceeded_itself_fails_and_its_pool_process_lives_on(leased):
    # Only billiard's own hard time limit kills the child early; this is the body's failure.
    renv, app = leased
    result = app.tasks["reaper_app.raises_time_limit"].delay()
    wait_for(lambda: result.state == "FAILURE", timeout=30, message="the body's failure was not stored")
    later = app.tasks["reaper_app.work"].delay(0.0)
    later.get(timeout=30)
    assert renv.pids(later.id) == renv.pids(result.id), "the pool process that ran the failed body was killed"
    assert renv.status(result.id) == FAILED and renv.count(result.id, "started") == 1


def test_acks_on_failure_off_rejects_a_failed_job_and_the_lease_keeps_it_failed(leased):
    renv, app = leased
    result = app.tasks["reaper_app.boom"].delay()
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=30, propagate=True)
    app.tasks["reaper_app.work"].delay(0.0).get(timeout=30)  # after anything requeued would have run
    job = renv.store.get(result.id)
    assert job.status == FAILED and "boom" in job.last_error
    assert renv.count(result.id, "started") == 1
    # Rejected, not acknowledged, and not requeued: nothing left for the broker to deliver.
    assert renv.broker.llen(renv.queue) == 0


SOFT = 3.0  # worker_soft_shutdown_timeout, seconds
REAPER_INTERVAL = 0.5  # the beat schedule of tests/apps/reaper_app.py


@pytest.mark.skipif("worker_soft_shutdown_timeout" in missing_features(), reason=(
    f"worker_soft_shutdown_timeout first exists in Celery 5.5; installed: {celery.__version__}"))
@pytest.mark.parametrize(("sig", "extra_env"), [(signal.SIGQUIT, {}),
                                                (signal.SIGTERM, {"REMAP_SIGTERM": "SIGQUIT"})],
                         ids=["SIGQUIT", "SIGTERM-remapped"])
def test_soft_shutdown_finishes_short_bodies_and_gives_back_the_lease_of_a_long_one(
        redis_url, postgres_url, tmp_path, sig, extra_env):
    renv = ReaperEnv(redis_url, postgres_url)
    conf = {"lease_duration": 30.0, "lease_heartbeat_interval": 1.0, "lease_dispatch_timeout": 600.0,
            "task_acks_late": True, "worker_soft_shutdown_timeout": SOFT}
    app = renv.app(**conf)
    try:
        with celery_processes(tmp_path) as procs:
            first = worker(APP, {**renv.env(**conf), **extra_env}, tmp_path, pool="prefork", concurrency=2)
            procs.append(first)
            short = app.tasks["reaper_app.work"].delay(1.0 + SOFT / 2)  # ends within the soft timeout
            long = app.tasks["reaper_app.work"].delay(60.0)
            wait_started(renv, short.id)
            wait_started(renv, long.id)
            standby = worker(APP, renv.env(**conf), tmp_path, pool="solo")  # after both were taken
            procs.append(standby)
            wait_for(lambda: len(app.control.ping(timeout=0.5)) == 2, timeout=30, message="standby never up")
            signalled = time.time()
            first.popen.send_signal(sig)
            assert first.popen.wait(SOFT + 20) is not None
            exited = time.time()
            wait_for(lambda: renv.status(long.id) == COMPLETED, timeout=30,
                     message=f"given-back job never ran again: {renv.store.reports.events(long.id)}")
        assert renv.status(short.id) == COMPLETED
        assert (renv.count(short.id, "started"), renv.count(short.id, "finished")) == (1, 1)
        assert renv.store.reports.events(short.id, "released_on_shutdown") == []
        [released] = renv.store.reports.events(long.id, "released_on_shutdown")
        assert SOFT - 0.5 <= released["at"] - signalled <= exited - signalled  # at T, before the exit
        assert (renv.count(long.id, "started"), renv.count(long.id, "finished")) == (2, 1)
        assert renv.attempts(long.id) == [1, 1]  # the given-back attempt was not charged
        # The first claim is the given-back attempt the re-claim's event records; the re-claim is
        # back on the standby once the worker is gone (its lease of 30 s has not expired), with no
        # reaper running: the broker's restore of the unacknowledged message finds it pending.
        [claim] = renv.store.reports.events(long.id, "claimed")
        assert json.loads(claim["detail"])["previous_started_at"] < released["at"] < claim["at"]
        # Long before the given-back lease could have expired (a loaded machine takes seconds to hand
        # the restored message to the standby, never a lease).
        assert claim["at"] - exited < conf["lease_duration"] / 3
    finally:
        renv.close()


@pytest.mark.skipif("worker_pool_start_method" in missing_features(), reason=(
    f"worker_pool_start_method first exists in Celery 5.7; installed: {celery.__version__}"))
def test_spawned_children_heartbeat_and_a_killed_one_is_recovered_once(redis_url, postgres_url, tmp_path):
    renv = ReaperEnv(redis_url, postgres_url)
    conf = {"worker_pool_start_method": "spawn", "task_acks_late": True}  # 2 s leases, 0.4 s heartbeats
    app = renv.app(**conf)
    try:
        with celery_processes(tmp_path) as procs, reaper_loop(app, REAPER_INTERVAL):
            procs.append(worker(APP, renv.env(**conf), tmp_path, pool="prefork"))
            slow = app.tasks["reaper_app.work"].delay(3.0)  # 1.5 leases: only heartbeats keep it
            wait_started(renv, slow.id)
            [child] = renv.pids(slow.id)
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                assert b"spawn_main" in cmdline.read()  # a fresh interpreter, not a fork
            wait_for(lambda: renv.status(slow.id) == COMPLETED, timeout=30,
                     message="slow job never completed")
            row = renv.store.get(slow.id)
            assert row.last_heartbeat_at - row.started_at > 2.0 and row.attempt_count == 1
            assert renv.store.reports.events(slow.id, "reaped_expired_lease") == []
            killed = app.tasks["reaper_app.work"].delay(60.0)
            wait_started(renv, killed.id)
            [child] = renv.pids(killed.id)
            os.kill(child, signal.SIGKILL)
            wait_for(lambda: renv.status(killed.id) == COMPLETED, timeout=30,
                     message="killed job not recovered")
        assert (renv.count(killed.id, "started"), renv.count(killed.id, "finished")) == (2, 1)
        assert renv.attempts(killed.id) == [1, 2]
    finally:
        renv.close()


@pytest.mark.skipif("beat_enable_remote_control" in missing_features(), reason=(
    f"beat_enable_remote_control first exists in Celery 5.7; installed: {celery.__version__}"))
def test_lease_check_says_whether_celery_beat_answers_ping(redis_url, postgres_url, tmp_path):
    renv = ReaperEnv(redis_url, postgres_url)
    conf = {"beat_enable_remote_control": True}
    app = renv.app(**conf)

    def beat_finding():
        [finding] = [f for f in run_checks(app, renv.store) if f.code == "beat_alive"]
        return finding

    try:
        assert beat_finding().level == "warning"  # no beat yet
        with celery_processes(tmp_path) as procs:
            procs.append(beat(APP, renv.env(**conf), tmp_path))
            alive = wait_for(lambda: (f := beat_finding()).level == "ok" and f, timeout=30,
                             message="celery beat never answered ping")
            assert [node.split("@")[0] for node in alive.values["beat"]] == ["celerybeat"]
        silent = beat_finding()  # the beat was killed with the block
        assert silent.level == "warning" and silent.values["beat"] == []
    finally:
        renv.close()
