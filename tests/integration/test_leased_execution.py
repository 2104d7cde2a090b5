"""LeaseTask under a real in-process worker, real Redis broker and a real PostgreSQL store."""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_lease import LeaseTask
from celery_lease.config import app_config
from celery_lease.errors import StoreUnavailable
from celery_lease.messaging import messages
from celery_lease.store import ClaimTerms, Store, for_app
from tests.conftest import drop_app_store, flushed_redis, migrated_store, unique_prefix
from tests.helpers import EMPTY_POLL, text_result_column, wait_for
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

REDIS_DB = 4


@pytest.fixture
def broker(redis_url):
    with flushed_redis(redis_url, REDIS_DB) as (url, client):
        yield url, client


def make_app(broker_url: str, store_url: str, **conf) -> Celery:
    app = Celery(f"leased_{unique_prefix()}", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update({
        "lease_store_url": store_url, "lease_table_prefix": unique_prefix(), "lease_duration": 1.5,
        "lease_heartbeat_interval": 0.2, "lease_grace_period": 0.5, "worker_hijack_root_logger": False,
        "broker_transport_options": {"visibility_timeout": 3600, "polling_interval": EMPTY_POLL},
        "result_expires": None, **conf,
    })
    return app


@pytest.fixture
def app(broker, postgres_url):
    app = make_app(broker[0], postgres_url)
    migrated_store(app)
    yield app
    drop_app_store(app)


def register(app: Celery, redis_client: redis.Redis):
    """The tasks these tests run; each body INCRs a Redis counter per job to count executions."""

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.add")
    def add(self, x, y):
        redis_client.incr(f"runs:{self.request.id}")
        return {"sum": x + y, "attempt": self.lease.attempt, "token": self.lease.token}

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.slow")
    def slow(self, seconds):
        redis_client.incr(f"runs:{self.request.id}")
        deadline = time.monotonic() + seconds
        pause = threading.Event()
        while time.monotonic() < deadline:
            pause.wait(0.05)
            self.lease.check()
        return "done"

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.wait_for_theft", lease_on_lost="flag")
    def wait_for_theft(self, check):
        redis_client.incr(f"runs:{self.request.id}")
        redis_client.set(f"token:{self.request.id}", self.lease.token)
        wait_for(lambda: redis_client.get(f"stolen:{self.request.id}"), timeout=10,
                 message="test never stole the lease")
        wait_for(lambda: self.lease.lost, timeout=5, message="heartbeat never saw the theft")
        if check:
            self.lease.check()
        return "finished anyway"

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.flaky", max_retries=3)
    def flaky(self):
        runs = redis_client.incr(f"runs:{self.request.id}")
        if runs == 1:
            raise self.retry(countdown=0.5)
        return self.lease.attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.auto", autoretry_for=(KeyError,),
              retry_backoff=False, default_retry_delay=0.2, max_retries=2)
    def auto(self):
        runs = redis_client.incr(f"runs:{self.request.id}")
        if runs < 3:
            raise KeyError("not yet")
        return runs

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.boom")
    def boom(self):
        redis_client.incr(f"runs:{self.request.id}")
        raise ValueError("boom")

    return add, slow, wait_for_theft, flaky, auto, boom


def observer(app: Celery) -> Store:
    """The test's own view of the app's store, with the default call bound: the app's bound is a
    third of its 1.5 s lease, which a busy machine's reads can outlast."""
    return Store(app.conf.lease_store_url, app.conf.lease_table_prefix)


def runs(client: redis.Redis, job_id: str) -> int:
    return int(client.get(f"runs:{job_id}") or 0)


def event_names(store, job_id):
    return [e["event"] for e in store.reports.events(job_id)]


def test_a_task_runs_under_a_lease_and_completes(app, broker):
    add, *_ = register(app, broker[1])
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = add.delay(2, 3).get(timeout=15)
    store = observer(app)
    assert result["sum"] == 5 and result["attempt"] == 1
    with store.begin() as c:
        jobs = c.execute(sa.select(store.t.jobs)).all()
    assert [(j.status, j.attempt_count, j.lock_token) for j in jobs] == [("completed", 1, None)]
    # The first claim and the completion are the row's (started_at, locked_by, completed_at).
    assert event_names(store, jobs[0].id) == ["published"]
    assert jobs[0].locked_by and jobs[0].started_at <= jobs[0].completed_at


def test_a_second_delivery_of_the_same_message_is_skipped(app, broker):
    add, *_ = register(app, broker[1])
    first = add.apply_async((1, 1))
    add.apply_async((1, 1), task_id=first.id)  # the same job delivered twice
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert first.get(timeout=15)["sum"] == 2
        store = observer(app)
        wait_for(lambda: "duplicate_delivery_skipped" in event_names(store, first.id), timeout=10,
                 message="the second delivery was not skipped")
    assert runs(broker[1], first.id) == 1
    assert first.state == "SUCCESS"  # the skip wrote no state over the real run's result


