"""The reaper (celery_lease/reaper.py, store/reaping.py) on SQLite, PostgreSQL and MariaDB.

Messages go to a real Redis broker (db 12, never flushed: each test publishes to queues of its
own and deletes them), and the tests read them back from the queue. The worker tests of the
reaper flush db 7, so the two can run at the same time.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import uuid
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
from celery import Celery, Task

from celery_lease import LeaseTask
from celery_lease.app_state import app_state
from celery_lease.config import app_config
from celery_lease.errors import StoreUnavailable
from celery_lease.integration.signals import RERUN
from celery_lease.messaging import messages
from celery_lease.reaper import run as reaper
from celery_lease.reaper.clock_guard import Hold
from celery_lease.reaper.decisions import ReapDecision, ReapResult
from celery_lease.reaper.run import Reaper, backoff
from celery_lease.reaper.worker_lost import complete_worker_lost, recover_worker_lost
from celery_lease.store import COMPLETED, FAILED, PENDING, RUNNING, ClaimTerms, Store
from celery_lease.vocabulary import Decision, RunMode, WorkerLostOutcome
from tests.conftest import unique_prefix
from tests.helpers import poll, transaction_held, wait_for

REDIS_DB = 12
DEAD = "dead@host:1"
ALIVE = "alive@host:2"


class Broker(NamedTuple):
    url: str
    client: redis.Redis
    queue: str
    dlq: str


@pytest.fixture
def broker(redis_url):
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    client = redis.Redis.from_url(url)
    queue = f"reaper-{uuid.uuid4().hex[:8]}"
    yield Broker(url, client, queue, f"{queue}.dlq")
    for key in client.scan_iter(f"*{queue}*"):
        client.delete(key)
    client.close()


@pytest.fixture
def store(store):
    """The shared store with the app-wide settings of this module's app (hard grace 60 s,
    workers stale after 10 s), as the app's own store would have them."""
    store.hard_grace, store.stale_after = 60.0, 10.0
    return store


@pytest.fixture
def app(store, broker):
    app = Celery(f"reaper_{unique_prefix()}", broker=broker.url, set_as_current=False)
    app.conf.update(task_default_queue=broker.queue, lease_store_url=store.url,
                    lease_table_prefix=store.t.jobs.name[: -len("jobs")],
                    lease_duration=30.0, lease_grace_period=1.0, lease_reaper_hard_grace=60.0,
                    lease_worker_stale_after=10.0, lease_backoff_base=2.0, lease_backoff_max=10.0,
                    lease_reaper_lock_ttl=30.0)
    app_state(app).store = store

    @app.task(base=LeaseTask, shared=False, name="t.work")
    def work(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.once", lease_max_attempts=1,
              lease_dead_letter_queue=broker.dlq)
    def once(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.never_again", lease_on_expired="fail")
    def never_again(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.park", lease_on_expired="dead_letter")
    def park(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.fragile", lease_max_expirations=1)
    def fragile(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.patient", lease_backoff_base=100.0,
              lease_backoff_max=500.0, lease_backoff_jitter=False)
    def patient(x):
        return x

    @app.task(base=LeaseTask, shared=False, name="t.quick_dispatch", lease_dispatch_timeout=5.0)
    def quick_dispatch(x):
        return x

    return app


def payload(task: str = "t.work") -> str:
    return messages.encode(task, [1], {}, {})


def running(store: Store, job_id: str, task: str = "t.work", owner: str = DEAD, *, age: float = 5.0,
            max_attempts: int = 3, attempts: int = 1) -> str:
    """A running job leased by ``owner`` whose lease expired ``age`` seconds ago; returns its token."""
    token = secrets.token_hex(16)
    store.publishes.record(job_id, task, "celery", payload(task), max_attempts)
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == job_id).values(
            status=RUNNING, locked_by=owner, lock_token=token, attempt_count=attempts, grace_period=1.0,
            lease_duration=30.0, started_at=store.now_sql - 40, lease_expires_at=store.now_sql - age))
    return token


def queued(broker: Broker, dlq: bool = False) -> list[dict]:
    return [json.loads(m) for m in broker.client.lrange(broker.dlq if dlq else broker.queue, 0, -1)]


def events(store: Store, job_id: str, name: str | None = None) -> list[dict]:
    return store.reports.events(job_id, name)


# -- backoff ---------------------------------------------------------------------
def test_backoff_doubles_per_attempt_and_stops_at_the_cap():
    assert [backoff(n, 1.0, 10.0, False) for n in (1, 2, 3, 4, 5, 6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff(10_000, 1.0, 300.0, False) == 300.0  # no overflow


def test_backoff_with_full_jitter_stays_between_zero_and_the_exponential_delay():
    rng = random.Random(7)
    delays = [backoff(3, 1.0, 300.0, True, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 4.0 for d in delays)
    assert min(delays) < 0.1 and max(delays) > 3.9  # spread over the whole range, not a fixed value
    capped = [backoff(20, 1.0, 5.0, True, rng) for _ in range(500)]
    assert max(capped) <= 5.0


# -- expired leases ----------------------------------------------------------------
def test_reaper_requeues_an_expired_lease_once_and_republishes_its_message(app, store, broker):
    token = running(store, "j1")
    before = store.now()
    result = Reaper(app).run_once()
    assert (result.seen, result.reaped, result.dead_lettered) == (1, 1, 0)
    job = store.get("j1")
    assert job.status == PENDING and job.lock_token is None and job.locked_by is None
    assert job.expired_count == 1 and job.attempt_count == 1
    assert before <= job.available_at <= store.now() + 2.0  # backoff(1, base 2) is at most 2 s
    [msg] = queued(broker)
    assert msg["headers"]["id"] == "j1" and msg["headers"]["task"] == "t.work"
    [event] = events(store, "j1", "reaped_expired_lease")
    assert event["worker"] == DEAD and event["token"] == token[:8]
    assert "owner dead@host:1 gone" in event["reason"]
    again = Reaper(app).run_once()
    assert again.reaped == 0 and len(queued(broker)) == 1


def test_reaper_leaves_a_lease_inside_its_grace_period_alone(app, store, broker):
    running(store, "j1", age=0.2)  # grace is 1 s
    result = Reaper(app).run_once()
    assert (result.seen, result.reaped) == (0, 0)
    assert store.get("j1").status == RUNNING and queued(broker) == []


def test_reaper_leaves_a_live_owner_alone_until_the_hard_grace(app, store, broker):
    store.workers.touch_worker(ALIVE, "host", 2)
    token = running(store, "j1", owner=ALIVE)
    first, second = Reaper(app).run_once(), Reaper(app).run_once()
    assert (first.skipped_owner_alive, first.reaped) == (1, 0) and second.skipped_owner_alive == 1
    assert store.get("j1").lock_token == token
    [skip] = events(store, "j1", "reap_skipped_owner_alive")  # one event per lease, not per run
    assert skip["worker"] == ALIVE and skip["token"] == token[:8]
    # Past the hard grace (60 s) the live owner no longer protects it.
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "j1").values(lease_expires_at=store.now_sql - 61.0))
    later = Reaper(app).run_once()
    assert later.reaped == 1 and store.get("j1").status == PENDING
    [reaped] = events(store, "j1", "reaped_expired_lease")
    assert "past the hard grace, owner still registered" in reaped["reason"]


def test_run_once_now_replaces_the_store_clock_in_every_predicate(app, store):
    store.workers.touch_worker(ALIVE, "host", 2)
    running(store, "young", age=-20.0)  # valid for 20 more seconds
    running(store, "alive", owner=ALIVE, age=-20.0)
    assert Reaper(app).run_once().seen == 0
    result = Reaper(app).run_once(now=store.now() + 25.0)  # 5 s past expiry, owner seen 25 s ago
    assert (result.seen, result.reaped) == (2, 2)


def test_reaper_reaps_at_once_when_the_owner_registry_row_is_stale(app, store):
    store.workers.touch_worker(ALIVE, "host", 2)
    running(store, "j1", owner=ALIVE)
    w = store.t.workers
    with store.begin() as c:
        c.execute(sa.update(w).values(last_seen_at=store.now_sql - 11.0))  # stale after 10 s
    assert Reaper(app).run_once().reaped == 1


def test_reaper_dead_letters_when_attempts_are_exhausted_and_publishes_to_the_dead_letter_queue(
        app, store, broker):
    token = running(store, "j1", task="t.once", max_attempts=1)
    result = Reaper(app).run_once()
    assert (result.reaped, result.dead_lettered) == (0, 1)
    job = store.get("j1")
    assert job.status == FAILED and job.lock_token is None and job.failed_at is not None
    assert job.last_error == "lease expired and max attempts reached"
    [event] = events(store, "j1", "dead_lettered")
    assert event["token"] == token[:8] and json.loads(event["detail"])["published_to"] == broker.dlq
    assert queued(broker) == [] and [m["headers"]["id"] for m in queued(broker, dlq=True)] == ["j1"]


def test_reaper_dead_letters_after_max_lease_expirations(app, store):
    running(store, "j1", task="t.fragile")
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "j1").values(expired_count=1))
    result = Reaper(app).run_once()
    assert result.dead_lettered == 1
    assert store.get("j1").last_error == "lease expired and max lease expirations reached"


