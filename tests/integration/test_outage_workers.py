"""outage.py: a real worker (Redis db 13 or RabbitMQ, PostgreSQL behind a proxy the test cuts)
stops consuming while its store is unreachable and consumes again once it answers; what it sent
back backs off.

Fast settings (tests/apps/owner_app.py): acks_late, prefetch multiplier 1; here a store retry
delay of 0.3 s (the probe's interval too) capped at 1.2 s, and two pool slots.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import kombu
import pytest

from celery_lease.messaging.messages import STORE_RETRIES_HEADER
from tests.helpers import wait_for
from tests.owner_env import APP, OwnerEnv
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

JOBS = 10
FAILED_CLOSED = re.compile(r"job (\S+) not started, lease store unreachable")


def queued(oenv: OwnerEnv) -> list[dict]:
    """The messages waiting in the test's queue (Redis list), oldest last."""
    return [json.loads(raw) for raw in oenv.reports.lrange(oenv.queue, 0, -1)]


def completed(oenv: OwnerEnv, job_id: str) -> bool:
    job = oenv.store.get(job_id)
    return job is not None and job.status == "completed"


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_worker_stops_consuming_while_its_store_is_unreachable_and_consumes_again_when_it_answers(
        oenv, tmp_path, pool):
    # prefork: a child's delivery tells the main process; threads: the bodies run in the main
    # process, whose consumer runs the asynchronous event loop; gevent: the blocking loop.
    if pool == "gevent":
        pytest.importorskip("gevent")
    proxy, store_url = oenv.proxied_store()
    app = oenv.app()
    env = oenv.env(store_url=store_url, lease_store_retry_delay=0.3, lease_store_retry_max=1.2)
    with celery_processes(tmp_path) as procs:
        # Given a worker (two pool slots) whose only way to the store is the proxy, done with a first job
        w = worker(APP, env, tmp_path, pool=pool, concurrency=2, name=f"outage-{pool}")
        procs.append(w)
        warm = app.tasks["owner.guarded"].delay(0.05)
        wait_for(lambda: completed(oenv, warm.id), timeout=30, message="the worker never completed a job")
        # When the store becomes unreachable and ten jobs are published (recorded directly)
        proxy.cut()
        jobs = {app.tasks["owner.guarded"].delay(0.05).id for _ in range(JOBS)}
        # Then the worker says it stops consuming, and every job's message waits in the queue
        wait_for(lambda: "stops consuming until the lease store answers" in w.output(), timeout=15,
                 message="the worker never stopped consuming")
        waiting = wait_for(lambda: (msgs := queued(oenv)) and {m["headers"]["id"] for m in msgs} == jobs
                           and len(msgs) == JOBS and msgs, timeout=15,
                           message="the jobs' messages never all waited in the queue")
        sent_back = [m for m in waiting if m["headers"].get(STORE_RETRIES_HEADER)]
        assert sent_back, "no delivery failed closed before the consumer stopped"
        assert all(m["headers"]["eta"] for m in sent_back)  # each was sent for later
        # and they still wait there after the latest of their countdowns passed (a consuming worker
        # would have taken those back by then, and sent them back again)
        latest = max(time.time(), *(datetime.fromisoformat(m["headers"]["eta"]).timestamp()
                                    for m in sent_back))
        wait_for(lambda: time.time() > latest + 1.0, timeout=5)
        assert {m["headers"]["id"] for m in queued(oenv)} == jobs and len(queued(oenv)) == JOBS
        # and each re-send of a message counted in its header, the few the worker held (not
        # every job, let alone one per retry delay and job)
        failed_closed = FAILED_CLOSED.findall(w.output())
        assert len(failed_closed) == sum(m["headers"][STORE_RETRIES_HEADER] for m in sent_back) < JOBS
        # When the store answers again
        proxy.start()
        # Then the worker consumes again and runs every job once
        wait_for(lambda: "consumes again" in w.output(), timeout=15, message="the worker never resumed")
        wait_for(lambda: all(completed(oenv, job_id) for job_id in jobs), timeout=30,
                 message="not every job completed after the store came back")
        assert {job_id: len(oenv.started(job_id)) for job_id in jobs} == dict.fromkeys(jobs, 1)
        assert FAILED_CLOSED.findall(w.output()) == failed_closed


def ready_messages(amqp_url: str, queue: str) -> int:
    """Messages waiting in a RabbitMQ queue (not those delivered to a consumer)."""
    with kombu.Connection(amqp_url) as connection:
        return connection.default_channel.queue_declare(queue, passive=True).message_count


def test_a_worker_on_rabbitmq_stops_consuming_while_its_store_is_unreachable(oenv, tmp_path, amqp_url):
    proxy, store_url = oenv.proxied_store()
    app = oenv.app(broker_url=amqp_url)
    env = oenv.env(store_url=store_url, broker_url=amqp_url, lease_store_retry_delay=0.3,
                   lease_store_retry_max=1.2)
    try:
        with celery_processes(tmp_path) as procs:
            # Given a prefork worker on RabbitMQ whose only way to the store is the proxy
            w = worker(APP, env, tmp_path, concurrency=2, name="outage-amqp")
            procs.append(w)
            warm = app.tasks["owner.guarded"].delay(0.05)
            wait_for(lambda: completed(oenv, warm.id), timeout=30, message="the worker never completed a job")
            # When the store becomes unreachable and ten jobs are published
            proxy.cut()
            jobs = {app.tasks["owner.guarded"].delay(0.05).id for _ in range(JOBS)}
            # Then the worker stops consuming, and the ten messages wait in the queue, none held by it,
            # still after the longest re-send delay (1.2 s) passed
            wait_for(lambda: "stops consuming until the lease store answers" in w.output(), timeout=15,
                     message="the worker never stopped consuming")
            wait_for(lambda: ready_messages(amqp_url, oenv.queue) == JOBS, timeout=15,
                     message="the jobs' messages never all waited in the queue")
            longest = time.monotonic() + 1.2 + 1.0
            wait_for(lambda: time.monotonic() > longest, timeout=5)
            assert ready_messages(amqp_url, oenv.queue) == JOBS
            failed_closed = FAILED_CLOSED.findall(w.output())
            assert 0 < len(failed_closed) < JOBS
            # When the store answers again, the worker consumes again and runs every job once
            proxy.start()
            wait_for(lambda: all(completed(oenv, job_id) for job_id in jobs), timeout=30,
                     message="not every job completed after the store came back")
            assert {job_id: len(oenv.started(job_id)) for job_id in jobs} == dict.fromkeys(jobs, 1)
            assert FAILED_CLOSED.findall(w.output()) == failed_closed
    finally:
        with kombu.Connection(amqp_url) as connection:
            connection.default_channel.queue_delete(oenv.queue)
