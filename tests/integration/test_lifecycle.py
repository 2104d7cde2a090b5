"""The run lifecycle's settle step under real faults: a store cut mid-body, a result backend that
refuses, a row that vanishes. Real in-process worker, Redis broker and backend, PostgreSQL store
reached through a proxy the test cuts."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from celery import Celery, states
from celery.backends.redis import RedisBackend
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject

from celery_lease import LeaseTask
from celery_lease.store import Store
from celery_lease.worker import runtime
from tests.conftest import flushed_redis, unique_prefix
from tests.helpers import EMPTY_POLL, wait_for
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

REDIS_DB = 5


class StartedRefusedOnce(RedisBackend):
    """A real Redis result backend that refuses the first STARTED write it is asked for."""

    refused = 0

    def store_result(self, task_id, result, state, *args, **kwargs):
        if state == states.STARTED and not StartedRefusedOnce.refused:
            StartedRefusedOnce.refused += 1
            raise ConnectionError("result backend refused the STARTED write")
        return super().store_result(task_id, result, state, *args, **kwargs)


@pytest.fixture
def broker(redis_url):
    with flushed_redis(redis_url, REDIS_DB) as (url, client):
        yield url, client


@pytest.fixture
def proxied(postgres_url):
    """The PostgreSQL store's URL through a proxy the test can cut and start again."""
    pg = urlsplit(postgres_url)
    proxy = TcpProxy(pg.hostname, pg.port or 5432).start()
    try:
        yield urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}")), proxy
    finally:
        proxy.cut()


def make_app(broker_url: str, store_url: str, backend: str | None = None, **conf) -> Celery:
    app = Celery(f"lifecycle_{unique_prefix()}", broker=broker_url, backend=backend or broker_url,
                 set_as_current=False)
    app.conf.update({
        "lease_store_url": store_url, "lease_table_prefix": unique_prefix(), "lease_duration": 8.0,
        "lease_heartbeat_interval": 0.3, "lease_grace_period": 1.0, "lease_store_retry_delay": 0.3,
        "worker_hijack_root_logger": False, "result_expires": None,
        "broker_transport_options": {"visibility_timeout": 3600, "polling_interval": EMPTY_POLL}, **conf,
    })
    return app


@pytest.fixture
def app_on(broker, proxied, postgres_url):
    """An app whose store is reached through the proxy; its tables made directly (not proxied)."""
    made: list[Celery] = []

    def make(**conf) -> Celery:
        app = make_app(broker[0], proxied[0], **conf)
        Store(postgres_url, prefix=app.conf.lease_table_prefix).migrate()
        made.append(app)
        return app

    yield make
    for app in made:
        store = Store(postgres_url, prefix=app.conf.lease_table_prefix)
        try:
            store.drop_schema()
        finally:
            store.engine.dispose()


def direct(postgres_url: str, app: Celery) -> Store:
    """The app's store on a path of its own, for the test's reads while the proxy is cut."""
    return Store(postgres_url, prefix=app.conf.lease_table_prefix)


def runs(client, job_id: str) -> int:
    return int(client.get(f"runs:{job_id}") or 0)


def wait_flag(client, name: str) -> None:
    wait_for(lambda: client.get(name), timeout=20, message=f"test never set {name}")


#: What the worker logs when a store call meets the cut store and is kept, waited for or deferred.
OUTAGE_SEEN = {"checkpoint_deferred", "store_waited", "settle_deferred", "retry_deferred"}


@pytest.fixture
def outage(caplog):
    """``outage(client, proxy, job_id)``: cut the store once the body is ready, let it go on into
    the outage, and restore the store once the worker logged that a call met it."""
    caplog.set_level(logging.INFO, logger="celery_lease")

    def run(client, proxy: TcpProxy, job_id: str) -> None:
        wait_flag(client, f"ready:{job_id}")
        proxy.cut()
        client.set(f"cut:{job_id}", 1)
        wait_for(lambda: OUTAGE_SEEN & {getattr(r, "action", None) for r in caplog.records}, timeout=20,
                 message="the body's store call never met the outage")
        proxy.start()

    return run