def test_on_expired_fail_fails_at_once_without_publishing(app, store, broker):
    running(store, "j1", task="t.never_again")
    result = Reaper(app).run_once()
    assert (result.failed, result.reaped) == (1, 0)
    assert store.get("j1").status == FAILED and queued(broker) == []
    assert "lease_on_expired='fail'" in events(store, "j1", "dead_lettered")[0]["reason"]


def test_on_expired_dead_letter_parks_the_job_at_its_first_expiration(app, store):
    running(store, "j1", task="t.park", attempts=1, max_attempts=5)
    assert Reaper(app).run_once().dead_lettered == 1
    assert store.get("j1").status == FAILED


def test_the_requeue_delay_follows_the_task_backoff_policy(app, store, broker):
    running(store, "j1", task="t.patient", attempts=2)  # 100 s doubled once, no jitter
    before = store.now()
    assert Reaper(app).run_once().reaped == 1
    assert store.get("j1").available_at == pytest.approx(before + 200.0, abs=2.0)
    eta = queued(broker)[0]["headers"]["eta"]
    assert eta is not None  # the message carries the same countdown


def test_a_job_of_an_unknown_task_follows_the_app_policy(app, store, broker):
    running(store, "j1", task="t.unregistered")
    assert Reaper(app).run_once().reaped == 1
    assert queued(broker)[0]["headers"]["task"] == "t.unregistered"


def test_an_unreadable_stored_message_fails_the_job_instead_of_leaving_it_pending(app, store):
    running(store, "j1")
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "j1").values(payload="not json"))
    result = Reaper(app).run_once()
    assert (result.failed, result.reaped) == (1, 0)
    assert "message unreadable" in store.get("j1").last_error


@pytest.mark.parametrize("corrupt", [{"body": None}, {"b64": True, "body": "not base64!"},
                                     {"content_type": None}, {"headers": ["not", "a", "mapping"]},
                                     {"properties": "not a mapping"}], ids=["no body", "bad base64",
                                                                            "no content type", "bad headers",
                                                                            "bad properties"])
def test_a_corrupt_recorded_message_fails_its_job_and_the_run_goes_on_with_the_others(app, store, broker,
                                                                                       corrupt):
    # The corrupt job expired longest ago, so the oldest-first scan meets it first in every run: read as a
    # broker failure, it would stop every run there and no later expired lease would ever come back.
    running(store, "bad", age=60.0)
    running(store, "good", age=5.0)
    j = store.t.jobs
    envelope = {"v": 2, "body": "W1tdLCB7fSwge31d", "b64": True, "content_type": "application/json",
                "content_encoding": "utf-8", "headers": {"id": "bad", "task": "t.work"}, "properties": {}}
    envelope.update({k: v for k, v in corrupt.items() if v is not None})
    for key in (k for k, v in corrupt.items() if v is None):
        envelope.pop(key)
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "bad").values(payload=json.dumps(envelope)))
    result = Reaper(app).run_once()
    assert (result.failed, result.reaped, result.publish_errors) == (1, 1, 0)
    assert store.get("bad").status == FAILED and "message unreadable" in store.get("bad").last_error
    assert store.get("good").status == PENDING
    assert [m["headers"]["id"] for m in queued(broker)] == ["good"]


def test_the_scan_takes_at_most_a_batch_per_run_oldest_first(app, store):
    for n in range(7):
        running(store, f"j{n}", age=10.0 + n)  # j6 expired longest ago
    first = Reaper(app, batch_size=3).run_once()
    assert first.reaped == 3
    assert {j for j in (f"j{n}" for n in range(7)) if store.get(j).status == PENDING} == {"j6", "j5", "j4"}
    assert Reaper(app, batch_size=3).run_once().reaped == 3
    assert Reaper(app, batch_size=3).run_once().reaped == 1


def test_the_keyset_walk_passes_leases_left_to_live_owners(app, store):
    store.workers.touch_worker(ALIVE, "host", 2)
    for n in range(5):
        running(store, f"alive{n}", owner=ALIVE, age=20.0 + n)  # oldest, but their owner is alive
    running(store, "dead", age=10.0)
    result = Reaper(app, batch_size=2).run_once()
    assert (result.skipped_owner_alive, result.reaped) == (5, 1)
    assert store.get("dead").status == PENDING


def test_a_second_scan_skips_the_rows_another_reaper_holds(store):
    if store.dialect.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: a second scan waits for the first transaction")
    for n in range(4):
        running(store, f"j{n}", age=10.0 + n)  # j3 and j2 are the oldest
    seen: list[str] = []
    with transaction_held(store, lambda c: store.reaping.scan_expired(c, limit=2)):  # the first reaper's page
        second = threading.Thread(target=lambda: seen.extend(
            e.job.id for e in scan_page(store, limit=10)))
        second.start()
        second.join(5)
        assert not second.is_alive(), "the second scan waited on the locked rows"
    if store.dialect.name == "postgresql":
        assert seen == ["j1", "j0"]
    else:
        # InnoDB may lock rows its plan examined beyond the first page's two, which a second reaper then
        # skips too (they are scanned on a later run): never a held row, never a wait.
        assert set(seen) <= {"j1", "j0"} and seen == sorted(seen, reverse=True), seen


def scan_page(store: Store, limit: int):
    with store.begin() as c:
        return store.reaping.scan_expired(c, limit=limit)


# -- the CAS loses cleanly ------------------------------------------------------------
def scan_one(store: Store):
    with store.begin() as c:
        [item] = store.reaping.scan_expired(c, limit=10, lock=False)
    return item.job


def test_requeue_loses_against_a_concurrent_takeover_and_writes_nothing(store):
    running(store, "j1")
    seen = scan_one(store)
    new = store.jobs.claim("j1", "w2", secrets.token_hex(16),
                           ClaimTerms(duration=30.0, grace=1.0, max_attempts=3, max_expirations=3,
                                      takeover=True),
                           task_name="t.work", queue="celery", payload=lambda: None)
    assert new.claimed
    assert not store.reaping.requeue_abandoned("j1", seen.lock_token, seen.locked_by, delay=1.0, reason="x")
    assert store.get("j1").lock_token == new.job.lock_token
    assert events(store, "j1", "reaped_expired_lease") == []


def test_requeue_loses_against_a_concurrent_completion_and_writes_nothing(store):
    token = running(store, "j1")
    seen = scan_one(store)
    assert store.jobs.complete("j1", token, DEAD)
    assert not store.reaping.requeue_abandoned("j1", seen.lock_token, seen.locked_by, delay=1.0, reason="x")
    assert not store.reaping.dead_letter_abandoned("j1", seen.lock_token, seen.locked_by, error="x")
    assert store.get("j1").status == COMPLETED
    assert events(store, "j1", "reaped_expired_lease") == events(store, "j1", "dead_lettered") == []


def test_requeue_loses_against_a_renewal_between_scan_and_write(store):
    token = running(store, "j1")
    seen = scan_one(store)
    assert store.jobs.renew({token: "j1"}, DEAD) == {"j1"}  # the owner woke up: same token, fresh lease
    assert not store.reaping.requeue_abandoned("j1", seen.lock_token, seen.locked_by, delay=1.0, reason="x")
    assert store.get("j1").status == RUNNING and events(store, "j1", "reaped_expired_lease") == []


def test_a_message_waiting_on_a_requeue_in_flight_claims_the_requeued_job(store):
    """The early message of a requeue blocks on the reaper's row lock, then must claim the job."""
    running(store, "j1")
    outcome: list[str] = []
    in_tx, go = threading.Event(), threading.Event()

    def reaper_batch() -> None:
        with store.begin() as c:
            [item] = store.reaping.scan_expired(c, limit=10)
            assert store.reaping.requeue_abandoned("j1", item.job.lock_token, DEAD, delay=0.0, reason="x",
                                                   c=c)
            in_tx.set()
            go.wait(10)

    def deliver() -> None:
        got = store.jobs.claim("j1", "w2", secrets.token_hex(16),
                               ClaimTerms(duration=30.0, grace=1.0,
                                          max_attempts=3, max_expirations=3, takeover=True),
                               task_name="t.work", queue="celery", payload=lambda: None)
        outcome.append(got.outcome)

    reaping = threading.Thread(target=reaper_batch)
    reaping.start()
    assert in_tx.wait(10)
    delivering = threading.Thread(target=deliver)
    delivering.start()
    delivering.join(0.5)  # give the claim time to reach the locked row (it must wait there)
    go.set()
    reaping.join(10)
    delivering.join(20)
    assert outcome == ["claimed"]
    assert store.get("j1").locked_by == "w2"


