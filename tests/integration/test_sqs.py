"""SQS visibility with real `celery worker` subprocesses on moto's SQS server and PostgreSQL.

SQS hides a received message for the queue's ``VisibilityTimeout`` (2 s here) and then hands it
out again, whoever still works on it. Bodies run 8 s, four timeouts: while a live worker holds
the job's lease its heartbeat sends ``ChangeMessageVisibilityBatch`` and no copy is received;
once the lease is not held (the body's process stopped, the worker killed) the extension stops,
the message is received again after its timeout, and the lease decides what runs.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from celery_lease.reaper.run import Reaper
from celery_lease.store import Store
from tests import workers
from tests.apps.broker_app import make_app
from tests.conftest import (
    SQS_TRANSPORT_OPTIONS,
    drop_app_store,
    migrated_store,
    prefixed_redis,
    unique_prefix,
)
from tests.helpers import wait_for
from tests.reaper_env import reap_round

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_DB = 9  # the counters only
VT = 2  # the queue's VisibilityTimeout, seconds (SQS takes whole seconds)
BODY = 8.0  # seconds a body runs: four visibility timeouts
LEASE = 4.0  # lease_duration: longer than VT, so a dead worker's message is back before its lease ends
APP = "tests.apps.broker_app"


@pytest.fixture
def counters_redis(redis_url):
    with prefixed_redis(redis_url, REDIS_DB) as handles:
        yield handles


@pytest.fixture
def env(sqs_url, counters_redis, postgres_url):
    """A queue of this test's own (kombu creates ``<prefix>celery`` with VisibilityTimeout = VT)."""
    transport = {**SQS_TRANSPORT_OPTIONS, "queue_name_prefix": unique_prefix().replace("_", "-"),
                 "wait_time_seconds": 1, "polling_interval": 0.1}
    env = {"BROKER_APP_BROKER": sqs_url, "BROKER_APP_COUNTERS": counters_redis[0],
           "BROKER_APP_KEYPREFIX": counters_redis[2], "BROKER_APP_STORE": postgres_url,
           "BROKER_APP_PREFIX": unique_prefix(), "BROKER_APP_VT": str(VT), "BROKER_APP_EXTEND": "1",
           "BROKER_APP_LEASE": str(LEASE), "BROKER_APP_TRANSPORT": json.dumps(transport)}
    migrated_store(make_app(env)[0])
    yield env
    drop_app_store(make_app(env)[0])


def observer(app) -> Store:
    """The test's own view of the app's store, with the default call bound."""
    return Store(app.conf.lease_store_url, app.conf.lease_table_prefix)


def start(procs, env, log_dir, *names):
    """Start one worker per name and wait until each says it is ready."""
    started = [workers.worker(APP, env, log_dir, name=name) for name in names]
    procs.extend(started)
    for proc in started:
        wait_for(lambda p=proc: " ready." in p.output() or p.popen.poll() is not None, timeout=30,
                 message=f"worker {proc.name} did not start")
        assert proc.popen.poll() is None, proc.output()
    return started


def queue_attributes(app) -> dict[str, str]:
    """The test queue's attributes, as SQS reports them."""
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        url = channel._new_queue(app.conf.task_default_queue)
        return channel.sqs().get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]


def completed(store, job_id) -> bool:
    return (job := store.get(job_id)) is not None and job.status == "completed"


def body_pid(store, job_id) -> int:
    """The pid of the pool process that holds the job's lease (its worker id ends in ``:pid``)."""
    job = store.get(job_id)
    return int(job.locked_by.rsplit(":", 1)[1])


def renewed_for(store, job_id) -> float:
    """Seconds from the job's start to its lease's last renewal, on the store's clock."""
    job = store.get(job_id)
    return 0.0 if job is None or job.last_heartbeat_at is None else job.last_heartbeat_at - job.started_at


def skipped(store) -> int:
    return store.reports.event_counts(["duplicate_delivery_skipped"])["duplicate_delivery_skipped"]


