"""The Redis visibility extension with real `celery worker` subprocesses, Redis db 9 and PostgreSQL.

kombu restores an unacknowledged message once its score in ``unacked_index`` is older than
``visibility_timeout`` (3 s here, swept every second). Jobs run 12 s and countdowns wait
10 s, several times the visibility timeout, so without the extension every one of them is
delivered again while its worker lives; with it, none is, and a SIGKILLed worker's
messages still come back and complete once on the other worker.
"""

from __future__ import annotations

import os
import signal
import time

import celery
import kombu
import pytest

from celery_lease.store import Store
from tests import workers
from tests.apps.broker_app import make_app
from tests.conftest import drop_app_store, migrated_store, prefixed_redis, unique_prefix
from tests.helpers import wait_for


def observer(app) -> Store:
    """The test's own view of the app's store, with the default call bound: the app's bound is a
    third of its lease, which a busy machine's reads can outlast."""
    return Store(app.conf.lease_store_url, app.conf.lease_table_prefix)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Before kombu 5.7 the Redis transport restores unacknowledged messages only when a worker
# starts polling and now and then after an empty poll, not every unacked_restore_interval.
restores_periodically = pytest.mark.skipif(
    (kombu.VERSION.major, kombu.VERSION.minor) < (5, 7),
    reason="needs kombu 5.7 (unacked messages restored every unacked_restore_interval)")
# Before Celery 5.7 a worker does not track the requests waiting for their ETA
# (celery.worker.state.scheduled_requests), so their scores are not refreshed.
tracks_eta_requests = pytest.mark.skipif(
    (celery.VERSION.major, celery.VERSION.minor) < (5, 7),
    reason="needs Celery 5.7 (celery.worker.state.scheduled_requests)")

REDIS_DB = 9
VT = 3.0  # kombu's visibility_timeout in these workers
LONG = 12.0  # seconds a long job runs
COUNTDOWN = 10.0  # seconds an ETA job waits inside a worker
APP = "tests.apps.broker_app"


@pytest.fixture
def broker(redis_url):
    """Redis db 9 under a key prefix of this test's own (kombu's global_keyprefix), removed after."""
    with prefixed_redis(redis_url, REDIS_DB) as handles:
        yield handles


@pytest.fixture
def env(broker, postgres_url):
    env = {"BROKER_APP_BROKER": broker[0], "BROKER_APP_COUNTERS": broker[0], "BROKER_APP_STORE": postgres_url,
           "BROKER_APP_PREFIX": unique_prefix(), "BROKER_APP_VT": str(VT), "BROKER_APP_EXTEND": "1",
           "BROKER_APP_KEYPREFIX": broker[2],
           # A 3 s lease (1 s call bound): these tests count a body's runs, and a PostgreSQL stall of
           # a few hundred milliseconds on a loaded machine costs a 1 s lease its heartbeat, so a
           # healthy job would stop and run again (correctly, but not what these tests are about).
           "BROKER_APP_LEASE": "3"}
    migrated_store(make_app(env)[0])
    yield env
    drop_app_store(make_app(env)[0])


def start(procs, env, log_dir, *names):
    """Start one worker per name and wait until each says it is ready."""
    started = [workers.worker(APP, env, log_dir, name=name) for name in names]
    procs.extend(started)
    for proc in started:
        wait_for(lambda p=proc: " ready." in p.output() or p.popen.poll() is not None, timeout=30,
                 message=f"worker {proc.name} did not start")
        assert proc.popen.poll() is None, proc.output()
    return started


def publish(work):
    """Two jobs waiting for their countdown inside a worker, then two long jobs.

    ETA messages first: a worker raises its prefetch limit for each one it holds.
    """
    eta_jobs = [work.apply_async((0.1,), countdown=COUNTDOWN).id for _ in range(2)]
    long_jobs = [work.apply_async((LONG,)).id for _ in range(2)]
    return long_jobs, eta_jobs


def counts(counters, job_id, *keys) -> list[int]:
    return [counters.count(f"{key}:{job_id}") for key in keys]


def all_completed(store, jobs):
    return all((job := store.get(j)) is not None and job.status == "completed" for j in jobs)


def drained(client, prefix) -> bool:
    """Every delivery is acknowledged and nothing waits in the queue."""
    return not any((client.hlen(f"{prefix}unacked"), client.zcard(f"{prefix}unacked_index"),
                    client.llen(f"{prefix}celery")))


def test_live_workers_keep_their_messages_and_each_body_runs_once(env, broker, tmp_path):
    app, counters = make_app(env)
    work, store, (_, client, prefix) = app.tasks["broker_app.work"], observer(app), broker
    with workers.celery_processes(tmp_path) as procs:
        start(procs, env, tmp_path, "a", "b")
        long_jobs, eta_jobs = publish(work)
        jobs = long_jobs + eta_jobs
        wait_for(lambda: all_completed(store, jobs), timeout=60, message="jobs did not complete")
        wait_for(lambda: drained(client, prefix), timeout=15, message="deliveries left unacknowledged")
    for job_id in jobs:
        assert counts(counters, job_id, "delivered", "redelivered", "started", "finished") == [1, 0, 1, 1]
    for job_id in long_jobs:  # each long job really outlived the visibility timeout several times
        job = store.get(job_id)
        assert job.completed_at - job.started_at >= LONG >= 4 * VT
        assert job.attempt_count == 1
    assert store.reports.event_counts(["duplicate_delivery_skipped"]) == {"duplicate_delivery_skipped": 0}