def insert_expired(store: Store, count: int) -> None:
    """``count`` running jobs of a dead owner, long expired, in one statement."""
    rows = [dict(id=f"r{n:04d}", task_name="t.work", queue_name="celery", payload=payload(), status=RUNNING,
                 attempt_count=1, expired_count=0, dispatch_count=0, max_attempts=3, available_at=0.0,
                 lock_token=secrets.token_hex(16), locked_by=DEAD, grace_period=0.0, lease_expires_at=1.0,
                 created_at=0.0, updated_at=0.0) for n in range(count)]
    with store.begin() as c:
        c.execute(sa.insert(store.t.jobs), rows)


def run_in_threads(target, count: int = 2) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_two_scanners_racing_over_1000_expired_rows_requeue_each_exactly_once(store):
    """The CAS alone (no reaper lock): two scanners over the same rows, one winner per row."""
    insert_expired(store, 1000)
    wins: list[str] = []
    progress = threading.Condition()
    pages = [0]  # pages committed and scanners finished, by both

    def moved_on() -> None:
        with progress:
            pages[0] += 1
            progress.notify_all()

    def scan_and_requeue() -> None:
        after, stalls, deadlocks = None, 3, 100
        while True:
            won, last, seen = [], after, pages[0]
            try:
                with store.begin(long=True) as c:  # as the reaper's own pages: the long bound
                    page = store.reaping.scan_expired(c, limit=100, after=after)
                    if not page:
                        moved_on()
                        return
                    for item in page:
                        last = (item.job.lease_expires_at, item.job.id)
                        if store.reaping.requeue_abandoned(item.job.id, item.job.lock_token, DEAD, delay=0.0,
                                                           reason="x", c=c):
                            won.append(item.job.id)
            except StoreUnavailable as exc:
                # MySQL breaks a deadlock between the two scanners by rolling one page back (more
                # often on a loaded machine); SQLite's one writer: a disk stall can keep the other
                # scanner's pages holding the lock past the bound. Either way the page rolled
                # back; the reaper's next run takes it again.
                if store.dialect.retryable(exc.__cause__):
                    deadlocks -= 1
                else:
                    stalls -= 1
                if not (stalls and deadlocks):
                    raise
                if store.dialect.retryable(exc.__cause__):
                    # The deadlock's other side goes on: retry once it has committed its page (as
                    # the reaper's next run comes later), not in lockstep with it.
                    with progress:
                        progress.wait_for(lambda seen=seen: pages[0] != seen, timeout=30)
                continue
            after = last
            with progress:
                wins.extend(won)
            moved_on()

    assert run_in_threads(scan_and_requeue) == []
    assert sorted(wins) == [f"r{n:04d}" for n in range(1000)]
    assert len(store.reports.events(event="reaped_expired_lease", limit=5000)) == 1000
    j = store.t.jobs
    with store.begin() as c:
        by_count = sa.select(j.c.expired_count, sa.func.count()).group_by(j.c.expired_count)
        assert dict(c.execute(by_count).all()) == {1: 1000}


def test_two_reapers_running_at_once_requeue_and_publish_each_job_once(app, store, broker):
    insert_expired(store, 300)
    j = store.t.jobs
    totals: list[int] = []

    def reap_until_done() -> None:
        mine = Reaper(app, batch_size=50)
        for _ in range(100):
            totals.append(mine.run_once().reaped)
            with store.begin() as c:
                left = c.execute(sa.select(sa.func.count()).select_from(j).where(j.c.status == RUNNING))
                if left.scalar_one() == 0:
                    return

    assert run_in_threads(reap_until_done) == []
    assert sum(totals) == 300
    reaped = store.reports.events(event="reaped_expired_lease", limit=5000)
    assert len(reaped) == 300 and len({e["job_id"] for e in reaped}) == 300
    assert sorted(m["headers"]["id"] for m in queued(broker)) == [f"r{n:04d}" for n in range(300)]


# -- lost dispatches ------------------------------------------------------------------
def test_a_lost_dispatch_is_republished_once_and_counted(app, store, broker):
    store.publishes.record("p1", "t.work", "celery", payload(), 3,
                           delay=-700.0)  # default dispatch timeout: 600 s
    store.publishes.record("fresh", "t.work", "celery", payload(), 3)
    result = Reaper(app).run_once()
    assert result.redispatched == 1
    job = store.get("p1")
    assert job.status == PENDING and job.dispatch_count == 1 and job.available_at > store.now() - 5
    assert [m["headers"]["id"] for m in queued(broker)] == ["p1"]
    [event] = events(store, "p1", "redispatched")
    assert "lease_dispatch_timeout 600s" in event["reason"]
    assert Reaper(app).run_once().redispatched == 0


def test_a_lost_dispatch_whose_stored_message_is_unreadable_fails_and_leaves_the_scan_to_the_others(
        app, store, broker):
    # The unreadable ones are the oldest, so the oldest-first scan meets them first in every run: left pending
    # they would fill each run's budget, and the one that can be sent would never be.
    j = store.t.jobs
    for n in range(3):
        store.publishes.record(f"bad{n}", "t.work", "celery", payload(), 3, delay=-800.0 - n)
        with store.begin() as c:
            c.execute(sa.update(j).where(j.c.id == f"bad{n}").values(payload="not json"))
    store.publishes.record("good", "t.work", "celery", payload(), 3, delay=-700.0)
    results = [Reaper(app, batch_size=3).run_once() for _ in range(2)]
    assert sum(r.failed for r in results) == 3 and sum(r.redispatched for r in results) == 1
    for n in range(3):
        bad = store.get(f"bad{n}")
        assert bad.status == FAILED and "message unreadable" in bad.last_error
        assert [e["event"] for e in events(store, f"bad{n}")][-1] == "dead_lettered"
    assert store.get("good").dispatch_count == 1
    assert [m["headers"]["id"] for m in queued(broker)] == ["good"]


def test_the_dispatch_timeout_is_per_task(app, store):
    store.publishes.record("quick", "t.quick_dispatch", "celery", payload("t.quick_dispatch"), 3, delay=-10.0)
    store.publishes.record("slow", "t.work", "celery", payload(), 3, delay=-10.0)
    assert Reaper(app).run_once().redispatched == 1
    assert store.get("quick").dispatch_count == 1 and store.get("slow").dispatch_count == 0


def test_lost_dispatches_are_re_sent_at_most_a_batch_per_run_oldest_first(app, store):
    for n in range(5):
        store.publishes.record(f"p{n}", "t.work", "celery", payload(), 3,
                               delay=-700.0 - n)  # p4 is the oldest
    assert Reaper(app, batch_size=2).run_once().redispatched == 2
    assert {f"p{n}" for n in range(5) if store.get(f"p{n}").dispatch_count} == {"p4", "p3"}
    assert Reaper(app, batch_size=2).run_once().redispatched == 2
    assert Reaper(app, batch_size=2).run_once().redispatched == 1


def test_a_re_sent_message_a_worker_claims_before_the_count_is_still_counted_and_audited(
        app, store, broker, monkeypatch):
    """The re-send is out before it is counted: a fast worker may claim the job first (the re-sent copy, or
    a late one). The row then records the re-send anyway, and its lease is left as the claim wrote it."""
    store.publishes.record("p1", "t.work", "celery", payload(), 3, delay=-700.0)
    tokens: list[str] = []

    def worker_claims(job_id: str) -> None:
        tokens.append(secrets.token_hex(16))
        assert store.jobs.claim(job_id, "w:1", tokens[-1], ClaimTerms(
            duration=30.0, grace=0.0, max_attempts=3, max_expirations=3, takeover=False),
            task_name="t.work", queue="celery", payload=lambda: None).claimed

    monkeypatch.setattr(app_state(app), "after_publish", worker_claims)
    claimed = store.now()
    result = Reaper(app).run_once()

    assert (result.redispatched, result.lost_races) == (1, 0)
    job = store.get("p1")
    assert (job.status, job.lock_token, job.dispatch_count) == (RUNNING, tokens[0], 1)
    assert job.available_at < claimed  # not moved: the claim came after the scan saw it waiting
    assert len(events(store, "p1", "redispatched")) == 1


