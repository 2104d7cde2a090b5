"""The publish record is the message Celery sent: captured in the producer, encoded once.

Real Redis broker (db 6, a key prefix per test) and a SQLite store; each test reads the
message the broker holds and compares it with the stored payload.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import pickle

import kombu
import kombu.compression
import kombu.exceptions
import pytest
from celery import Celery, group, signals
from kombu import serialization

from celery_lease import LeaseTask
from celery_lease.errors import StoreConflict, StoreCorrupt
from celery_lease.messaging import messages
from celery_lease.store import for_app
from tests.conftest import drop_app_store, migrated_store, prefixed_redis, unique_prefix

REDIS_DB = 6


@pytest.fixture
def broker(redis_url):
    with prefixed_redis(redis_url, REDIS_DB) as (url, _, keyprefix):
        yield url, keyprefix


@pytest.fixture
def app(broker, sqlite_url):
    url, keyprefix = broker
    app = Celery(f"pub_{unique_prefix()}", broker=url, set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, broker_transport_options={"global_keyprefix": keyprefix},
                    task_default_queue="pub")

    @app.task(base=LeaseTask, shared=False, name="pub.work")
    def work(*args, **kwargs):
        return args

    migrated_store(app)
    yield app
    drop_app_store(app)


def received(app: Celery, expected: int, queue: str = "pub") -> list[kombu.Message]:
    """The messages waiting in ``queue``, as a consumer gets them: ``expected`` of them and any extra."""
    options = app.conf.broker_transport_options
    with kombu.Connection(app.conf.broker_url, transport_options=options) as conn:
        q = conn.SimpleQueue(queue, no_ack=True, accept=["json", "pickle", "application/x-counted"])
        found = []
        while True:
            try:
                # Up to 5 s for each expected message; past those, a short look for an extra one.
                found.append(q.get(timeout=5 if len(found) < expected else 0.2))
            except q.Empty:
                return found


def stored(app: Celery, job_id: str) -> dict:
    return json.loads(for_app(app).get(job_id).payload)


@pytest.mark.parametrize(("serializer", "compression"),
                         [("json", None), ("pickle", "zlib"), ("json", "bzip2")])
def test_the_recorded_message_is_the_message_the_broker_received(app, serializer, compression):
    app.conf.accept_content = ["json", "pickle"]
    result = app.tasks["pub.work"].apply_async((1, datetime.date(2026, 1, 2)), {"k": b"\x00\xff"},
                                               serializer=serializer, compression=compression)
    [message] = received(app, 1)
    payload = stored(app, result.id)
    body = base64.b64decode(payload["body"]) if payload["b64"] else payload["body"].encode()
    if compression:  # the consumer's message holds the body decompressed
        body = kombu.compression.decompress(body, payload["headers"]["compression"])
    assert body == message.body
    assert payload["content_type"] == message.content_type
    assert payload["headers"]["id"] == message.headers["id"] == result.id
    assert payload["headers"].get("compression") == message.headers.get("compression")
    sig = messages.decode(for_app(app).get(result.id).payload, app.conf.accept_content, result.id)
    assert sig["task"] == "pub.work" and sig["args"][0] == 1 and sig["kwargs"]["k"] == b"\x00\xff"


def test_a_publish_encodes_its_message_once(app):
    calls = []

    def counted(value):
        calls.append(value)
        return pickle.dumps(value)

    serialization.register("counted", counted, pickle.loads, "application/x-counted", "binary")
    try:
        app.conf.accept_content = ["json", "counted"]
        result = app.tasks["pub.work"].apply_async((7,), serializer="counted")
        [message] = received(app, 1)
    finally:
        serialization.unregister("counted")
    assert len(calls) == 1  # Celery's own encoding is the record's: never a second one
    assert message.headers["id"] == result.id
    assert stored(app, result.id)["content_type"] == "application/x-counted"


def test_a_redispatch_sends_the_recorded_bytes_again(app):
    result = app.tasks["pub.work"].apply_async((3,), compression="zlib", priority=3)
    [first] = received(app, 1)
    messages.republish(app, result.id, for_app(app).get(result.id).payload)
    before = datetime.datetime.now(datetime.timezone.utc)
    messages.republish(app, result.id, for_app(app).get(result.id).payload, countdown=30)
    again, later = received(app, 2)
    assert again.body == later.body == first.body
    assert dict(again.headers) == dict(first.headers)
    assert again.properties.get("priority") == first.properties.get("priority") == 3
    eta = datetime.datetime.fromisoformat(later.headers["eta"])
    assert eta >= before + datetime.timedelta(seconds=29)


def test_a_taken_idempotency_key_sends_nothing_and_names_the_first_job(app):
    sent = []

    def count(sender=None, **_):
        sent.append(sender)

    signals.after_task_publish.connect(count, weak=False)
    try:
        first = app.tasks["pub.work"].apply_async((1,), idempotency_key="order-1")
        second = app.tasks["pub.work"].apply_async((2,), idempotency_key="order-1")
    finally:
        signals.after_task_publish.disconnect(count)
    assert second.id == first.id
    assert len(received(app, 1)) == 1
    assert sent == ["pub.work"]


def test_a_key_published_again_under_the_same_task_id_sends_nothing_more(app):
    # A caller that reuses its task id with its key (a retried request) gets the first publish, not a second
    # message for the same job.
    first = app.tasks["pub.work"].apply_async((1,), task_id="job-A", idempotency_key="order-2")
    again = app.tasks["pub.work"].apply_async((1,), task_id="job-A", idempotency_key="order-2")
    assert first.id == again.id == "job-A"
    assert len(received(app, 1)) == 1


@pytest.mark.parametrize("key", [["order", 42], {"order": 42}, b"order-42", 42, "", "k" * 256],
                         ids=["list", "dict", "bytes", "int", "empty", "too-long"])
def test_an_idempotency_key_that_is_not_a_short_string_is_refused_before_anything_is_recorded(app, key):
    # Passed on to the driver, a list was an "unreachable store" on MariaDB (a body publishing it was given
    # back and ran again without end) and was stored as its text on PostgreSQL, never to match again.
    with pytest.raises(ValueError, match="idempotency_key must be a non-empty string"):
        app.tasks["pub.work"].apply_async((1,), task_id="job-K", idempotency_key=key)
    assert for_app(app).get("job-K") is None
    assert received(app, 0) == []


def test_a_bad_idempotency_key_given_on_commit_is_refused_at_the_call_not_after_the_commit(app, monkeypatch):
    # Refused inside Django's on_commit, the error would come after the caller's data committed.
    import celery_lease.integration.task as task_module

    deferred: list = []
    monkeypatch.setattr(task_module, "_on_commit", deferred.append)
    with pytest.raises(ValueError, match="idempotency_key must be a non-empty string"):
        app.tasks["pub.work"].apply_async_on_commit((1,), idempotency_key=["order", 42])
    assert deferred == []


def test_a_task_id_reused_under_a_key_it_was_not_recorded_with_is_refused_not_answered_with_the_old_job(app):
    # Answered with the old job, the caller got its result, nothing ran, and the key stayed free.
    app.tasks["pub.work"].apply_async((1,), task_id="nightly")
    with pytest.raises(StoreConflict, match="task id nightly already names a job recorded without"):
        app.tasks["pub.work"].apply_async((2,), task_id="nightly", idempotency_key="night-2")
    assert [m.headers["id"] for m in received(app, 1)] == ["nightly"]
    fresh = app.tasks["pub.work"].apply_async((2,), idempotency_key="night-2")
    assert fresh.id != "nightly" and for_app(app).get(fresh.id) is not None


def test_a_keyed_publish_whose_send_failed_leaves_its_key_free_for_the_retry(app, monkeypatch):
    # The record is taken back when the message cannot be sent: its key too, or the retry would be
    # answered with a job that no longer exists and nobody would ever run it.
    import kombu.exceptions
    import kombu.messaging

    real = kombu.messaging.Producer.publish

    def broker_down(self, *args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(kombu.messaging.Producer, "publish", broker_down)
    app.conf.task_publish_retry = False
    with pytest.raises((ConnectionError, kombu.exceptions.OperationalError)):
        app.tasks["pub.work"].apply_async((1,), task_id="job-B", idempotency_key="order-3")
    monkeypatch.setattr(kombu.messaging.Producer, "publish", real)
    retried = app.tasks["pub.work"].apply_async((1,), task_id="job-C", idempotency_key="order-3")
    assert retried.id == "job-C"
    assert stored(app, "job-C") is not None
    assert len(received(app, 1)) == 1


def test_a_keyed_job_a_second_publisher_was_answered_with_is_kept_when_the_first_send_fails(app, monkeypatch):
    # A client times out on A's publish (the broker is slow) and retries as B: B is answered with A's job.
    # A's send then fails; forgetting the job would leave B with the id of a job nothing holds or runs.
    import threading

    real = kombu.messaging.Producer.publish
    recorded, fail = threading.Event(), threading.Event()

    def slow_then_down(self, *args, **kwargs):
        recorded.set()
        fail.wait(30)
        raise ConnectionError("broker connection reset")

    app.conf.task_publish_retry = False
    monkeypatch.setattr(kombu.messaging.Producer, "publish", slow_then_down)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            app.tasks["pub.work"].apply_async((1,), task_id="job-A", idempotency_key="order-7")
        except BaseException as exc:  # noqa: BLE001 - kept for the assertion below
            errors.append(exc)

    publisher = threading.Thread(target=first, daemon=True)
    publisher.start()
    assert recorded.wait(30), "the first publish never reached its send"
    second = app.tasks["pub.work"].apply_async((1,), task_id="job-B", idempotency_key="order-7")
    fail.set()
    publisher.join(30)
    assert not publisher.is_alive() and len(errors) == 1
    assert second.id == "job-A"
    job = for_app(app).get("job-A")
    assert job is not None and job.status == "pending"
    monkeypatch.setattr(kombu.messaging.Producer, "publish", real)
    assert app.tasks["pub.work"].apply_async((1,), task_id="job-C", idempotency_key="order-7").id == "job-A"


def test_a_keyed_job_whose_message_went_out_keeps_its_key_when_the_task_sent_event_fails(app, monkeypatch):
    # Celery publishes the task-sent event after the task's message: a broker lost between the two fails
    # apply_async with the job already on its way. Its record and key stay, so the caller's retry under the
    # key is answered with that job instead of recording (and running) a second one.
    from celery.events.dispatcher import EventDispatcher

    def event_fails(self, type, *args, **kwargs):
        raise ConnectionResetError(f"broker lost before the {type} event")

    app.conf.task_send_sent_event = True
    with monkeypatch.context() as patched:
        patched.setattr(EventDispatcher, "publish", event_fails)
        with pytest.raises((ConnectionResetError, kombu.exceptions.OperationalError)):
            app.tasks["pub.work"].apply_async((1,), task_id="job-E", idempotency_key="order-5")
    retried = app.tasks["pub.work"].apply_async((1,), task_id="job-F", idempotency_key="order-5")
    assert retried.id == "job-E"
    assert for_app(app).get("job-F") is None
    assert [m.headers["id"] for m in received(app, 1)] == ["job-E"]


def test_a_countdown_overrides_an_eta_in_the_record_as_in_the_message(app):
    eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    result = app.tasks["pub.work"].signature((1,)).set(eta=eta).apply_async(countdown=2)
    [message] = received(app, 1)
    sent_eta = datetime.datetime.fromisoformat(message.headers["eta"])
    store = for_app(app)
    wait = store.get(result.id).available_at - store.now()
    assert (sent_eta - datetime.datetime.now(datetime.timezone.utc)).total_seconds() < 60
    assert wait < 60, f"recorded {wait:.0f}s away; the message is due in 2 s"


# Celery 5.7 deprecates the task's queue attribute (task_routes instead); it still routes by it.
@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
def test_a_task_declared_on_a_queue_is_recorded_on_that_queue_with_its_policy(broker, sqlite_url):
    url, keyprefix = broker
    app = Celery(f"pub_{unique_prefix()}", broker=url, set_as_current=False)
    app.conf.update(lease_store_url=sqlite_url, broker_transport_options={"global_keyprefix": keyprefix},
                    lease_queue_policies={"reports": {"lease_max_attempts": 9}})

    @app.task(base=LeaseTask, shared=False, name="pub.report", queue="reports")
    def report():
        return 1

    migrated_store(app)
    try:
        job = for_app(app).get(report.delay().id)
        assert (job.queue_name, job.max_attempts) == ("reports", 9)
        assert len(received(app, 1, "reports")) == 1
    finally:
        drop_app_store(app)


def test_a_routing_function_is_given_the_task_as_celery_gives_it(app):
    seen = []

    def route(name, args, kwargs, options, task=None, **kw):
        seen.append(task)
        return {"queue": task.lane}

    app.conf.task_routes = (route,)

    @app.task(base=LeaseTask, shared=False, name="pub.laned")
    def laned():
        return 1

    laned.lane = "lane"
    job = for_app(app).get(laned.delay().id)
    assert job.queue_name == "lane"
    assert laned in seen
    assert len(received(app, 1, "lane")) == 1


def test_a_canvas_member_whose_key_belongs_to_another_job_is_not_sent_and_says_why(app, caplog, monkeypatch):
    # Another test's worker may have reconfigured logging: this logger reaches caplog.
    logger = logging.getLogger("celery_lease.publish.publishing")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger=logger.name)
    work = app.tasks["pub.work"]
    holder = work.apply_async((1,), idempotency_key="order-6").id
    result = group(work.si(1).set(idempotency_key="order-6"), work.si(2)).apply_async()
    member = result.results[0].id
    action = "idempotent_canvas_member"
    warnings = {r.getMessage() for r in caplog.records if getattr(r, "action", None) == action}
    assert len(warnings) == 1 and all(holder in w and member in w for w in warnings)
    assert sorted(m.headers["id"] for m in received(app, 2)) == sorted([holder, result.results[1].id])


def test_the_task_sent_event_passes_through_unrecorded(app):
    app.conf.task_send_sent_event = True
    result = app.tasks["pub.work"].apply_async((5,))
    [message] = received(app, 1)
    assert message.headers["id"] == result.id
    assert stored(app, result.id)["headers"]["id"] == result.id


def test_a_stored_message_reads_back_as_its_signature(app):
    work = app.tasks["pub.work"]
    result = work.apply_async((1, 2), {"x": 3}, link_error=work.si(9), expires=60)
    sig = messages.decode(for_app(app).get(result.id).payload, app.conf.accept_content, result.id)
    assert (sig["task"], sig["args"], sig["kwargs"]) == ("pub.work", [1, 2], {"x": 3})
    assert sig["options"]["link_error"][0]["args"] == [9]
    assert sig["options"]["expires"]


def test_a_stored_message_for_another_task_id_is_refused_as_corrupt(app):
    result = app.tasks["pub.work"].apply_async((1,))
    payload = for_app(app).get(result.id).payload
    with pytest.raises(StoreCorrupt, match="belongs to task id"):
        messages.republish(app, "another-id", payload)


def test_task_protocol_1_records_the_signature(app):
    app.conf.task_protocol = 1
    result = app.tasks["pub.work"].apply_async((4,))
    payload = stored(app, result.id)
    assert payload["v"] == messages.PAYLOAD_VERSION
    assert messages.decode(for_app(app).get(result.id).payload, None, result.id)["args"] == [4]
    assert len(received(app, 1)) == 1


def _run_parent(app, body):
    """Run a LeaseTask whose body is ``body(work)`` through Celery's tracer, the store losing the answer
    of its first child's record (committed, an error raised); returns the parent's id and the children's."""
    from celery.app.trace import build_tracer

    from celery_lease.errors import StoreUnavailable

    work = app.tasks["pub.work"]
    store = for_app(app)

    @app.task(base=LeaseTask, bind=True, shared=False, name="pub.parent", acks_late=True)
    def parent(self):
        return body(work)

    real = store.publishes.record
    lost: list[str] = []

    def child_answer_lost(job_id, *args, **kwargs):
        outcome = real(job_id, *args, **kwargs)
        if job_id != parent_id and not lost:
            lost.append(job_id)
            raise StoreUnavailable("connection dropped before the answer")
        return outcome

    parent_id = parent.apply_async().id
    store.publishes.record = child_answer_lost
    tracer = build_tracer(parent.name, parent, app=app, eager=False, propagate=False)
    request = {"id": parent_id, "task": parent.name, "hostname": "pub@test", "headers": {}, "is_eager": False,
               "delivery_info": {"routing_key": "pub", "exchange": "", "redelivered": False}}
    try:
        tracer(parent_id, (), {}, request)
    finally:
        store.publishes.record = real
    return parent_id, [job.id for job in store.reports.list_jobs() if job.id != parent_id]


