"""deliveries.py: a delivery whose body does not run is audited, sent again or given back, never failed.

Re-sent messages go to a real Redis broker (db 12) and are read back from their queue.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_lease import LeaseTask
from celery_lease.errors import StoreUnavailable
from celery_lease.messaging import messages
from celery_lease.messaging.messages import STORE_RETRIES_HEADER
from celery_lease.worker import deliveries

REDIS_DB = 12  # never flushed: each test's queue is its own


class DownStore:
    """A store whose audit log cannot be written (the database just went away)."""

    def event(self, *_args, **_kwargs):
        raise StoreUnavailable("lease store unreachable")


class Request:
    id = "job-1"
    delivery_info = {"redelivered": True}


class Task:
    request = Request()


class Job:
    status, locked_by = "running", "other:1"


def test_a_duplicate_is_still_skipped_when_its_audit_event_cannot_be_written(caplog):
    caplog.set_level(logging.WARNING, logger="celery_lease.worker.deliveries")
    # Ignore, not StoreUnavailable: a raised error would make Celery write FAILURE over the real run.
    with pytest.raises(Ignore):
        deliveries.skip_duplicate(Task(), DownStore(), "me:1", "busy", Job())
    assert "audit event duplicate_delivery_skipped not written" in caplog.text


class BrokerDownSignature:
    def apply_async(self):
        raise ConnectionError("broker unreachable")


class BrokerDownTask(Task):
    def signature_from_request(self, request, countdown=None, headers=None):
        self.countdown = countdown
        return BrokerDownSignature()


def test_fail_closed_with_the_broker_down_too_rejects_the_message_back_to_the_queue(caplog):
    task = BrokerDownTask()
    with pytest.raises(Reject) as info:
        deliveries.fail_closed(task, 5.0, 300.0, StoreUnavailable("lease store unreachable"))
    assert info.value.requeue is True and 2.5 <= task.countdown <= 5.0
    assert isinstance(info.value, deliveries.StoreDown)  # the worker stops consuming all the same
    assert "cannot re-send" in caplog.text


@pytest.fixture
def resending(redis_url):
    """A LeaseTask whose re-sent messages go to a queue of its own on a real Redis broker."""
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    queue = f"deliveries-{uuid.uuid4().hex[:8]}"
    app = Celery(f"resend_{queue}", broker=url, set_as_current=False)
    app.conf.task_default_queue = queue

    @app.task(base=LeaseTask, bind=True, shared=False, name="d.work")
    def work(self, x):
        return x

    client = redis.Redis.from_url(url)
    yield work, client, queue
    client.delete(queue)
    client.close()
    app.close()


def test_each_fail_closed_re_send_waits_twice_as_long_up_to_the_cap_counting_in_a_header(resending):
    task, client, queue = resending
    rng = random.Random(5)
    # Given a first delivery carrying a custom header of the app's own
    headers = {"id": "job-1", "task": "d.work", "tenant": "shop-7"}
    steps = []
    for _ in range(7):
        # When each delivery of the message finds the store unreachable (base 1 s, cap 8 s)
        task.push_request(args=[1], kwargs={}, delivery_info={"exchange": "", "routing_key": queue},
                          **headers)
        sent = time.time()
        try:
            with pytest.raises(deliveries.FailedClosed):
                deliveries.fail_closed(task, 1.0, 8.0, StoreUnavailable("lease store unreachable"), rng)
        finally:
            task.pop_request()
        # (the next delivery is the message it sent, as the broker hands it over)
        [raw] = client.lrange(queue, 0, -1)
        client.delete(queue)
        headers = json.loads(raw)["headers"]
        eta = datetime.datetime.fromisoformat(headers["eta"]).timestamp()
        steps.append((headers[STORE_RETRIES_HEADER], eta - sent))
    # Then each re-send counts one more in the header and waits between half and all of
    # 1, 2, 4, 8, 8, ... seconds
    assert [count for count, _ in steps] == [1, 2, 3, 4, 5, 6, 7]
    for (_, delay), step in zip(steps, [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0], strict=True):
        assert step / 2 - 0.1 <= delay <= step + 0.1, steps
    # and the message keeps its own id and headers
    assert headers["id"] == "job-1" and headers["tenant"] == "shop-7"


def test_a_delivery_the_store_answered_sends_its_retry_without_the_count():
    from celery.app.task import Context

    request = Context(id="job-1", tenant="shop-7", **{STORE_RETRIES_HEADER: 6})
    assert messages.store_retries(request) == 6
    messages.forget_store_retries(request)
    assert request.as_execution_options()["headers"] == {"tenant": "shop-7"}


# -- finishing what a crash interrupted ----------------------------------------------------
@pytest.fixture
def results_app():
    from celery import Celery

    app = Celery("kept", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(name="kept.task", bind=True, shared=False)
    def kept(self):
        return None

    yield app, kept
    app.close()


class KeptStore:
    """A completed job's kept result, the store's clock (1000.0), and the audit events written."""

    def __init__(self, kept):
        self.kept, self.written = kept, []
        self.jobs = self  # kept_result is a call of the store's jobs statements

    def kept_result(self, job_id):
        return self.kept

    def now(self):
        return 1000.0

    def event(self, job_id, event, *args, **kwargs):
        self.written.append(str(event))


class CompletedJob:
    """Completed two lease durations before KeptStore's clock."""

    id, status, locked_by, completed_at, lease_duration = "job-1", "completed", None, 940.0, 30.0