@pytest.mark.parametrize("again", ["reopened", "handed_over"])
def test_a_re_send_is_not_counted_on_a_row_made_pending_again_since_the_scan(store, again):
    """Between the scan and the count a worker may claim the job and the row become pending again with
    another message (its task id applied again, or a replacement's carrier): the re-send was of a message
    the row no longer holds, so the new one's count and dispatch wait start from nothing."""
    store.publishes.record("p1", "t.work", "celery", payload(), 3, delay=-700.0)
    with store.begin(read=True) as c:
        [(seen, _)] = store.reaping.scan_lost_dispatches(c, older_than=600.0, limit=10, lock=False)
    token = secrets.token_hex(16)
    assert store.jobs.claim("p1", "w:1", token, ClaimTerms(
        duration=30.0, grace=0.0, max_attempts=3, max_expirations=3, takeover=False),
        task_name="t.work", queue="celery", payload=lambda: None).claimed
    if again == "reopened":
        assert store.jobs.complete("p1", token)
        assert store.publishes.reopen("p1", "t.work", payload())
    else:
        assert store.replacing.hand_over("p1", token, "w:1", payload("t.carrier"), "carrier-1")

    assert not store.reaping.redispatched(seen, "late")
    assert (store.get("p1").status, store.get("p1").dispatch_count) == (PENDING, 0)
    assert events(store, "p1", "redispatched") == []


def test_two_reapers_do_not_both_count_one_redispatch(store):
    store.publishes.record("p1", "t.work", "celery", payload(), 3, delay=-700.0)
    with store.begin() as c:
        [(seen, _)] = store.reaping.scan_lost_dispatches(c, older_than=600.0, limit=10, lock=False)
    assert store.reaping.redispatched(seen, "first")
    assert not store.reaping.redispatched(seen, "second")
    assert store.get("p1").dispatch_count == 1 and len(events(store, "p1", "redispatched")) == 1


# -- one reaper at a time -------------------------------------------------------------
def test_a_second_reaper_skips_its_run_while_the_lock_is_held(app, store):
    running(store, "j1")
    other = secrets.token_hex(16)
    assert store.reaping.acquire_reaper_lock(other, "someone-else", 30.0)
    result = Reaper(app).run_once()
    assert result.skipped and result.reaped == 0 and store.get("j1").status == RUNNING
    assert store.reaping.reaper_lock_holder()[0] == "someone-else"
    assert store.reaping.release_reaper_lock(other)
    assert Reaper(app).run_once().reaped == 1
    assert store.reaping.reaper_lock_holder() is None  # released after the run


def test_an_expired_reaper_lock_is_taken_over(store):
    assert store.reaping.acquire_reaper_lock("a" * 32, "crashed", 30.0)
    assert not store.reaping.acquire_reaper_lock("b" * 32, "next", 30.0)
    k = store.t.locks
    with store.begin() as c:
        c.execute(sa.update(k).values(expires_at=store.now_sql - 1.0))
    assert store.reaping.acquire_reaper_lock("b" * 32, "next", 30.0)
    assert not store.reaping.renew_reaper_lock("a" * 32,
                                               30.0) and not store.reaping.release_reaper_lock("a" * 32)


# -- dry run, pruning, logging, the task ------------------------------------------------------
def test_dry_run_plans_every_decision_and_changes_nothing(app, store, broker):
    store.workers.touch_worker(ALIVE, "host", 2)
    running(store, "requeue")
    running(store, "dead_letter", task="t.once", max_attempts=1)
    running(store, "alive", owner=ALIVE)
    store.publishes.record("lost", "t.work", "celery", payload(), 3, delay=-700.0)
    before = {e["id"] for e in store.reports.events(limit=1000)}
    result = Reaper(app).run_once(dry_run=True)
    plan = {d.job_id: d.decision for d in result.planned}
    assert plan == {"requeue": "requeue", "dead_letter": "dead_letter", "alive": "skip_owner_alive",
                    "lost": "redispatch"}
    assert result.reaped == result.dead_lettered == result.redispatched == 0
    assert {e["id"] for e in store.reports.events(limit=1000)} == before
    assert store.get("requeue").status == RUNNING and broker.client.exists(broker.queue, broker.dlq) == 0
    assert json.dumps(result.as_dict())  # what `celery lease reap --dry-run` and the task return


def test_a_dry_run_plans_reap_decisions_whose_kinds_are_vocabulary_decisions(app, store, broker):
    store.workers.touch_worker(ALIVE, "host", 2)
    running(store, "requeue")
    running(store, "alive", owner=ALIVE)
    result = Reaper(app).run_once(dry_run=True)
    assert [type(d) for d in result.planned] == [ReapDecision, ReapDecision]
    assert {d.job_id: d.decision for d in result.planned} == {
        "requeue": Decision.REQUEUE, "alive": Decision.SKIP_OWNER_ALIVE}
    assert all(type(d.decision) is Decision for d in result.planned)


def test_a_dry_run_mode_plans_page_after_page_without_taking_or_renewing_the_reaper_lock(app, store, broker,
                                                                                      monkeypatch):
    store.workers.touch_worker(ALIVE, "host", 2)
    running(store, "alive", owner=ALIVE, age=10.0)  # skipped: the first page of one job
    running(store, "requeue", age=5.0)
    for write in ("acquire_reaper_lock", "renew_reaper_lock"):
        monkeypatch.setattr(store.reaping, write, lambda *_, **__: pytest.fail("a dry run took the lock"))
    result = ReapResult(dry_run=True)

    Reaper(app, batch_size=1)._recover_expired(result, store.now(), Hold(), RunMode.DRY_RUN)

    assert [(d.job_id, d.decision) for d in result.planned] == [
        ("alive", Decision.SKIP_OWNER_ALIVE), ("requeue", Decision.REQUEUE)]
    assert store.get("requeue").status == RUNNING and not broker.client.exists(broker.queue)


def test_a_dry_run_on_sqlite_answers_while_another_process_holds_the_write_lock(app, store, broker):
    """The operator's dry run (CLI, web page) only reads: on SQLite it does not wait for a writer,
    even one frozen in the middle of a write."""
    if not store.dialect.single_writer:
        pytest.skip("only SQLite has one write lock for the whole store")
    import sqlite3

    running(store, "requeue")
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        result = Reaper(app).run_once(dry_run=True)
        with pytest.raises(StoreUnavailable):
            Reaper(app).run_once()  # a real run writes, and waits for the lock in vain
    finally:
        other.rollback()
        other.close()
    assert {d.job_id: d.decision for d in result.planned} == {"requeue": "requeue"}


def test_pruning_removes_old_completed_jobs_events_and_stale_workers_only(app, store):
    store.publishes.record("old_done", "t.work", "celery", payload(), 3)
    store.publishes.record("old_failed", "t.work", "celery", payload(), 3)
    store.publishes.record("new_done", "t.work", "celery", payload(), 3)
    store.workers.touch_worker("gone@host:9", "host", 9)
    store.workers.touch_worker(ALIVE, "host", 2)
    j, w, e = store.t.jobs, store.t.workers, store.t.events
    year = 365 * 24 * 3600.0
    with store.begin() as c:
        long_ago = store.now_sql - year
        c.execute(sa.update(j).where(j.c.id == "old_done").values(status=COMPLETED, updated_at=long_ago))
        c.execute(sa.update(j).where(j.c.id == "old_failed").values(status=FAILED, updated_at=long_ago))
        c.execute(sa.update(j).where(j.c.id == "new_done").values(status=COMPLETED))
        c.execute(sa.update(e).where(e.c.job_id.in_(["old_done", "old_failed"])).values(
            at=store.now_sql - year))
        c.execute(sa.update(w).where(w.c.worker_id == "gone@host:9").values(last_seen_at=store.now_sql - 101))
    result = Reaper(app).run_once()
    assert (result.pruned_jobs, result.pruned_events, result.pruned_workers) == (1, 1, 1)
    assert store.get("old_done") is None
    assert store.get("old_failed") is not None  # dead letters stay for operators
    assert [ev["event"] for ev in store.reports.events("old_failed")] == ["published"]  # with their history
    assert store.get("new_done") is not None
    with store.begin() as c:
        assert [r[0] for r in c.execute(sa.select(w.c.worker_id))] == [ALIVE]


def test_a_dry_run_counts_what_the_run_would_prune_and_deletes_nothing(app, store, monkeypatch):
    monkeypatch.setattr(reaper, "PRUNE_CHUNK", 2)
    monkeypatch.setattr(reaper, "PRUNE_CHUNKS", 2)
    j, w = store.t.jobs, store.t.workers
    for n in range(5):
        store.publishes.record(f"done{n}", "t.work", "celery", payload(), 3)
    store.workers.touch_worker("gone@host:9", "host", 9)
    with store.begin() as c:
        c.execute(sa.update(j).values(status=COMPLETED, updated_at=store.now_sql - 30 * 24 * 3600.0))
        c.execute(sa.update(w).where(w.c.worker_id == "gone@host:9").values(last_seen_at=store.now_sql - 101))
    dry = Reaper(app).run_once(dry_run=True)
    assert all(store.get(f"done{n}") is not None for n in range(5))
    real = Reaper(app).run_once()
    assert (dry.pruned_jobs, dry.pruned_workers) == (real.pruned_jobs, real.pruned_workers) == (4, 1)


