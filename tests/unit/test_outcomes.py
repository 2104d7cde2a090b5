"""A job the reaper dead-letters reaches Celery once: FAILURE, errbacks and task_failure."""

from __future__ import annotations

import json
import secrets

import pytest
import sqlalchemy as sa
from celery import Celery, signals

from celery_lease import LeaseTask
from celery_lease.errors import JobDeadLettered
from celery_lease.messaging import messages
from celery_lease.reaper.run import Reaper
from celery_lease.store import ClaimTerms
from tests.conftest import drop_app_store, flushed_redis, migrated_store, unique_prefix

REDIS_DB = 15


@pytest.fixture
def app(redis_url, tmp_path):
    with flushed_redis(redis_url, REDIS_DB) as (url, client):
        app = Celery(f"outcomes_{unique_prefix()}", broker=url, backend=url, set_as_current=False)
        app.conf.update(lease_store_url=f"sqlite:///{tmp_path}/store.db", lease_table_prefix=unique_prefix(),
                        lease_duration=30.0, lease_grace_period=1.0, lease_worker_stale_after=10.0,
                        task_default_queue="outcomes", result_expires=None)

        @app.task(base=LeaseTask, shared=False, name="o.work", lease_max_attempts=1)
        def work(x):
            return x

        @app.task(shared=False, name="o.on_error")
        def on_error(task_id):
            return task_id

        migrated_store(app)
        yield app, client
        drop_app_store(app)


def expired_job(app, job_id: str, options: dict) -> None:
    """A job recorded with ``options``, claimed once by a worker that is gone, its lease long expired."""
    store = migrated_store(app)
    store.publishes.record(job_id, "o.work", "outcomes", messages.encode("o.work", [1], {}, options), 1)
    terms = ClaimTerms(duration=30.0, grace=1.0, max_attempts=1, max_expirations=3, takeover=True)
    store.jobs.claim(job_id, "gone@host:1", secrets.token_hex(8), terms, task_name="o.work", queue="outcomes",
                     payload=lambda: None)
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lease_expires_at=store.now_sql - 60))


def queued_tasks(client, queue: str) -> list[str]:
    return [json.loads(raw)["headers"]["task"] for raw in client.lrange(queue, 0, -1)]


def test_a_dead_letter_made_by_the_reaper_stores_failure_and_fires_its_errback(app):
    app, client = app
    failures = []

    def on_failure(sender=None, task_id=None, exception=None, **_):
        failures.append((sender.name, task_id, type(exception)))

    signals.task_failure.connect(on_failure, weak=False)
    try:
        expired_job(app, "dead-1", {"link_error": app.tasks["o.on_error"].s()})
        result = Reaper(app).run_once()
    finally:
        signals.task_failure.disconnect(on_failure)
    assert result.dead_lettered == 1
    meta = app.AsyncResult("dead-1")
    assert meta.state == "FAILURE" and "dead-1 dead-lettered: lease expired" in str(meta.result)
    assert failures == [("o.work", "dead-1", JobDeadLettered)]
    assert queued_tasks(client, "outcomes") == ["o.on_error"]


def test_a_requeued_job_is_not_reported_as_failed(app):
    app, client = app
    app.tasks["o.work"].lease_max_attempts = 5
    store = migrated_store(app)
    expired_job(app, "again-1", {"link_error": app.tasks["o.on_error"].s()})
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "again-1").values(max_attempts=5))
    assert Reaper(app).run_once().reaped == 1
    assert app.AsyncResult("again-1").state == "PENDING"
    assert queued_tasks(client, "outcomes") == ["o.work"]
