"""A LeaseTask behaves like a Celery Task: canvas, results, revoke, time limits, pools."""

from __future__ import annotations

import contextlib
import datetime
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import chain, chord, group
from celery.contrib.testing.worker import start_worker

from celery_lease import LeaseTask
from celery_lease.messaging import messages
from celery_lease.store import for_app
from celery_lease.vocabulary import Event
from tests.conftest import drop_app_store, flushed_redis, migrated_store
from tests.helpers import wait_for
from tests.integration.test_leased_execution import make_app

pytestmark = pytest.mark.integration

try:
    import pydantic
except ImportError:  # pragma: no cover - pydantic=True tasks need it
    pydantic = None
else:

    class Item(pydantic.BaseModel):
        """A model argument of a pydantic=True task (module level: its annotation must resolve)."""

        n: int

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

    @app.task(base=LeaseTask, bind=True, shared=False, name="d.boom", track_started=True)
    def boom(self):
        raise ValueError("boom")

    @app.task(base=LeaseTask, bind=True, shared=False, name="d.tracked", track_started=True)
    def tracked(self):
        return app.AsyncResult(self.request.id).state

    @app.task(base=LeaseTask, bind=True, shared=False, name="d.held")
    def held(self):
        client.incr(f"runs:{self.request.id}")
        wait_for(lambda: client.get(f"go:{self.request.id}"), timeout=20, message="test never let go")
        return "done"

    @app.task(base=LeaseTask, bind=True, shared=False, name="d.flaky")
    def flaky(self, times):
        runs = client.incr(f"runs:{self.request.id}")
        if self.request.retries < times:
            retry = self.retry(countdown=0, throw=False)
            # Hold the attempt open until the retry's message was consumed (or 3 s): its delivery
            # must find the job claimable, not busy, while the attempt is still finishing.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: int(client.get(f"runs:{self.request.id}")) > runs, timeout=3)
            raise retry
        return self.request.retries

    migrated_store(app)

    yield app
    drop_app_store(app)
    client.flushdb()
    client.close()


def statuses(app):
    store = for_app(app)
    with store.begin(read=True) as c:
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



def event_count(app, name):
    return sum(1 for _ in for_app(app).reports.events(event=name, limit=100_000))


def test_retries_with_countdown_zero_are_claimed_at_once_under_load(app):
    flaky = app.tasks["d.flaky"]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results = [flaky.delay(3) for _ in range(20)]
        # Well inside lease_dispatch_timeout: no retry waits for the dispatch scan.
        assert [r.get(timeout=30) for r in results] == [3] * 20
    assert event_count(app, Event.RETRY_SCHEDULED) == 60
    assert event_count(app, Event.DUPLICATE_DELIVERY_SKIPPED) == 0
    assert statuses(app) == ["completed"] * 20