def test_pruning_deletes_in_bounded_chunks(app, store, monkeypatch):
    monkeypatch.setattr(reaper, "PRUNE_CHUNK", 2)
    monkeypatch.setattr(reaper, "PRUNE_CHUNKS", 2)
    j = store.t.jobs
    for n in range(5):
        store.publishes.record(f"done{n}", "t.work", "celery", payload(), 3)
    with store.begin() as c:
        c.execute(sa.update(j).values(status=COMPLETED, updated_at=store.now_sql - 30 * 24 * 3600.0))
    assert Reaper(app).run_once().pruned_jobs == 4  # two statements of two rows
    assert Reaper(app).run_once().pruned_jobs == 1


def test_the_reaper_logs_one_summary_line_only_when_it_changed_something(app, store, caplog):
    caplog.set_level(logging.INFO, logger="celery_lease.reaper")
    Reaper(app).run_once()
    assert [r for r in caplog.records if r.name == "celery_lease.reaper"] == []
    running(store, "j1")
    Reaper(app).run_once()
    [line] = [r for r in caplog.records if r.name == "celery_lease.reaper"]
    assert line.levelno == logging.INFO and "reaped=1" in line.getMessage() and line.action == "reap"


def test_the_reap_task_is_registered_in_apps_that_use_leases_only_and_is_not_a_lease_task(app, store):
    task = app.tasks["celery_lease.reap"]
    assert isinstance(task, Task) and not isinstance(task, LeaseTask)
    other = Celery("another", set_as_current=False, task_cls=LeaseTask)
    assert not isinstance(other.tasks["celery_lease.reap"], LeaseTask)
    based = Celery("based", set_as_current=False)
    based.task(base=LeaseTask, shared=False, name="based.work")(payload)
    assert "celery_lease.reap" in based.tasks
    # An app with no LeaseTask and no lease setting is left as it was: celery_lease is only installed.
    plain = Celery("plain", set_as_current=False)
    plain.conf.LEASE_TIMEOUT = 30  # another library's setting, not celery_lease's
    plain.task(shared=False, name="plain.work")(payload)
    assert "celery_lease.reap" not in plain.tasks
    django = Celery("django", set_as_current=False)
    django.conf.CELERY_LEASE_DURATION = 30.0  # Django's CELERY namespace
    assert "celery_lease.reap" in django.tasks
    running(store, "j1")
    counts = task.apply().get()
    assert counts["reaped"] == 1 and counts["skipped"] is False


# -- a child lost under a job (worker_lost.py) ------------------------------------------------
def test_recover_worker_lost_requeues_the_job_of_that_owner_at_once(app, store, broker):
    token = running(store, "j1", owner="node@h:42", age=-25.0)  # lease still valid for 25 s
    assert recover_worker_lost(app, "j1", "node@h:99", "WorkerLostError") == "lost_race"  # another's
    assert store.get("j1").lock_token == token
    assert recover_worker_lost(app, "j1", "node@h:42", "WorkerLostError") == "requeue"
    job = store.get("j1")
    assert job.status == PENDING and job.expired_count == 1 and job.lock_token is None
    [event] = events(store, "j1", "reaped_expired_lease")
    assert "worker process lost: WorkerLostError" in event["reason"] and event["token"] == token[:8]
    assert [m["headers"]["id"] for m in queued(broker)] == ["j1"]


@pytest.mark.parametrize("taken_back_by", ["the reaper", "another worker's takeover"])
def test_a_child_lost_after_its_job_was_taken_back_is_no_failure_for_celery(app, store, taken_back_by):
    """A body hung past its lease: the job was requeued (or claimed by another worker) before the child
    died. The lease runs it again, so Celery must store no FAILURE and fire no errback (RERUN)."""
    running(store, "j1", owner="node@h:42", age=5.0)
    Reaper(app).run_once()
    if taken_back_by != "the reaper":
        running(store, "j1", owner="other@h:7", age=-25.0)
    outcome = recover_worker_lost(app, "j1", "node@h:42", "WorkerLostError")
    assert outcome in RERUN and outcome == "lost_race"
    assert store.get("j1").status == (PENDING if taken_back_by == "the reaper" else RUNNING)


def test_a_child_lost_under_a_finished_forgotten_or_never_claimed_job_is_left_to_celery(app, store):
    """Nothing of the lease sends these again: Celery fails the delivery, or requeues it with
    task_reject_on_worker_lost, as a plain task's."""
    running(store, "j1", owner="node@h:42", age=-25.0)
    assert store.jobs.complete("j1", store.get("j1").lock_token, "node@h:42")
    assert recover_worker_lost(app, "j1", "node@h:42", "WorkerLostError") == "none"
    assert recover_worker_lost(app, "gone", "node@h:42", "WorkerLostError") == "none"
    store.publishes.record("j2", "t.work", "celery", payload(), 3)  # the child died before its claim
    assert recover_worker_lost(app, "j2", "node@h:42", "WorkerLostError") == "none"


def test_a_hard_time_limits_final_failure_whose_dead_letter_cannot_be_sent_never_runs_again(
        app, store, broker, monkeypatch):
    app.conf.lease_dead_letter_queue = broker.dlq
    running(store, "j1", owner="node@h:42", age=-25.0)  # attempts left: only the time limit makes it final

    def broker_down(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(messages, "republish", broker_down)
    recover_worker_lost(app, "j1", "node@h:42", "TimeLimitExceeded", final=True)
    monkeypatch.undo()
    assert store.get("j1").status == FAILED  # Celery stored FAILURE for the time limit
    [event] = events(store, "j1", "dead_lettered")
    assert "dead letter not sent" in event["reason"] and "published_to" not in (event["detail"] or "")
    Reaper(app).run_once(now=store.now() + 3600.0)  # long after: the lease expired, its owner gone
    job = store.get("j1")
    assert (job.status, job.attempt_count) == (FAILED, 1)
    assert queued(broker) == []


def test_recover_worker_lost_dead_letters_at_max_attempts(app, store):
    running(store, "j1", owner="node@h:42", age=-25.0, attempts=3, max_attempts=3)
    assert recover_worker_lost(app, "j1", "node@h:42", "TimeLimitExceeded") == "dead_letter"
    job = store.get("j1")
    assert job.status == FAILED and job.last_error == "lease expired and max attempts reached"


def test_recover_worker_lost_answers_with_worker_lost_outcome_members(app, store, broker):
    running(store, "j1", owner="node@h:42", age=-25.0)
    running(store, "j2", owner="node@h:42", age=-25.0, attempts=3, max_attempts=3)
    assert recover_worker_lost(app, "j1", "node@h:99", "WorkerLostError") is WorkerLostOutcome.LOST_RACE
    assert recover_worker_lost(app, "j1", "node@h:42", "WorkerLostError") is WorkerLostOutcome.REQUEUE
    assert recover_worker_lost(app, "j2", "node@h:42", "WorkerLostError") is WorkerLostOutcome.DEAD_LETTER


def test_the_pause_seam_runs_between_publish_and_cas(app, store, broker, monkeypatch):
    running(store, "j1")
    seen: list[tuple[str, str, int]] = []

    def pause(job_id: str) -> None:
        seen.append((job_id, store.get(job_id).status if store.dialect.name != "sqlite" else "-",
                     broker.client.llen(broker.queue)))

    monkeypatch.setattr(app_state(app), "after_publish", pause)
    assert Reaper(app).run_once().reaped == 1
    assert seen[0][0] == "j1" and seen[0][2] == 1  # the message is out before the CAS
    if store.dialect.name != "sqlite":  # a second connection still sees the row running
        assert seen[0][1] == RUNNING


def test_a_workers_heartbeat_answers_while_the_reaper_waits_on_the_broker(app, store, broker, monkeypatch):
    """No transaction is open while the reaper publishes: on SQLite one would hold the store's write lock,
    and every heartbeat, for as long as the broker takes to answer."""
    running(store, "expired")
    live = running(store, "live", owner=ALIVE, age=-20.0)  # expires in 20 s, renewed by its owner
    renewed: list[set[str]] = []

    def heartbeat(job_id: str) -> None:
        renewed.append(store.jobs.renew({live: "live"}, ALIVE, {live: 30.0}))

    monkeypatch.setattr(app_state(app), "after_publish", heartbeat)
    assert Reaper(app).run_once().reaped == 1
    assert renewed == [{"live"}]
    assert store.get("expired").status == PENDING


def test_an_idempotency_key_outlives_its_pruned_job_until_its_own_retention(app, store):
    cfg = app_config(app)
    store.publishes.record("keyed", "t.work", "celery", payload(), 3, idempotency_key="order-7")
    j, k = store.t.jobs, store.t.idempotency_keys
    with store.begin() as c:
        past_jobs = store.now_sql - (cfg.retention + 60)
        c.execute(sa.update(j).where(j.c.id == "keyed").values(status=COMPLETED, updated_at=past_jobs))
        c.execute(sa.update(k).where(k.c.key == "order-7").values(created_at=past_jobs))

    first = Reaper(app).run_once()

    assert (first.pruned_jobs, first.pruned_keys) == (1, 0)
    again = store.publishes.record("again", "t.work", "celery", payload(), 3, idempotency_key="order-7")
    assert again == (False, "keyed")
    with store.begin() as c:
        c.execute(sa.update(k).where(k.c.key == "order-7").values(
            created_at=store.now_sql - (cfg.idempotency_retention + 60)))

    second = Reaper(app).run_once()

    assert second.pruned_keys == 1
    again = store.publishes.record("again", "t.work", "celery", payload(), 3, idempotency_key="order-7")
    assert again == (True, "again")


def test_a_reaper_that_does_not_import_the_task_applies_the_policy_the_job_carries(app, store, broker):
    # Recorded by a worker that knows t.park (lease_on_expired='dead_letter')...
    token = secrets.token_hex(16)
    store.publishes.record("parked", "t.park", "celery", payload("t.park"), 3,
                           recovery=app.tasks["t.park"].lease_policy("celery").recovery())
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id == "parked").values(
            status=RUNNING, locked_by=DEAD, lock_token=token, attempt_count=1, grace_period=1.0,
            lease_duration=30.0, started_at=store.now_sql - 40, lease_expires_at=store.now_sql - 5))
    # ...reaped by an app where the task does not exist: the app-wide default would requeue it.
    bare = Celery(f"bare_{unique_prefix()}", broker=broker.url, set_as_current=False)
    bare.conf.update({k: v for k, v in app.conf.items()
                      if k.startswith("lease_") or k == "task_default_queue"})
    app_state(bare).store = store
    assert "t.park" not in bare.tasks

    result = Reaper(bare).run_once()

    assert (result.reaped, result.dead_lettered) == (0, 1)
    assert store.get("parked").status == FAILED
    assert "lease_on_expired='dead_letter'" in store.get("parked").last_error


