"""RabbitMQ: a long LeaseTask completes once on the real broker, and `lease check` compares
RabbitMQ's consumer_timeout with the tasks' time limits.

RabbitMQ has no per-message visibility extension: a delivery held unacknowledged longer than
``consumer_timeout`` closes the consumer's channel. Its management plugin is not enabled on
this machine, so the check falls back to RabbitMQ's documented default (30 minutes, which
is also what this broker runs with).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from urllib.parse import urlsplit, urlunsplit

import celery
import kombu
import pytest
import redis

from celery_lease.ops.checks import run_checks
from tests import workers
from tests.apps.broker_app import make_app
from tests.conftest import drop_app_store, migrated_store, unique_prefix
from tests.helpers import client_store, wait_for
from tests.reaper_env import reaper_loop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_DB = 9  # the counters
LONG = 5.0  # seconds: five times the app's 1 s lease
APP = "tests.apps.broker_app"


@pytest.fixture
def counters(redis_url):
    """Counters in Redis db 9 under a key prefix of this test's own, removed after."""
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    client, prefix = redis.Redis.from_url(url), f"{unique_prefix()}:"
    yield url, prefix
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


@pytest.fixture
def env(amqp_url, counters, postgres_url):
    queue = f"lease-rabbitmq-{uuid.uuid4().hex[:8]}"  # no other test's worker consumes it
    env = {"BROKER_APP_BROKER": amqp_url, "BROKER_APP_COUNTERS": counters[0],
           "BROKER_APP_STORE": postgres_url, "BROKER_APP_PREFIX": unique_prefix(), "BROKER_APP_QUEUE": queue,
           "BROKER_APP_TIME_LIMIT": "60", "BROKER_APP_KEYPREFIX": counters[1]}
    migrated_store(make_app(env)[0])
    yield env
    drop_app_store(make_app(env)[0])
    with kombu.Connection(amqp_url) as connection:
        connection.default_channel.queue_delete(queue)


def test_a_long_leased_job_completes_once_on_rabbitmq(env, tmp_path):
    app, counters = make_app(env)
    work, store = app.tasks["broker_app.work"], client_store(app)
    with workers.celery_processes(tmp_path) as procs:
        proc = workers.worker(APP, env, tmp_path, name="r")
        procs.append(proc)
        wait_for(lambda: " ready." in proc.output() or proc.popen.poll() is not None, timeout=30,
                 message="worker did not start")
        assert proc.popen.poll() is None, proc.output()
        job_id = work.apply_async((LONG,)).id
        wait_for(lambda: (job := store.get(job_id)) is not None and job.status == "completed", timeout=30,
                 message=f"job did not complete:\n{proc.output()[-3000:]}")
    job = store.get(job_id)
    assert job.completed_at - job.started_at >= LONG >= 5 * app.conf.lease_duration
    assert (job.attempt_count, job.expired_count) == (1, 0)
    counts = [counters.count(f"{k}:{job_id}") for k in ("delivered", "redelivered", "started", "finished")]
    assert counts == [1, 0, 1, 1]
    # One claim, never taken over or claimed again (each would be an event): the row records
    # the claim and the completion.
    assert [e["event"] for e in store.reports.events(job_id)] == ["published"]


def test_check_flags_a_consumer_timeout_shorter_than_a_task_time_limit(env, tmp_path):
    within, _ = make_app(env)  # time_limit 60 s, RabbitMQ's default consumer_timeout 1800 s
    (finding,) = [f for f in run_checks(within) if f.code == "consumer_timeout"]
    assert finding.level == "ok" and finding.values == {
        "consumer_timeouts": {env["BROKER_APP_QUEUE"]: (1800.0, "RabbitMQ default")}}

    beyond_env = {**env, "BROKER_APP_TIME_LIMIT": "3600"}
    beyond, _ = make_app(beyond_env)
    (finding,) = [f for f in run_checks(beyond) if f.code == "consumer_timeout"]
    assert (finding.level, finding.values["consumer_timeout"], finding.values["time_limit"]) == (
        "error", 1800.0, 3600.0)
    assert finding.values["source"] == "RabbitMQ default"
    assert "x-consumer-timeout" in finding.fix

    # The same through the command line: JSON for machines, a non-zero exit on the error.
    done = subprocess.run([sys.executable, "-m", "celery", "-A", APP, "lease", "check", "--json"],
                          cwd=workers.ROOT, env={**os.environ, "PYTHONPATH": str(workers.ROOT), **beyond_env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    findings = json.loads(done.stdout)
    assert {(f["level"], f["code"]) for f in findings} >= {("error", "consumer_timeout")}


@pytest.mark.skipif(tuple(int(p) for p in celery.__version__.split(".")[:2]) < (5, 5),
                    reason=f"a Celery worker consumes a quorum queue from Celery 5.5 "
                           f"(worker_detect_quorum_queues; before it, its global QoS makes the consumer "
                           f"restart); installed: {celery.__version__}")
def test_a_worker_killed_on_a_quorum_queue_that_drops_the_redelivery_runs_the_job_once_more(env, tmp_path):
    # x-delivery-limit 0: RabbitMQ drops the message instead of delivering it again after the kill,
    # so only the lease brings the job back (the reaper, once the dead owner's lease expired).
    quorum = {**env, "BROKER_APP_QUEUE_ARGS": json.dumps({"x-queue-type": "quorum", "x-delivery-limit": 0})}
    app, counters = make_app(quorum)
    work, store = app.tasks["broker_app.work"], client_store(app)
    [finding] = [f for f in run_checks(app) if f.code == "quorum_delivery_limit"]
    assert finding.level == "warning" and finding.values["x-delivery-limit"] == 0
    with workers.celery_processes(tmp_path) as procs:
        first = workers.worker(APP, quorum, tmp_path, name="q1")
        procs.append(first)
        wait_for(lambda: " ready." in first.output() or first.popen.poll() is not None, timeout=30,
                 message="worker did not start")
        job_id = work.apply_async((LONG,)).id
        wait_for(lambda: counters.count(f"started:{job_id}") == 1, timeout=30, message="job never started")
        first.kill()  # the whole worker, mid-body
        procs.append(workers.worker(APP, quorum, tmp_path, name="q2"))
        with reaper_loop(app):
            wait_for(lambda: (job := store.get(job_id)) is not None and job.status == "completed", timeout=40,
                     message=f"job not recovered: {store.reports.events(job_id)}")
    assert [counters.count(f"{k}:{job_id}") for k in ("redelivered", "started", "finished")] == [0, 2, 1]
    assert len(store.reports.events(job_id, "reaped_expired_lease")) == 1
    assert store.get(job_id).attempt_count == 2