def test_a_job_published_by_a_body_the_outage_ended_is_deleted_if_its_record_landed_unanswered(app):
    # The body's outage gives it back and its next run publishes the child anew: the first child, whose
    # record committed while its answer was lost and whose message was never sent, must not also run
    # (the dispatch scan would have sent it ten minutes later).
    parent_id, child = _run_parent(app, lambda work: work.apply_async())
    assert for_app(app).get(parent_id).status == "pending"  # given back by its outage, to run again
    assert child == [], f"the unsent child {child} would run besides the one the next run publishes"


def test_a_job_a_body_was_told_is_unpublished_is_deleted_when_that_body_goes_on_and_ends(app):
    from celery_lease.errors import StoreUnavailable

    def body(work):
        try:
            work.apply_async()
        except StoreUnavailable:
            return "told it was not published"

    parent_id, child = _run_parent(app, body)
    assert for_app(app).get(parent_id).status == "completed"
    assert child == [], f"the child {child}, whose publish raised, would run ten minutes later"
    assert [m.headers["id"] for m in received(app, 1)] == [parent_id]  # the parent's own message only


def test_a_keyed_job_a_body_is_handed_after_an_unanswered_record_is_kept_and_runs(app):
    # The key answers the body's second publish with the first job: that job must not be deleted.
    from celery_lease.errors import StoreUnavailable

    handed: list[str] = []

    def body(work):
        for _ in range(2):
            try:
                handed.append(work.apply_async(idempotency_key="order-7:child").id)
                return
            except StoreUnavailable:
                continue

    parent_id, child = _run_parent(app, body)
    assert for_app(app).get(parent_id).status == "completed"
    assert child == handed and len(handed) == 1, (child, handed)