# -- the reaper's own runs -----------------------------------------------------------
def test_each_run_records_itself_with_its_counts_and_a_dry_run_does_not(app, store):
    running(store, "job-rec")
    Reaper(app).run_once(dry_run=True)
    assert store.runs.reaper_runs() == []
    result = Reaper(app).run_once()
    (run,) = store.runs.reaper_runs()
    assert run["counts"]["reaped"] == result.reaped == 1
    assert run["worker"].startswith("reaper@") and run["duration"] >= 0
    assert run["finished_at"] - run["started_at"] == pytest.approx(run["duration"], abs=1e-3)
    now, last = store.runs.last_reaper_run()
    assert last["id"] == run["id"] and 0 <= now - last["finished_at"] < 30


def test_old_runs_are_pruned_to_the_newest_kept(app, store, monkeypatch):
    monkeypatch.setattr(reaper, "REAPER_RUNS_KEPT", 3)
    for _ in range(5):
        Reaper(app).run_once()
    runs = store.runs.reaper_runs(limit=10)
    assert len(runs) == 3
    assert [r["id"] for r in runs] == sorted((r["id"] for r in runs), reverse=True)


# -- a backlog --------------------------------------------------------------------------------
# Seconds between the simulated reaper runs. Every re-send in these tests falls due on a multiple
# of 60 s, so a run a minute sees each one when a run every 15 s (beat's usual) would.
REAPER_INTERVAL = 60.0


def age(store: Store, seconds: float) -> None:
    """Time passes for every job: its times move ``seconds`` into the past (the store's clock
    stays real, since a re-dispatch writes the real clock)."""
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).values(available_at=j.c.available_at - seconds,
                                      created_at=j.c.created_at - seconds,
                                      updated_at=j.c.updated_at - seconds))


def copies_in_a_backlog(app, store, broker, *, jobs: int, timeout: float, minutes: float) -> dict[str, int]:
    """Messages the dispatch scan sends per job while ``jobs`` pending jobs wait ``minutes`` in a
    backlog nobody consumes, with a reaper run every REAPER_INTERVAL seconds."""
    for n in range(jobs):
        store.publishes.record(f"b{n:02d}", "t.work", "celery", payload(), 3,
                               recovery={"dispatch_timeout": timeout})
    reaper_ = Reaper(app)
    for _ in range(int(minutes * 60 / REAPER_INTERVAL)):
        age(store, REAPER_INTERVAL)
        reaper_.run_once()
    sent = [m["headers"]["id"] for m in queued(broker)]
    return {f"b{n:02d}": sent.count(f"b{n:02d}") for n in range(jobs)}


def test_a_30_minute_backlog_makes_a_bounded_number_of_copies_per_job(app, store, broker):
    # Given five jobs whose messages wait 30 minutes in a backlog, a dispatch timeout of 60 s
    # (a re-send every 60 s would be 30 copies each) and a reaper run every minute
    copies = copies_in_a_backlog(app, store, broker, jobs=5, timeout=60.0, minutes=30)
    # Then each job was re-sent after 60, 120, 240 and 480 more seconds: 4 copies, the most
    # that waits doubling from 60 s fit in 1,800 s (60 x (2**n - 1) <= 1800, n <= log2(31))
    assert set(copies.values()) == {4}, copies
    # and each copy was counted on the row and audited once
    assert {store.get(job_id).dispatch_count for job_id in copies} == {4}
    assert len(events(store, "b00", "redispatched")) == 4


def test_the_wait_between_re_sends_stops_growing_at_lease_dispatch_backoff_max(app, store, broker):
    app.conf.lease_dispatch_backoff_max = 120.0
    app_state(app).config = None  # the settings are read once per app: read them again
    # re-sends after 60, 120, then every 120 s: 60 + 120 x 14 = 1,740 s <= 1,800 s
    copies = copies_in_a_backlog(app, store, broker, jobs=2, timeout=60.0, minutes=30)
    assert set(copies.values()) == {15}, copies


def test_a_job_waiting_out_its_backoff_does_not_hold_up_the_due_ones_behind_it(app, store):
    # Given more jobs re-sent once before than a run's pages hold, older than a job never re-sent
    # (each carries its dispatch timeout, as a publish records it)
    backed, recovery = reaper.MAX_PAGES * 2 + 1, {"dispatch_timeout": 600.0}
    for n in range(backed):
        store.publishes.record(f"backed{n}", "t.work", "celery", payload(), 3, delay=-700.0 - n,
                               recovery=recovery)
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.startswith("backed")).values(dispatch_count=1))
    store.publishes.record("due", "t.work", "celery", payload(), 3, delay=-650.0, recovery=recovery)
    # When a reaper whose batch is smaller than the jobs in backoff runs (they wait 1,200 s now)
    result = Reaper(app, batch_size=2).run_once()
    # Then the due job is re-sent, and none of the others
    assert result.redispatched == 1 and store.get("due").dispatch_count == 1
    assert {store.get(f"backed{n}").dispatch_count for n in range(backed)} == {1}


# -- after a store outage or a step of its clock ----------------------
LEASE, GRACE, BEAT, INTERVAL = 2.0, 0.5, 0.5, 0.25
# What a reaper run itself may take on a loaded machine, beyond the bound the guarantee states.
RUN_SLACK = 1.0
# How long after the store's return a live owner's renewals stay held: its next beat then lands
# within a lease of the return with a beat to spare for a starved thread and a slow commit.
LATE = LEASE - 2 * BEAT


@pytest.fixture
def quick_app(store, broker):
    """An app of 2 s leases renewed every 0.5 s, whose owners look gone after 2 s of silence."""
    store.hard_grace, store.stale_after = 60.0, 2.0
    app = Celery(f"reaper_{unique_prefix()}", broker=broker.url, set_as_current=False)
    app.conf.update(task_default_queue=broker.queue, lease_store_url=store.url,
                    lease_table_prefix=store.prefix, lease_duration=LEASE, lease_grace_period=GRACE,
                    lease_heartbeat_interval=BEAT, lease_reaper_hard_grace=60.0,
                    lease_worker_stale_after=2.0, lease_backoff_base=0.1, lease_backoff_max=0.1)
    app_state(app).store = store

    @app.task(base=LeaseTask, shared=False, name="t.work")
    def work(x):
        return x

    return app