def test_a_held_lease_keeps_the_message_invisible_and_the_body_runs_once_on_two_workers(env, tmp_path):
    app, counters = make_app(env)
    work, store = app.tasks["broker_app.work"], observer(app)
    with workers.celery_processes(tmp_path) as procs:
        start(procs, env, tmp_path, "a", "b")
        assert queue_attributes(app)["VisibilityTimeout"] == str(VT)
        jobs = [work.delay(BODY).id for _ in range(2)]
        wait_for(lambda: all(completed(store, j) for j in jobs), timeout=60, message="jobs did not complete")
        wait_for(lambda: queue_attributes(app)["ApproximateNumberOfMessagesNotVisible"] == "0", timeout=15,
                 message="a message was left unacknowledged")
        attributes = queue_attributes(app)
    for job_id in jobs:
        assert counters.count(f"delivered:{job_id}") == 1, job_id  # never received a second time
        assert [counters.count(f"{key}:{job_id}") for key in ("started", "finished")] == [1, 1], job_id
        job = store.get(job_id)
        assert job.completed_at - job.started_at >= BODY >= 4 * VT
        assert job.attempt_count == 1
    assert attributes["ApproximateNumberOfMessages"] == "0"
    assert skipped(store) == 0


def test_the_extension_stops_once_the_lease_is_not_held_and_the_message_comes_back(env, tmp_path):
    app, counters = make_app(env)
    work, store = app.tasks["broker_app.work"], observer(app)
    with workers.celery_processes(tmp_path) as procs:
        start(procs, env, tmp_path, "a", "b")
        job_id = work.delay(BODY).id
        wait_for(lambda: counters.count(f"started:{job_id}"), timeout=20, message="the job did not start")
        # Given a lease held for three visibility timeouts: its message was received once.
        wait_for(lambda: renewed_for(store, job_id) > 3 * VT, timeout=5 * VT, interval=0.2,
                 message="the lease was not renewed")
        assert counters.count(f"delivered:{job_id}") == 1
        # When the process running the body stops: its heartbeat stops, the lease expires, and
        # the worker's main process (alive, still polling) stops extending the message.
        pid = body_pid(store, job_id)
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            wait_for(lambda: counters.count(f"delivered:{job_id}") == 2, timeout=LEASE + 4 * VT + 10,
                     message="the message of a lease nobody holds did not come back")
            back_after = time.monotonic() - stopped_at
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: completed(store, job_id), timeout=60, message="the job did not complete")
    # Then it came back only once the lease could have ended, and the job ran once more, to its end:
    # the stopped body, woken after its lease ended, stopped without finishing.
    assert back_after >= VT
    assert len(counters.names(f"ran_on:{job_id}")) == 2
    assert counters.count(f"finished:{job_id}") == 1


def test_a_killed_workers_job_is_reaped_comes_back_and_completes_once_with_the_duplicate_skipped(
        env, tmp_path):
    app, counters = make_app(env)
    work, store, reaper = app.tasks["broker_app.work"], observer(app), Reaper(app)
    with workers.celery_processes(tmp_path) as procs:
        a, _ = start(procs, env, tmp_path, "a", "b")
        job_id = work.delay(BODY).id
        wait_for(lambda: counters.names(f"ran_on:{job_id}"), timeout=20, message="the job did not start")
        if counters.names(f"ran_on:{job_id}") != ["a"]:  # b took it: kill b instead
            a = next(p for p in procs if p.name == counters.names(f"ran_on:{job_id}")[0])
        wait_for(lambda: renewed_for(store, job_id) > 2 * VT, timeout=4 * VT, interval=0.2,
                 message="the lease was not renewed")
        assert counters.count(f"delivered:{job_id}") == 1  # held: not received again
        a.kill()
        # The message comes back after its visibility timeout, while the dead owner's lease still
        # runs: the other worker skips that copy. The reaper then takes the lease back and sends
        # the job again.
        wait_for(lambda: skipped(store) == 1, timeout=LEASE + 10, message="the returned copy was not skipped")
        wait_for(lambda: (done := reap_round(reaper)) is not None and done.reaped, timeout=LEASE + 20,
                 interval=0.25, message="the reaper did not take the dead worker's lease back")
        wait_for(lambda: completed(store, job_id), timeout=60, message="the reaped job did not complete")
    survivor = next(p.name for p in procs if p is not a)
    assert counters.names(f"ran_on:{job_id}") == [a.name, survivor]
    assert counters.count(f"finished:{job_id}") == 1
    job = store.get(job_id)
    assert (job.attempt_count, job.expired_count) == (2, 1)
    assert skipped(store) == 1