def test_a_result_is_kept_only_when_celery_stores_results(results_app):
    from celery.backends.base import DisabledBackend

    app, task = results_app
    task.push_request(id="job-1")
    try:
        assert messages.keepable_result(task, {"total": 3}) is not None
        task.request.ignore_result = True
        assert messages.keepable_result(task, {"total": 3}) is None
        task.request.ignore_result = False
        task.backend = DisabledBackend(app)
        assert messages.keepable_result(task, {"total": 3}) is None
    finally:
        task.pop_request()


def test_a_completed_job_without_a_stored_result_resumes_with_the_kept_one(results_app):
    _, task = results_app
    task.push_request(id="job-1", delivery_info={})
    try:
        store = KeptStore(messages.keepable_result(task, {"total": 3}))
        assert deliveries.resume_post_run(task, store, "me:1", CompletedJob()) == (True, {"total": 3})
        assert store.written == ["post_run_resumed"]
        task.backend.mark_as_done("job-1", {"total": 3})
        assert deliveries.resume_post_run(task, store, "me:1", CompletedJob()) == (False, None)
        assert store.written == ["post_run_resumed"]  # a stored result: an ordinary duplicate
    finally:
        task.pop_request()


def test_a_completed_job_whose_post_run_work_failed_resumes_with_the_kept_result(results_app):
    from kombu.exceptions import OperationalError

    _, task = results_app
    job = CompletedJob()
    job.id = "job-post-run-failed"  # the memory backend is shared by the tests
    task.push_request(id=job.id, delivery_info={"redelivered": True})
    try:
        # Celery stored FAILURE after the body returned: the next step's publish failed (the broker away)
        task.backend.mark_as_failure(job.id, OperationalError("[Errno 111] Connection refused"))
        store = KeptStore(messages.keepable_result(task, {"total": 3}))
        assert deliveries.resume_post_run(task, store, "me:1", job) == (True, {"total": 3})
        assert store.written == ["post_run_resumed"]
    finally:
        task.pop_request()


def test_a_job_completed_less_than_a_lease_ago_is_looked_at_again_after_it_not_resumed(results_app):
    from celery.exceptions import Ignore

    app, task = results_app
    task.push_request(id="job-recent", delivery_info={}, args=[], kwargs={})
    recent = CompletedJob()
    recent.id, recent.completed_at = "job-recent", 990.0  # ten seconds before the store's clock; a 30 s lease
    try:
        store = KeptStore(messages.keepable_result(task, {"total": 3}))
        with pytest.raises(Ignore):
            deliveries.resume_post_run(task, store, "me:1", recent)
        # The owner may still be storing the result: nothing resumed, the delivery sent again.
        assert store.written == ["early_delivery_deferred"]
        with app.connection_for_write() as conn:
            queue = conn.SimpleQueue("celery", no_ack=True)  # kombu's memory broker: shared by the tests
            sent = []
            while True:
                try:
                    sent.append(queue.get(timeout=0.2).headers)
                except queue.Empty:
                    break
        assert [h["eta"] is not None for h in sent if h["id"] == "job-recent"] == [True]
    finally:
        task.pop_request()