class Owner(threading.Thread):
    """A worker process's heartbeat: its registry row and leases renewed every BEAT seconds on
    ``clock[0]`` (the store as the test's clock has it), an unreachable store retried next beat."""

    def __init__(self, clock: list[Store], name: str, jobs: list[str]) -> None:
        super().__init__(daemon=True)
        self.clock, self.worker, self.leases = clock, name, {}
        self.paused, self.stopped = threading.Event(), threading.Event()
        self.landed = 0
        for job_id in jobs:
            token = secrets.token_hex(16)
            claim = clock[0].jobs.claim(job_id, name, token, ClaimTerms(LEASE, GRACE, 3, 3, True), "t.work",
                                        "celery", payload)
            assert claim.claimed
            self.leases[token] = job_id
        clock[0].workers.touch_worker(name, "host", 1)

    def run(self) -> None:
        while not self.stopped.wait(BEAT):
            if self.paused.is_set():
                continue
            try:
                self.clock[0].jobs.beat(self.worker, "host", 1, self.leases)
                self.landed += 1
            except StoreUnavailable:
                continue

    def __enter__(self) -> Owner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.join(5)


def stepped(store: Store, offset: float) -> Store:
    """The same store read through a clock ``offset`` seconds from the real one."""
    twin = Store(store.url, store.prefix, clock_offset=offset)
    twin.hard_grace, twin.stale_after = store.hard_grace, store.stale_after
    return twin


def reaped_at(app, clock: list[Store], job_id: str, until: float) -> float | None:
    """Run the reaper every INTERVAL (a new one each run, as the beat task does) until ``job_id``
    is taken back or ``until`` (monotonic) passes; the monotonic time it was taken back."""
    import time

    def taken() -> float | None:
        Reaper(app, store=clock[0]).run_once()
        return time.monotonic() if clock[0].get(job_id).status != RUNNING else None

    return poll(taken, until - time.monotonic(), INTERVAL)


def outage_outlasted(store: Store, job_ids: list[str]) -> bool:
    """Whether the store's clock is past each of ``job_ids``' leases by the grace, the registry's
    silence and a beat: an outage that long leaves every owner looking dead to a reaper."""
    expiries = [store.get(job_id).lease_expires_at for job_id in job_ids]
    return store.now() >= max(expiries) + GRACE + store.stale_after + BEAT


def taken_back(store: Store, job_ids: list[str]) -> dict[str, list[str]]:
    """The recovery events of each of ``job_ids`` that has any."""
    names = ("reaped_expired_lease", "dead_lettered", "lease_taken_over")
    found = {job_id: [e["event"] for e in store.reports.events(job_id) if e["event"] in names]
             for job_id in job_ids}
    return {job_id: names for job_id, names in found.items() if names}


@pytest.mark.parametrize("step", [60.0, -60.0], ids=["forward", "backward"])
def test_a_step_of_the_store_clock_reaps_no_healthy_lease_and_still_recovers_a_dead_owner(
        quick_app, store, step):
    import time

    clock = [store]
    alive = [f"live-{n}" for n in range(3)]
    with Owner(clock, ALIVE, alive) as owner, Owner(clock, DEAD, ["dead"]) as dead:
        for _ in range(3):  # the reaper's history before the step, on the calm clock
            Reaper(quick_app, store=clock[0]).run_once()
            time.sleep(INTERVAL)
        dead.stopped.set()  # its owner dies just before the store's clock steps
        dead.join(5)
        # The step lands between the live owner's heartbeat and the reaper's next run.
        owner.paused.set()
        clock[0] = twin = stepped(store, step)
        step_at = time.monotonic()
        Reaper(quick_app, store=twin).run_once()
        owner.paused.clear()
        bound = LEASE + GRACE + INTERVAL + BEAT
        at = reaped_at(quick_app, clock, "dead", step_at + bound + RUN_SLACK)
        # Healthy leases stay theirs for a whole lease past the end of any hold (a run that took one back
        # ends the watch early; the assertion below names it).
        poll(lambda: Reaper(quick_app, store=twin).run_once() and taken_back(store, alive),
             step_at + 2 * (LEASE + BEAT) + GRACE - time.monotonic(), INTERVAL)
        assert taken_back(store, alive) == {}
        assert at is not None, f"the dead owner's job was not recovered within {bound + RUN_SLACK:g}s"
        logging.getLogger(__name__).info("step %+gs: dead owner's job recovered %.2fs after it (bound %gs)",
                                         step, at - step_at, bound)
        assert at - step_at <= bound + RUN_SLACK
    # Held back at least once for the step; a loaded machine's uneven runs may hold it again (safe).
    held = store.reports.events(None, "reaper_held_back")
    assert any("stepped" in e["reason"] for e in held), held
    twin.engine.dispose()


def test_after_an_outage_nothing_is_taken_back_whose_owner_renews_within_a_lease_of_the_return(
        quick_app, store):
    import time

    clock = [store]
    alive = [f"live-{n}" for n in range(3)]
    with Owner(clock, ALIVE, alive) as owner, Owner(clock, DEAD, ["dead"]) as dead:
        for _ in range(3):
            Reaper(quick_app, store=store).run_once()
            time.sleep(INTERVAL)
        # The outage: no renewal lands and no reaper run gets through, for longer than
        # lease + grace + the registry's silence; the dead owner dies in it.
        owner.paused.set()
        dead.stopped.set()
        wait_for(lambda: outage_outlasted(store, alive), timeout=LEASE + GRACE + store.stale_after + 30,
                 interval=INTERVAL, message="the owners' leases did not run out")
        back = time.monotonic()
        # The store is back: the live owner's deferred renewals land within a lease of it.
        runs = [Reaper(quick_app, store=store).run_once()]
        time.sleep(LATE)  # the owner's renewals held as late as the guarantee allows, less a beat
        owner.paused.clear()
        at = reaped_at(quick_app, clock, "dead", back + LEASE + BEAT + GRACE + INTERVAL + BEAT + RUN_SLACK)
        assert taken_back(store, alive) == {}
        assert runs[0].held_back == 4 and runs[0].reaped == 0
        assert at is not None and at - back >= LEASE, "the dead owner's job was not recovered a lease later"
        logging.getLogger(__name__).info("outage: dead owner's job recovered %.2fs after the return",
                                         at - back)
        assert [e["event"] for e in store.reports.events(None, "reaper_held_back")] == ["reaper_held_back"]


def test_a_reaper_whose_own_calls_failed_through_an_outage_takes_back_nothing_renewed_after_it(
        quick_app, store):
    import time

    from tests.tcp_proxy import TcpProxy

    if store.dialect.local_file:
        pytest.skip("SQLite is a file on this host: there is no path to cut")
    url = sa.engine.make_url(store.url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 0).start()
    far = Store(url.set(host=proxy.host, port=proxy.port).render_as_string(hide_password=False), store.prefix)
    far.hard_grace, far.stale_after = store.hard_grace, store.stale_after
    clock, alive = [far], [f"live-{n}" for n in range(3)]
    keeper = Reaper(quick_app, store=far)  # one reaper through the outage, as run_forever keeps it
    try:
        with Owner(clock, ALIVE, alive) as owner, Owner(clock, DEAD, ["dead"]) as dead:
            for _ in range(3):
                keeper.run_once()
                time.sleep(INTERVAL)
            dead.stopped.set()
            proxy.cut()  # the store is unreachable for the reaper and every owner alike
            cut_at, failures = time.monotonic(), 0
            # The store itself stays reachable to the test: the cut lasts until it shows every
            # owner's lease run out.
            while not outage_outlasted(store, alive):
                assert time.monotonic() < cut_at + LEASE + GRACE + store.stale_after + 30, \
                    "the owners' leases did not run out"
                with pytest.raises(StoreUnavailable):
                    keeper.run_once()
                failures += 1
                time.sleep(INTERVAL)
            owner.paused.set()  # its deferred renewals land within a lease of the return
            proxy.start()
            # The pooled connections died with the cut: a beat that met one would fail and come a
            # beat later, at the very edge of the lease this test gives the owner.
            far.engine.dispose()
            back = time.monotonic()
            first = keeper.run_once()
            time.sleep(LATE)  # the owner's renewals held as late as the guarantee allows, less a beat
            owner.paused.clear()
            poll(lambda: keeper.run_once() and store.get("dead").status != RUNNING,
                 back + LEASE + BEAT + GRACE + INTERVAL + BEAT + RUN_SLACK - time.monotonic(), INTERVAL)
            done = time.monotonic()
        assert failures > 0
        assert taken_back(store, alive) == {}
        # Nothing is taken back on the return (an owner's beat in flight may land first; the
        # dead owner's lease at least is held back).
        assert first.held_back >= 1 and (first.reaped, first.dead_lettered, first.failed) == (0, 0, 0)
        assert store.get("dead").status != RUNNING, "the dead owner's job was not recovered a lease later"
        logging.getLogger(__name__).info("cut path: dead owner's job recovered %.2fs after the return",
                                         done - back)
    finally:
        proxy.cut()
        far.engine.dispose()