def test_a_duplicate_of_a_dead_letter_does_not_turn_its_state_to_started(app):
    boom, tracked = app.tasks["d.boom"], app.tasks["d.tracked"]
    store = for_app(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert tracked.delay().get(timeout=20) == "STARTED"  # task_track_started still works
        result = boom.delay()
        with pytest.raises(ValueError):
            result.get(timeout=20)
        messages.republish(app, result.id, store.get(result.id).payload)
        wait_for(lambda: event_count(app, Event.DUPLICATE_DELIVERY_SKIPPED) == 1, timeout=15,
                 message="the duplicate was never delivered")
    assert app.AsyncResult(result.id).state == "FAILURE"


def test_a_late_expired_duplicate_of_a_running_job_leaves_the_live_run_alone(app, redis_url):
    held = app.tasks["d.held"]
    store = for_app(app)
    client = redis.Redis.from_url(urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}")))
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = held.delay()
        wait_for(lambda: store.get(result.id).status == "running", timeout=15, message="never claimed")
        with messages.publishing_unrecorded():
            held.apply_async(task_id=result.id, expires=-1)
        wait_for(lambda: result.state == "REVOKED", timeout=15, message="the expired copy was not discarded")
        assert store.get(result.id).status == "running"
        client.set(f"go:{result.id}", 1)
        wait_for(lambda: store.get(result.id).status == "completed", timeout=15, message="live run lost")
    assert int(client.get(f"runs:{result.id}")) == 1
    assert Event.REVOKED not in [e["event"] for e in store.reports.events(result.id)]
    client.close()


def test_celery_builtins_are_never_leased_and_map_items_share_one_lease(redis_url, postgres_url):
    with flushed_redis(redis_url, REDIS_DB) as (url, _):
        app = make_app(url, postgres_url)
        app.task_cls = LeaseTask

        @app.task(bind=True, shared=False, name="d.lease_of")
        def lease_of(self, x):
            return [x, self.lease.job_id if self.lease else None]

        @app.task(bind=True, shared=False, name="d.by_group")
        def by_group(self, n):
            return self.replace(group(lease_of.s(i) for i in range(n)))

        store = migrated_store(app)
        try:
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
                mapped = lease_of.map([1, 2]).delay()
                assert mapped.get(timeout=20) == [[1, mapped.id], [2, mapped.id]]
                replaced = by_group.delay(2)
                assert [x for x, _ in replaced.get(timeout=20)] == [0, 1]
            with store.begin(read=True) as c:
                names = sorted(r[0] for r in c.execute(
                    store.t.jobs.select().with_only_columns(store.t.jobs.c.task_name)))
            assert names == ["celery.map", "d.by_group", "d.lease_of", "d.lease_of"]
        finally:
            drop_app_store(app)


def test_pydantic_arguments_and_string_etas_publish_as_with_celery(app):
    if pydantic is None:
        pytest.skip("pydantic is not installed")

    @app.task(base=LeaseTask, shared=False, name="d.double", pydantic=True)
    def double(item: Item) -> Item:
        return Item(n=item.n * 2)

    add = app.tasks["d.add"]
    eta = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=1)).isoformat()
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert double.delay(Item(n=2)).get(timeout=20) == {"n": 4}
        assert add.apply_async((1, 2), eta=eta).get(timeout=20) == 3
    assert statuses(app) == ["completed"] * 2


def counting_task(app, client):
    @app.task(base=LeaseTask, bind=True, shared=False, name="d.counted")
    def counted(self):
        return client.incr(f"runs:{self.request.id}")

    return counted


def test_a_frozen_signature_applied_again_runs_again_as_with_celery(app, redis_url):
    client = redis.Redis.from_url(urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}")))
    sig = counting_task(app, client).s()
    job_id = sig.freeze().id
    store = for_app(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert sig.apply_async().get(timeout=20) == 1
        sig.apply_async()  # a new publish of a finished job's id: Celery runs it again
        wait_for(lambda: int(client.get(f"runs:{job_id}") or 0) == 2
                 and store.get(job_id).status == "completed",
                 timeout=20, message="the re-applied signature did not run again")
        messages.republish(app, job_id, store.get(job_id).payload)  # a redelivery stays a duplicate
        wait_for(lambda: event_count(app, Event.DUPLICATE_DELIVERY_SKIPPED) == 1, timeout=15,
                 message="the redelivered copy was never delivered")
    assert int(client.get(f"runs:{job_id}")) == 2
    assert [e["event"] for e in store.reports.events(job_id)].count("republished") == 1
    client.close()


def test_finishing_an_interrupted_post_run_does_not_run_the_next_step_again(app, redis_url):
    client = redis.Redis.from_url(urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}")))
    counted = counting_task(app, client)
    store = for_app(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = chain(counted.si(), counted.si()).apply_async()
        assert result.get(timeout=20) == 1
        first, second = result.parent.id, result.id
        app.backend.forget(first)  # as if the worker died before Celery stored the first result
        messages.republish(app, first, store.get(first).payload)
        wait_for(lambda: app.AsyncResult(first).state == "SUCCESS", timeout=20,
                 message="the interrupted post-run work was not finished")
        # The chain's next step is sent again under its frozen id: a duplicate, not a new run.
        wait_for(lambda: event_count(app, Event.DUPLICATE_DELIVERY_SKIPPED) == 1, timeout=15,
                 message="the next step's second copy was never delivered")
    assert [int(client.get(f"runs:{job}")) for job in (first, second)] == [1, 1]
    assert event_count(app, Event.POST_RUN_RESUMED) == 1
    assert event_count(app, Event.REPUBLISHED) == 0
    client.close()
