"""A worker SIGKILLed inside Celery's post-run work, after the store completed the job.

A chain ``first | second`` of LeaseTasks on RabbitMQ (which hands the unacknowledged message
of ``first`` to the next worker at once), results in Redis, a PostgreSQL store. The first
worker dies (i) after the store's completion and before Celery stores the result, or (ii)
before Celery sends the chain's next step. A second worker receives ``first`` again: the job
is completed in the store, the backend has no result, so the worker stores the kept result and
continues the chain. The chain's final result arrives and each body ran exactly once.
"""

from __future__ import annotations

import uuid

import kombu
import pytest
import redis

from celery_lease.ops.views import job_timeline
from celery_lease.store import Store
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.workers import celery_processes, worker

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

BACKEND_DB = 5


@pytest.fixture
def scene(amqp_url, redis_url, postgres_url, monkeypatch):
    backend = redis_url.rsplit("/", 1)[0] + f"/{BACKEND_DB}"
    client = redis.Redis.from_url(backend, decode_responses=True)
    client.flushdb()
    prefix, queue = unique_prefix(), f"post_run_{uuid.uuid4().hex[:8]}"
    store = Store(postgres_url, prefix)
    store.migrate()
    env = {"POST_RUN_BROKER": amqp_url, "POST_RUN_BACKEND": backend, "POST_RUN_STORE": postgres_url,
           "POST_RUN_PREFIX": prefix, "POST_RUN_QUEUE": queue, "POST_RUN_IN_WORKER": "1"}
    for name, value in env.items():
        if name != "POST_RUN_IN_WORKER":
            monkeypatch.setenv(name, value)
    import importlib

    from tests.apps import post_run_app
    app_module = importlib.reload(post_run_app)  # the test's twin of the workers' app, for publishing
    yield env, app_module, store, client
    with kombu.Connection(amqp_url) as conn:
        kombu.Queue(queue, channel=conn.default_channel).delete()
    store.drop_schema()
    store.engine.dispose()
    app_module.app.close()
    client.flushdb()
    client.close()


@pytest.mark.parametrize("kill_at", ["before_result", "before_next_step"])
def test_a_chain_finishes_with_each_body_run_once_when_its_worker_dies_after_the_completion(
        scene, tmp_path, kill_at):
    env, mod, store, reports = scene
    env = {**env, "POST_RUN_KILL_AT": kill_at}
    with celery_processes(tmp_path) as procs:
        procs.append(worker("tests.apps.post_run_app", env, tmp_path, name="dies"))
        result = (mod.first.s(4) | mod.second.s()).apply_async()
        first_id, second_id = result.parent.id, result.id
        wait_for(lambda: reports.get(f"killed:{kill_at}") is not None, timeout=60,
                 message=f"the worker never reached {kill_at}")
        wait_for(lambda: procs[0].popen.poll() is not None, timeout=10, message="the worker survived")
        assert store.get(first_id).status == "completed"
        assert mod.app.AsyncResult(first_id).state == "PENDING"  # its result was never stored
        procs.append(worker("tests.apps.post_run_app", env, tmp_path, name="heir"))
        assert result.get(timeout=60) == 41
        # The heir's delivery came within a lease of the completion: it was sent again for then
        # (the owner might still have been storing the result), and stores it when it returns.
        assert mod.app.AsyncResult(first_id).get(timeout=30) == 40
    assert reports.llen(f"runs:{first_id}") == 1 and reports.llen(f"runs:{second_id}") == 1
    first_events = [e["event"] for e in store.reports.events(first_id)]
    # One claim, the first (the row's): a second one would be a re-claim, written as an event.
    assert first_events.count("post_run_resumed") == 1 and first_events.count("claimed") == 0, first_events
    first_row = store.get(first_id)
    assert first_row.attempt_count == 1 and first_row.started_at <= first_row.completed_at
    timeline = [e["event"] for e in job_timeline(first_row, store.reports.events(first_id))]
    assert timeline.count("claimed") == 1 and timeline.count("completed") == 1, timeline
    assert store.get(second_id).status == "completed"