# -- task events (events.py) --------------------------------------------------------
def test_a_dead_letter_whose_task_event_the_broker_refuses_is_still_reaped_and_logged(app, store, caplog):
    app.conf.update(worker_send_task_events=True, broker_write_url="redis://127.0.0.1:1/12",
                    broker_connection_max_retries=0, broker_connection_timeout=0.2)
    running(store, "j1", task="t.park")  # dead-lettered without a message: only the event needs the broker
    with caplog.at_level(logging.WARNING, logger="celery_lease.messaging.events"):
        result = Reaper(app).run_once()
    assert result.dead_lettered == 1 and store.get("j1").status == FAILED
    assert any("task-failed j1" in r.getMessage() for r in caplog.records)


def test_a_page_whose_transaction_rolls_back_sends_no_task_event(app, store, monkeypatch):
    app.conf.worker_send_task_events = True
    sent: list[tuple[str, str]] = []
    real = reaper.events.send
    monkeypatch.setattr(reaper.events, "send", lambda a, host, evs: sent.extend(
        (kind.value, fields["uuid"]) for kind, fields in list(evs)) or real(a, host, []))
    running(store, "j1", age=20.0)
    running(store, "j2", age=10.0)
    requeue, calls = store.reaping.requeue_abandoned, []

    def store_lost_at_the_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise StoreUnavailable("store lost mid-page")
        return requeue(*args, **kwargs)

    monkeypatch.setattr(store.reaping, "requeue_abandoned", store_lost_at_the_second)
    with pytest.raises(StoreUnavailable):
        Reaper(app).run_once()
    assert store.get("j1").status == RUNNING  # j1's requeue rolled back with the page
    assert sent == []
    monkeypatch.setattr(store.reaping, "requeue_abandoned", requeue)
    Reaper(app).run_once(now=store.now())  # a simulated clock: no hold after the outage
    assert sorted(sent) == [("task-retried", "j1"), ("task-retried", "j2")]


def test_an_owner_completing_while_its_dead_letter_is_sent_is_stale_and_the_job_stays_dead_lettered(
        app, store, broker, monkeypatch):
    """The store and the dead-letter queue agree: no dead letter is sent for a job the store completes."""
    token = running(store, "j1", task="t.once", max_attempts=1)
    completed: list[bool] = []

    def owner_completes(job_id: str) -> None:
        completed.append(store.jobs.complete(job_id, token, DEAD))

    monkeypatch.setattr(app_state(app), "after_publish", owner_completes)
    result = Reaper(app).run_once()

    assert completed == [False] and (result.dead_lettered, result.lost_races) == (1, 0)
    job = store.get("j1")
    assert job.status == FAILED and job.lock_token is None
    assert [m["headers"]["id"] for m in queued(broker, dlq=True)] == ["j1"]
    [event] = events(store, "j1", "dead_lettered")
    assert event["token"] == token[:8] and json.loads(event["detail"])["previous_token"] == token[:8]
    assert events(store, "j1", "stale_completion_rejected")


def test_a_dead_letter_whose_row_moved_on_before_its_claim_is_not_sent(app, store, broker, monkeypatch):
    running(store, "j1", task="t.once", max_attempts=1)
    scan = store.reaping.scan_expired

    def owner_completes_after_the_scan(c, **kwargs):
        page = scan(c, **kwargs)
        for item in page:
            assert store.jobs.complete(item.job.id, item.job.lock_token, DEAD)
        return page

    monkeypatch.setattr(store.reaping, "scan_expired", owner_completes_after_the_scan)
    result = Reaper(app).run_once()
    assert (result.dead_lettered, result.lost_races) == (0, 1)
    assert store.get("j1").status == COMPLETED and queued(broker, dlq=True) == []


def test_a_lost_childs_completion_after_the_reapers_claim_leaves_the_dead_letter_standing(
        app, store, broker, monkeypatch):
    running(store, "j1", task="t.once", owner="node@h:42", max_attempts=1)
    outcomes: list[WorkerLostOutcome] = []
    monkeypatch.setattr(app_state(app), "after_publish", lambda job_id: outcomes.append(
        complete_worker_lost(app, job_id, "node@h:42", "WorkerLostError")))
    result = Reaper(app).run_once()
    assert outcomes == [WorkerLostOutcome.NONE] and result.dead_lettered == 1
    assert store.get("j1").status == FAILED
    assert [m["headers"]["id"] for m in queued(broker, dlq=True)] == ["j1"]


def test_a_dead_letter_that_could_not_be_sent_gives_the_row_back_and_the_next_run_names_its_owner(
        app, store, broker, monkeypatch):
    token = running(store, "j1", task="t.once", max_attempts=1)

    def broker_down(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(messages, "republish", broker_down)
    assert Reaper(app).run_once().publish_errors == 1
    job = store.get("j1")
    assert (job.status, job.lock_token, job.locked_by) == (RUNNING, token, DEAD)
    monkeypatch.undo()
    assert Reaper(app).run_once().dead_lettered == 1
    [event] = events(store, "j1", "dead_lettered")
    detail = json.loads(event["detail"])
    assert (event["worker"], event["token"]) == (DEAD, token[:8])
    assert (detail["previous_owner"], detail["previous_token"]) == (DEAD, token[:8])


def test_a_reaper_that_dies_after_claiming_a_dead_letter_leaves_the_owners_attempt_in_the_audit_trail(
        app, store, broker, monkeypatch):
    token = running(store, "j1", task="t.once", max_attempts=1)

    class Died(BaseException):
        """The reaper's process ends between its claim and its write (as a SIGKILL would)."""

    def dies(*args, **kwargs):
        raise Died

    monkeypatch.setattr(messages, "republish", dies)
    with pytest.raises(Died):
        Reaper(app).run_once()
    assert store.get("j1").locked_by != DEAD  # the row now names the reaper's claim
    monkeypatch.undo()
    assert Reaper(app).run_once().dead_lettered == 1
    assert store.get("j1").status == FAILED
    assert [m["headers"]["id"] for m in queued(broker, dlq=True)] == ["j1"]
    owners = [(e["event"], e["worker"], e["token"]) for e in events(store, "j1")]
    assert ("dead_letter_claimed", DEAD, token[:8]) in owners, owners


def test_a_claim_that_finds_the_store_away_still_writes_the_take_backs_whose_messages_went_out(
        app, store, broker, monkeypatch):
    running(store, "a1", age=20.0)  # expired first: requeued, its message sent
    running(store, "j1", task="t.once", max_attempts=1, age=5.0)  # then a dead letter to claim

    def away(*args, **kwargs):
        raise StoreUnavailable("no answer within the call bound (injected)")

    monkeypatch.setattr(store.reaping, "claim_abandoned", away)
    result = Reaper(app).run_once()
    assert (result.reaped, result.publish_errors) == (1, 1)
    assert store.get("a1").status == PENDING and [m["headers"]["id"] for m in queued(broker)] == ["a1"]
    assert store.get("j1").status == RUNNING and queued(broker, dlq=True) == []


def test_a_child_that_gave_its_job_back_as_it_shut_down_has_it_sent_again_not_failed(
        app, store, broker, monkeypatch):
    """A SIGTERM to a pool child alone (or to the worker's process group): the child gives an acks_late job
    back for the broker to deliver again, and Celery acks that delivery as a lost child's."""
    monkeypatch.setattr(app.tasks["t.work"], "acks_late", True)
    token = running(store, "j1", owner="node@h:42", age=-25.0)
    assert store.jobs.release("j1", token, "node@h:42")  # the child's shutdown
    assert recover_worker_lost(app, "j1", "node@h:42", "WorkerLostError") is WorkerLostOutcome.REQUEUE
    assert store.get("j1").status == PENDING and [m["headers"]["id"] for m in queued(broker)] == ["j1"]
    # Another process's give-back is not this child's to send again; the job runs again, so no failure.
    token = running(store, "j2", owner="node@h:43", age=-25.0)
    assert store.jobs.release("j2", token, "node@h:43")
    assert recover_worker_lost(app, "j2", "node@h:42", "WorkerLostError") is WorkerLostOutcome.LOST_RACE
    # Without acks_late the child's give-back sent the message itself: not sent twice.
    monkeypatch.setattr(app.tasks["t.work"], "acks_late", False)
    token = running(store, "j3", owner="node@h:42", age=-25.0)
    assert store.jobs.release("j3", token, "node@h:42")
    assert recover_worker_lost(app, "j3", "node@h:42", "WorkerLostError") is WorkerLostOutcome.REQUEUE
    assert [m["headers"]["id"] for m in queued(broker)] == ["j1"]  # j1's from above, none for j3
