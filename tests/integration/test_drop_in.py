"""A LeaseTask behaves like a Celery Task: canvas, results, revoke, time limits, pools."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import chain, chord, group
from celery.contrib.testing.worker import start_worker

from celery_lease import LeaseTask
from celery_lease.store import for_app
from tests.conftest import drop_app_store, migrated_store
from tests.helpers import wait_for
from tests.integration.test_leased_execution import make_app

pytestmark = pytest.mark.integration

REDIS_DB = 3


@pytest.fixture
def app(redis_url, postgres_url):
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    client = redis.Redis.from_url(url)
    client.flushdb()
    app = make_app(url, postgres_url)

    @app.task(base=LeaseTask, shared=False, name="d.add")
    def add(x, y):
        return x + y

    @app.task(base=LeaseTask, shared=False, name="d.total")
    def total(numbers):
        return sum(numbers)

    migrated_store(app)

    yield app
    drop_app_store(app)
    client.flushdb()
    client.close()


def statuses(app):
    store = for_app(app)
    with store.begin() as c:
        return sorted(r[0] for r in c.execute(store.t.jobs.select().with_only_columns(store.t.jobs.c.status)))


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_chain_group_and_chord_give_celery_results_under_leases(app, pool):
    add, total = app.tasks["d.add"], app.tasks["d.total"]
    with start_worker(app, pool=pool, concurrency=2, perform_ping_check=False):
        assert chain(add.s(1, 2), add.s(3), add.s(4)).delay().get(timeout=20) == 10
        assert group(add.s(i, i) for i in range(4)).delay().get(timeout=20) == [0, 2, 4, 6]
        assert chord((add.s(i, 1) for i in range(3)), total.s()).delay().get(timeout=20) == 6
    # chain 3 + group 4 + chord header 3 + body 1: every job leased once and completed
    assert statuses(app) == ["completed"] * 11


def test_a_revoked_job_never_runs_and_is_not_recovered(app):
    add = app.tasks["d.add"]
    store = for_app(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = add.apply_async((1, 1), countdown=1)
        result.revoke()
        wait_for(lambda: store.get(result.id).status == "failed", timeout=15,
                 message="revoked job was not closed")
    job = store.get(result.id)
    assert job.attempt_count == 0 and job.last_error.startswith("revoked")