def status(store: Store, job_id: str) -> str | None:
    job = store.get(job_id)
    return job.status if job is not None else None


def body_steps(task, client, job_id: str) -> None:
    """What each test body does first: count the run, say it is ready, wait for the cut."""
    client.incr(f"runs:{job_id}")
    client.set(f"ready:{job_id}", 1)
    wait_flag(client, f"cut:{job_id}")


def test_a_started_write_the_backend_refuses_leaks_no_lease_and_the_job_completes(broker, postgres_url):
    StartedRefusedOnce.refused = 0
    backend = f"{StartedRefusedOnce.__module__}:StartedRefusedOnce+{broker[0]}"
    app = make_app(broker[0], postgres_url, backend=backend, task_track_started=True)
    store = Store(postgres_url, prefix=app.conf.lease_table_prefix)
    store.migrate()
    client = broker[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.tracked")
    def tracked(self):
        client.incr(f"runs:{self.request.id}")
        return "done"

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = tracked.delay()
            assert result.get(timeout=20) == "done"
            job = store.get(result.id)
            assert StartedRefusedOnce.refused == 1
            assert (job.status, job.lock_token) == ("completed", None)
            rt = runtime.current(app)
            wait_for(lambda: rt is None or not rt.leases(), timeout=5, message="a lease stayed held")
        assert runs(client, result.id) == 1
    finally:
        store.drop_schema()
        store.engine.dispose()


def test_a_checkpoint_during_a_store_outage_neither_fails_nor_reruns_the_job(app_on, broker, proxied, outage,
                                                                            postgres_url):
    app, client, proxy = app_on(), broker[1], proxied[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.steps")
    def steps(self):
        body_steps(self, client, self.request.id)
        self.lease.checkpoint({"step": 1})  # the store is cut now
        return "done"

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = steps.delay()
        outage(client, proxy, result.id)
        assert result.get(timeout=30) == "done"
        store = direct(postgres_url, app)
        wait_for(lambda: status(store, result.id) == "completed", timeout=20, message="job never completed")
    assert result.state == states.SUCCESS and runs(client, result.id) == 1
    assert "failed" not in [e["event"] for e in store.reports.events(result.id)]


def test_an_effect_during_a_store_outage_waits_for_the_store_and_happens_once(app_on, broker, proxied, outage,
                                                                              postgres_url):
    app, client, proxy = app_on(), broker[1], proxied[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.effect")
    def charge(self):
        body_steps(self, client, self.request.id)
        with self.lease.effect(f"charge:{self.request.id}") as first:
            if first:
                client.incr(f"charged:{self.request.id}")
        return "charged"

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = charge.delay()
        outage(client, proxy, result.id)
        assert result.get(timeout=30) == "charged"
        store = direct(postgres_url, app)
        wait_for(lambda: status(store, result.id) == "completed", timeout=20, message="job never completed")
    assert int(client.get(f"charged:{result.id}")) == 1 and runs(client, result.id) == 1


@pytest.mark.parametrize("ending", ["ignore", "reject"])
def test_ignore_or_reject_while_the_store_is_down_is_written_once_it_answers(app_on, broker, proxied, outage,
                                                                             postgres_url, ending):
    app, client, proxy = app_on(), broker[1], proxied[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.ends")
    def ends(self):
        body_steps(self, client, self.request.id)
        if ending == "ignore":
            raise Ignore()
        raise Reject("not for us", requeue=False)

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = ends.delay()
        outage(client, proxy, result.id)
        store = direct(postgres_url, app)
        final = "completed" if ending == "ignore" else "failed"
        wait_for(lambda: status(store, result.id) == final, timeout=20, message=f"job never became {final}")
    # What plain Celery stores for the same end: nothing for Ignore, FAILURE with the Reject itself
    # for a Reject without requeue; never the outage.
    if ending == "ignore":
        assert result.state == states.PENDING
    else:
        assert result.state == states.FAILURE and type(result.result).__name__ == "Reject"
    assert runs(client, result.id) == 1


def test_a_retry_while_the_store_is_down_runs_the_job_once_more_after_it_answers(app_on, broker, proxied,
                                                                                  outage, postgres_url):
    app, client, proxy = app_on(), broker[1], proxied[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.retried", max_retries=3)
    def retried(self):
        if runs(client, self.request.id) == 0:
            body_steps(self, client, self.request.id)
            raise self.retry(countdown=0)
        client.incr(f"runs:{self.request.id}")
        return "second"

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = retried.delay()
        outage(client, proxy, result.id)
        assert result.get(timeout=30) == "second"
        store = direct(postgres_url, app)
        wait_for(lambda: status(store, result.id) == "completed", timeout=20, message="job never completed")
    assert runs(client, result.id) == 2


def test_a_publish_that_meets_the_outage_gives_the_job_back_and_it_runs_again(app_on, broker, proxied, outage,
                                                                               postgres_url):
    app, client, proxy = app_on(), broker[1], proxied[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.child")
    def child(self):
        return "child"

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.parent")
    def parent(self):
        if runs(client, self.request.id) == 0:
            body_steps(self, client, self.request.id)
        else:
            client.incr(f"runs:{self.request.id}")
        child.delay()
        return "parent"

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = parent.delay()
        outage(client, proxy, result.id)
        assert result.get(timeout=30) == "parent"
        store = direct(postgres_url, app)
        wait_for(lambda: status(store, result.id) == "completed", timeout=20, message="job never completed")
        job = store.get(result.id)
    assert runs(client, result.id) == 2 and job.attempt_count == 1  # the outage charged no attempt
    assert "released_after_outage" in [e["event"] for e in store.reports.events(result.id)]


def test_a_job_whose_row_vanishes_mid_body_is_recorded_again_and_completes_once(broker, postgres_url):
    app = make_app(broker[0], postgres_url, lease_duration=2.0, lease_heartbeat_interval=0.2)
    store = Store(postgres_url, prefix=app.conf.lease_table_prefix)
    store.migrate()
    client = broker[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.vanishing")
    def vanishing(self):
        run = client.incr(f"runs:{self.request.id}")
        client.set(f"ready:{self.request.id}", 1)
        wait_flag(client, f"deleted:{self.request.id}")
        self.lease.checkpoint({"step": 1})  # a fenced write that finds no row
        self.lease.check()
        return f"run {run}"

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = vanishing.delay()
            wait_flag(client, f"ready:{result.id}")
            with store.begin() as c:  # a restore from a backup that predates the job
                c.execute(sa.delete(store.t.events).where(store.t.events.c.job_id == result.id))
                c.execute(sa.delete(store.t.jobs).where(store.t.jobs.c.id == result.id))
            client.set(f"deleted:{result.id}", 1)
            assert result.get(timeout=30) == "run 1"
            wait_for(lambda: status(store, result.id) == "completed", timeout=20,
                     message="the job was not recorded again and completed")
        assert runs(client, result.id) == 1
    finally:
        store.drop_schema()
        store.engine.dispose()


def test_a_completion_the_store_refuses_fails_the_job_instead_of_running_its_body_again(broker, postgres_url):
    app = make_app(broker[0], postgres_url, lease_duration=2.0, lease_heartbeat_interval=0.2)
    store = Store(postgres_url, prefix=app.conf.lease_table_prefix)
    store.migrate()
    client = broker[1]
    jobs = store.t.jobs.name
    with store.begin() as c:  # a real refusal: PostgreSQL's check constraint turns the completion down
        c.execute(sa.text(f"ALTER TABLE {jobs} ADD CONSTRAINT {jobs}_refuses CHECK (status <> 'completed')"))

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.refused")
    def refused(self):
        return f"run {client.incr(f'runs:{self.request.id}')}"

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = refused.delay()
            assert result.get(timeout=30) == "run 1"  # Celery sees what the body returned
            wait_for(lambda: status(store, result.id) == "failed", timeout=20,
                     message="a refused completion left the job running, for the reaper to run again")
            assert "the store refused" in (store.get(result.id).last_error or "")
        assert runs(client, result.id) == 1
    finally:
        store.drop_schema()
        store.engine.dispose()