def test_a_job_published_again_under_its_id_whose_send_fails_is_deleted_when_the_body_ends(app, monkeypatch):
    import kombu.messaging

    from celery_lease.errors import StoreUnavailable

    real = kombu.messaging.Producer.publish

    def child_not_sent(self, body, *args, **kwargs):
        if (kwargs.get("headers") or {}).get("id") == "child-1":
            raise ConnectionError("broker unreachable")
        return real(self, body, *args, **kwargs)

    def body(work):
        try:
            work.apply_async(task_id="child-1")
        except StoreUnavailable:
            monkeypatch.setattr(kombu.messaging.Producer, "publish", child_not_sent)
            try:
                work.apply_async(task_id="child-1")
            except Exception:  # noqa: BLE001 - told a second time that it is not published
                return
            finally:
                monkeypatch.setattr(kombu.messaging.Producer, "publish", real)

    app.conf.task_publish_retry = False
    parent_id, child = _run_parent(app, body)
    assert for_app(app).get(parent_id).status == "completed"
    assert child == [], f"{child}, never sent by either publish, would run ten minutes later"


def test_a_job_the_body_publishes_again_under_its_id_after_an_unanswered_record_runs_once(app):
    from celery_lease.errors import StoreUnavailable

    def body(work):
        try:
            work.apply_async(task_id="child-1")
        except StoreUnavailable:
            work.apply_async(task_id="child-1")

    parent_id, child = _run_parent(app, body)
    assert for_app(app).get(parent_id).status == "completed"
    assert child == ["child-1"]
    assert sorted(m.headers["id"] for m in received(app, 2)) == sorted([parent_id, "child-1"])


def test_the_nesting_a_stored_message_carries_is_read_from_either_payload_format_and_never_unpickled():
    sent = messages.capture('[[], {}, {}]', "application/json", "utf-8",
                            {"headers": {"id": "j1", "task": "t.add", "replaced_task_nesting": 2},
                             "routing_key": "celery"})
    assert messages.nesting_of(sent) == 2
    assert messages.nesting_of(messages.capture('[[], {}, {}]', "application/json", "utf-8",
                                                {"headers": {"id": "j1", "task": "t.add"}})) == 0
    signature = messages.encode("t.add", (1,), {}, {"replaced_task_nesting": 1})
    assert messages.nesting_of(signature) == 1
    pickled = messages.encode("t.add", (1,), {}, {"replaced_task_nesting": 1}, serializer="pickle")
    assert messages.nesting_of(pickled) is None  # a claim compares; it does not unpickle
    assert messages.nesting_of(None) is None and messages.nesting_of("not json") is None
    corrupt = json.dumps({"v": messages.MESSAGE_VERSION, "headers": ["not", "a", "mapping"]})
    assert messages.nesting_of(corrupt) is None