def test_a_completed_job_that_kept_nothing_is_an_ordinary_duplicate(results_app):
    _, task = results_app
    task.push_request(id="job-1", delivery_info={})
    try:
        store = KeptStore(None)
        assert deliveries.resume_post_run(task, store, "me:1", CompletedJob()) == (False, None)
        assert store.written == []
    finally:
        task.pop_request()


def test_a_request_that_sets_ignore_result_overrides_the_task_and_one_that_does_not_defers_to_it(results_app):
    from celery.app.task import Context

    _, task = results_app
    assert messages.ignores_result(task, Context(id="j")) is False
    assert messages.ignores_result(task, Context(id="j", ignore_result=True)) is True
    task.ignore_result = True
    try:
        assert messages.ignores_result(task, Context(id="j")) is True
        assert messages.ignores_result(task, Context(id="j", ignore_result=False)) is False
    finally:
        task.ignore_result = False


def test_a_completed_job_older_than_result_expires_is_an_ordinary_duplicate(results_app):
    # The result may have expired: a missing one proves no crash, so nothing is resumed.
    app, task = results_app
    task.push_request(id="job-old", delivery_info={})
    old = CompletedJob()
    old.id = "job-old"
    app.conf.result_expires = 30  # CompletedJob completed 60 s before the store's clock
    try:
        store = KeptStore(messages.keepable_result(task, {"total": 3}))
        assert deliveries.resume_post_run(task, store, "me:1", old) == (False, None)
        assert store.written == []
        app.conf.result_expires = 120
        assert deliveries.resume_post_run(task, store, "me:1", old) == (True, {"total": 3})
    finally:
        task.pop_request()


def test_a_claim_given_up_is_remembered_for_its_job_only_and_the_oldest_are_forgotten(monkeypatch):
    monkeypatch.setattr(deliveries, "UNANSWERED_KEPT", 3)
    claims = deliveries.UnansweredClaims()
    claims.remember("job-1", "tok-1", None)
    assert claims.orphaned("job-1", "tok-1")
    assert not claims.orphaned("job-2", "tok-1") and not claims.orphaned("job-1", None)
    for n in range(2, 5):
        claims.remember(f"job-{n}", f"tok-{n}", None)
    assert not claims.orphaned("job-1", "tok-1")  # the oldest of four, with room for three
    assert claims.orphaned("job-4", "tok-4")
    claims.forget("tok-4")
    assert not claims.orphaned("job-4", "tok-4")


def test_a_claim_whose_answer_was_lost_but_committed_is_given_back_and_its_message_sent_again(store,
                                                                                                resending):
    # Its first re-sent copy may reach another process, which finds the job running under this claim and
    # skips it as a duplicate: nobody would run the job until its lease lapsed past the reaper's grace.
    import secrets

    from celery_lease.store import ClaimTerms

    task, client, queue = resending
    store.publishes.record("job-1", "d.work", queue, messages.encode("d.work", (7,), {}, {}, "json"), 3)
    store.publishes.record("job-2", "d.work", queue, messages.encode("d.work", (8,), {}, {}, "json"), 3)
    committed, never = secrets.token_hex(16), secrets.token_hex(16)
    terms = ClaimTerms(duration=30.0, grace=1.0, max_attempts=3, max_expirations=3, takeover=True)
    assert store.jobs.claim("job-1", "host:1", committed, terms, task_name="d.work", queue=queue,
                            payload=lambda: None).claimed
    claims = deliveries.UnansweredClaims()
    claims.remember("job-1", committed, task.app)
    claims.remember("job-2", never, task.app)  # its claim never reached the store

    claims.release(store, "host:1")

    job = store.get("job-1")
    assert (job.status, job.attempt_count, job.lock_token) == ("pending", 0, None)
    assert [e["event"] for e in store.reports.events("job-1")][-1] == "released_after_outage"
    sent = [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]
    assert sent == ["job-1"]
    assert store.get("job-2").status == "pending"
    assert not store.reports.events("job-2", "stale_release_rejected")
    assert not claims.orphaned("job-1", committed) and not claims.orphaned("job-2", never)