@restores_periodically
def test_a_worker_in_warm_shutdown_keeps_the_message_of_the_job_it_still_runs(env, broker, tmp_path):
    # A warm shutdown (SIGTERM to the main process, as a deploy sends it) stops the consumer before the
    # pool drains: the job still running there keeps its message, which the other worker would restore.
    app, counters = make_app(env)
    work, store, (_, client, prefix) = app.tasks["broker_app.work"], observer(app), broker
    with workers.celery_processes(tmp_path) as procs:
        a, b = start(procs, env, tmp_path, "a", "b")
        job = work.apply_async((LONG,)).id
        wait_for(lambda: counters.count(f"started:{job}"), timeout=20, message="the job did not start")
        runner = a if counters.names(f"ran_on:{job}") == ["a"] else b
        os.kill(runner.pid, signal.SIGTERM)
        wait_for(lambda: all_completed(store, [job]), timeout=60, message="the job did not complete")
        wait_for(lambda: runner.exited() is not None, timeout=30, message="the worker did not stop")
        wait_for(lambda: drained(client, prefix), timeout=15, message="deliveries left unacknowledged")
    assert counts(counters, job, "delivered", "redelivered", "started", "finished") == [1, 0, 1, 1]
    finished = store.get(job)
    assert finished.completed_at - finished.started_at >= LONG >= 3 * VT  # outlived the visibility timeout


@tracks_eta_requests
@restores_periodically
def test_a_killed_workers_messages_are_restored_and_completed_once_by_the_other(env, broker, tmp_path):
    # A lease that has expired past its grace by the time kombu restores the dead worker's
    # messages (visibility timeout 3 s), so that the other worker takes the running job over.
    env = {**env, "BROKER_APP_LEASE": "2"}
    app, counters = make_app(env)
    work, store, (_, client, prefix) = app.tasks["broker_app.work"], observer(app), broker
    with workers.celery_processes(tmp_path) as procs:
        (a,) = start(procs, env, tmp_path, "a")
        eta = work.apply_async((0.1,), countdown=COUNTDOWN).id
        running = work.apply_async((LONG,)).id
        reserved = work.apply_async((1.0,)).id  # prefetched behind the running one
        jobs = [running, reserved, eta]
        wait_for(lambda: counters.count(f"started:{running}")
                 and all(counters.count(f"delivered:{j}") for j in jobs),
                 timeout=20, message="worker a did not take all three messages")
        first = dict(client.zrange(f"{prefix}unacked_index", 0, -1, withscores=True))
        assert len(first) == 3
        # The live worker pushes the scores of everything it holds forward.
        wait_for(lambda: all(client.zscore(f"{prefix}unacked_index", tag) > score + VT / 2
                             for tag, score in first.items()),
                 timeout=10, message="worker a did not refresh the scores of its messages")
        start(procs, env, tmp_path, "b")
        assert all(counters.count(f"redelivered:{j}") == 0 for j in jobs)  # nothing restored while a lived
        a.kill()
        wait_for(lambda: all_completed(store, jobs), timeout=60, message="a's jobs were not recovered")
        wait_for(lambda: drained(client, prefix), timeout=15, message="deliveries left unacknowledged")
    for job_id in jobs:
        assert counters.count(f"redelivered:{job_id}") == 1, job_id  # restored by kombu, once
        assert counters.names(f"delivered_to:{job_id}") == ["a", "b"], job_id
        assert counters.count(f"finished:{job_id}") == 1, job_id
    assert counters.names(f"ran_on:{running}") == ["a", "b"]  # killed mid-body on a, completed on b
    assert counters.names(f"ran_on:{reserved}") == ["b"] and counters.names(f"ran_on:{eta}") == ["b"]
    taken = store.get(running)
    assert (taken.attempt_count, taken.expired_count) == (2, 1)
    assert store.reports.event_counts(["duplicate_delivery_skipped"]) == {"duplicate_delivery_skipped": 0}


@restores_periodically
def test_without_the_extension_duplicates_are_delivered_and_skipped_by_the_lease(env, broker, tmp_path):
    env = {**env, "BROKER_APP_EXTEND": "0"}
    app, counters = make_app(env)
    work, store, (_, client, prefix) = app.tasks["broker_app.work"], observer(app), broker
    started_at = time.monotonic()
    with workers.celery_processes(tmp_path) as procs:
        start(procs, env, tmp_path, "a", "b")
        long_jobs, eta_jobs = publish(work)
        jobs = long_jobs + eta_jobs
        wait_for(lambda: all_completed(store, jobs), timeout=60, message="jobs did not complete")
        wait_for(lambda: drained(client, prefix), timeout=30, message="duplicates left unacknowledged")

        def skipped() -> int:
            return store.reports.event_counts(["duplicate_delivery_skipped"])["duplicate_delivery_skipped"]

        def executed() -> int:
            return sum(counters.count(f"executed:{j}") for j in jobs)

        # Every delivery that reached the pool either ran the body (once per job) or was skipped
        # by the lease; a copy whose message is already acknowledged may still be finishing its
        # skip. Not every message received counts: a worker that receives the same message again
        # while it still holds it (kombu restored it) can run the copies as one request.
        wait_for(lambda: executed() == len(jobs) + skipped(), timeout=15,
                 message="a delivery neither ran the body nor was skipped")
    redelivered = sum(counters.count(f"redelivered:{j}") for j in jobs)
    assert redelivered > 0 and skipped() > 0
    assert sum(counters.count(f"delivered:{j}") for j in jobs) >= executed()
    for job_id in jobs:
        assert counts(counters, job_id, "started", "finished") == [1, 1], job_id
        assert store.get(job_id).attempt_count == 1
    assert time.monotonic() - started_at < 120