def test_a_copy_delivered_before_the_job_is_available_runs_it_no_sooner(app, broker):
    add, *_ = register(app, broker[1])
    result = add.apply_async((4, 5), countdown=3.0)
    with messages.publishing_unrecorded():
        add.apply_async((4, 5), task_id=result.id)  # a stray copy without the countdown
    store = observer(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert result.get(timeout=20)["sum"] == 9
        # Three deliveries: the early copy (sent again for later), the original, the copy again.
        wait_for(lambda: "duplicate_delivery_skipped" in event_names(store, result.id), timeout=10,
                 message="the third delivery was not skipped")
    assert runs(broker[1], result.id) == 1
    log = store.reports.events(result.id)
    assert [e["event"] for e in log[:2]] == ["published", "early_delivery_deferred"]
    assert "claimed" not in [e["event"] for e in log]  # one claim, the first: the row's
    tolerance = app_config(app).clock_tolerance
    job = store.get(result.id)
    assert job.attempt_count == 1 and job.started_at >= job.available_at - tolerance
    assert job.started_at >= log[1]["at"]


def test_a_job_five_times_longer_than_its_lease_runs_once_and_is_never_claimable(app, broker):
    _, slow, *_ = register(app, broker[1])
    store = observer(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = slow.delay(7.5)  # lease 1.5 s
        wait_for(lambda: (store.get(result.id) or None) and store.get(result.id).status == "running",
                 timeout=10, message="job never started")
        outcomes: list[str] = []
        # Another app's store, quick to take over: past a 0.5 s hard grace even from a live owner.
        intruder = Store(store.url, store.prefix, hard_grace=0.5, stale_after=1.0)

        def intrude() -> bool:
            terms = ClaimTerms(duration=1.0, grace=0.0, max_attempts=5, max_expirations=5, takeover=True)
            claim = intruder.jobs.claim(result.id, "intruder:1", "intruder-token", terms, task_name="t.slow",
                                        queue="celery", payload=lambda: None)
            outcomes.append(claim.outcome)
            return result.ready()

        wait_for(intrude, timeout=30, interval=0.2, message="slow job never finished")
        assert result.get(timeout=5) == "done"
    # Busy for the whole run (at least 30 probes over 7.5 s), then done; never claimed.
    assert outcomes.count("busy") >= 20 and set(outcomes) <= {"busy", "done"}
    assert runs(broker[1], result.id) == 1
    job = store.get(result.id)
    assert job.status == "completed" and job.attempt_count == 1 and job.expired_count == 0


def steal(store, job_id):
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(lock_token="thief-token", locked_by="thief:1"))


@pytest.mark.parametrize("check", [True, False], ids=["check-raises", "completion-rejected"])
def test_a_worker_whose_lease_was_stolen_stops_and_cannot_complete(app, broker, check):
    *_, wait_for_theft, _, _, _ = register(app, broker[1])
    store = observer(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = wait_for_theft.delay(check)
        wait_for(lambda: broker[1].get(f"token:{result.id}"), timeout=10, message="task never started")
        steal(store, result.id)
        broker[1].set(f"stolen:{result.id}", 1)
        expected = "lease_lost" if check else "stale_completion_rejected"
        wait_for(lambda: expected in event_names(store, result.id), timeout=10,
                 message=f"no {expected} event")
    job = store.get(result.id)
    assert job.status == "running" and job.lock_token == "thief-token"  # the thief's row is untouched
    assert result.state != "SUCCESS"  # the stale worker stored no result
    if not check:
        lost = [e for e in store.reports.events(result.id) if e["event"] == "lease_lost"]
        assert lost and lost[0]["reason"] == "taken_over"


def test_celery_retry_reschedules_the_job_and_it_runs_again(app, broker):
    *_, flaky, auto, _ = register(app, broker[1])
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert flaky.delay().get(timeout=15) == 2
        assert auto.delay().get(timeout=15) == 3
    store = observer(app)
    with store.begin() as c:
        rows = c.execute(sa.select(store.t.jobs.c.task_name, store.t.jobs.c.status,
                                   store.t.jobs.c.attempt_count)).all()
    assert sorted(rows) == [("t.auto", "completed", 3), ("t.flaky", "completed", 2)]
    assert store.reports.event_counts(["retry_scheduled"])["retry_scheduled"] == 3


def test_a_final_failure_marks_the_job_failed_and_celery_sees_the_exception(app, broker):
    *_, boom = register(app, broker[1])
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = boom.delay()
        with pytest.raises(ValueError, match="boom"):
            result.get(timeout=15)
    job = observer(app).get(result.id)
    assert job.status == "failed" and job.last_error == "ValueError: boom"


def test_a_failure_the_store_cannot_take_yet_is_written_later_and_celery_sees_it(app, broker, postgres_url):
    """The failure write meets the job's row locked past the store's lock wait: the worker keeps
    the lease, Celery gets the body's own exception, and the job is failed once the lock is gone."""
    client = broker[1]

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.fails_when_told")
    def fails_when_told(self):
        client.set(f"failing:{self.request.id}", 1)
        wait_for(lambda: client.get(f"go:{self.request.id}"), timeout=15, message="test never said go")
        raise ValueError("late boom")

    store = observer(app)
    other = sa.create_engine(postgres_url)  # a connection of its own, not one of the worker's pool
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = fails_when_told.delay()
        wait_for(lambda: client.get(f"failing:{result.id}"), timeout=15, message="the body never started")
        with other.connect() as c, c.begin():  # as a long transaction elsewhere would
            c.execute(sa.select(store.t.jobs.c.id).where(store.t.jobs.c.id == result.id).with_for_update())
            client.set(f"go:{result.id}", 1)
            with pytest.raises(ValueError, match="late boom"):
                result.get(timeout=15)
            assert store.get(result.id).status == "running"  # not written while the row is locked
        wait_for(lambda: store.get(result.id).status == "failed", timeout=10,
                 message="the deferred failure never landed")
    other.dispose()
    job = store.get(result.id)
    assert job.last_error == "ValueError: late boom"
    assert [e["event"] for e in store.reports.events(result.id)][-1] == "failed"


def test_the_body_does_not_run_while_the_store_is_unreachable(broker, postgres_url, caplog):
    pg = urlsplit(postgres_url)
    proxy = TcpProxy(pg.hostname, pg.port or 5432).start()
    url = urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}"))
    app = make_app(broker[0], url, lease_store_retry_delay=0.3)
    add, *_ = register(app, broker[1])
    caplog.set_level(logging.WARNING, logger="celery_lease.worker.deliveries")
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            result = add.apply_async((20, 22), countdown=1.0)
            proxy.cut()
            wait_for(lambda: [r for r in caplog.records if getattr(r, "action", "") == "fail_closed"],
                     timeout=15, message="worker never failed closed")
            assert runs(broker[1], result.id) == 0
            proxy.start()
            assert result.get(timeout=20)["sum"] == 42
        assert runs(broker[1], result.id) == 1
    finally:
        proxy.cut()
        store = for_app(app, check=False)
        store.engine.dispose()
        direct = sa.create_engine(postgres_url)
        store.t.metadata.drop_all(direct)
        direct.dispose()


def test_eager_mode_runs_the_body_with_a_local_lease_and_records_nothing(broker, postgres_url):
    app = make_app(broker[0], postgres_url, task_always_eager=True)

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.eager")
    def eager(self, x):
        return (x * 2, type(self.lease).__name__)

    assert eager.delay(21).get() == (42, "LocalLease")
    engine = sa.create_engine(postgres_url)
    try:
        assert not sa.inspect(engine).has_table(f"{app.conf.lease_table_prefix}jobs")
    finally:
        engine.dispose()


def test_concurrent_publishers_of_one_key_make_one_job(app, broker):
    add, *_ = register(app, broker[1])
    barrier = threading.Barrier(8)
    ids: list[str | Exception] = []

    def publish() -> None:
        barrier.wait()
        try:
            ids.append(add.apply_async((1, 2), idempotency_key="order-42:invoice").id)
        except Exception as exc:  # noqa: BLE001 - the assertion below shows every outcome
            ids.append(exc)

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # A loser whose wait on the winner's key outlasts its store call bound (a third of the 1.5 s lease, on
    # a loaded machine) fails closed and sends nothing.
    published = [i for i in ids if isinstance(i, str)]
    assert published and all(isinstance(i, StoreUnavailable) for i in ids if not isinstance(i, str)), ids
    assert len(set(published)) == 1
    assert broker[1].llen("celery") == 1


def test_a_result_the_store_cannot_keep_is_not_kept_and_the_job_still_completes(broker, mysql_url):
    """A MySQL/MariaDB result column of TEXT (64 KB, as before revision 0007) refuses a 70 KB return
    value: the completion is written without it (the kept result only serves a crash's post-run work), never
    deferred and retried at every beat, and Celery stores the result as plain Celery does."""
    from celery_lease.worker import runtime

    app = make_app(broker[0], mysql_url, result_extended=True)
    store = for_app(app, check=False)
    text_result_column(store)

    @app.task(base=LeaseTask, bind=True, shared=False, name="t.big_result")
    def big_result(self):
        return "r" * 70_000

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = big_result.delay()
            assert result.get(timeout=15) == "r" * 70_000
            deferred = [held for rt in runtime.in_process() for held in rt.leases() if rt.is_deferred(held)]
            assert deferred == []
            job = store.get(result.id)
            assert (job.status, store.jobs.kept_result(result.id)) == ("completed", None)
    finally:
        drop_app_store(app)
