"""deliveries.py: a delivery whose body does not run is audited, sent again or given back, never failed."""

from __future__ import annotations

import logging

import pytest
from celery.exceptions import Ignore, Reject

from celery_lease import deliveries
from celery_lease.errors import StoreUnavailable


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
    caplog.set_level(logging.WARNING, logger="celery_lease.deliveries")
    # Ignore, not StoreUnavailable: a raised error would make Celery write FAILURE over the real run.
    with pytest.raises(Ignore):
        deliveries.skip_duplicate(Task(), DownStore(), "me:1", "busy", Job())
    assert "audit event duplicate_delivery_skipped not written" in caplog.text


class BrokerDownSignature:
    def apply_async(self):
        raise ConnectionError("broker unreachable")


class BrokerDownTask(Task):
    def signature_from_request(self, request, countdown=None):
        self.countdown = countdown
        return BrokerDownSignature()


def test_fail_closed_with_the_broker_down_too_rejects_the_message_back_to_the_queue(caplog):
    task = BrokerDownTask()
    with pytest.raises(Reject) as info:
        deliveries.fail_closed(task, 5.0, StoreUnavailable("lease store unreachable"))
    assert info.value.requeue is True and task.countdown == 5.0
    assert "cannot re-send" in caplog.text


# -- finishing what a crash interrupted ----------------------------------------------------
@pytest.fixture
def results_app():
    from celery import Celery

    app = Celery("kept", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(name="kept.task", bind=True)
    def kept(self):
        return None

    yield app, kept
    app.close()


class KeptStore:
    """A completed job's kept result, and the audit events written."""

    def __init__(self, kept):
        self.kept, self.written = kept, []

    def kept_result(self, job_id):
        return self.kept

    def event(self, job_id, event, *args, **kwargs):
        self.written.append(str(event))


class CompletedJob:
    id, status, locked_by = "job-1", "completed", None


def test_a_result_is_kept_only_when_celery_stores_results(results_app):
    from celery.backends.base import DisabledBackend

    app, task = results_app
    task.push_request(id="job-1")
    try:
        assert deliveries.keepable_result(task, {"total": 3}) is not None
        task.request.ignore_result = True
        assert deliveries.keepable_result(task, {"total": 3}) is None
        task.request.ignore_result = False
        task.backend = DisabledBackend(app)
        assert deliveries.keepable_result(task, {"total": 3}) is None
    finally:
        task.pop_request()


def test_a_completed_job_without_a_stored_result_resumes_with_the_kept_one(results_app):
    _, task = results_app
    task.push_request(id="job-1", delivery_info={})
    try:
        store = KeptStore(deliveries.keepable_result(task, {"total": 3}))
        assert deliveries.resume_post_run(task, store, "me:1", CompletedJob()) == (True, {"total": 3})
        assert store.written == ["post_run_resumed"]
        task.backend.mark_as_done("job-1", {"total": 3})
        assert deliveries.resume_post_run(task, store, "me:1", CompletedJob()) == (False, None)
        assert store.written == ["post_run_resumed"]  # a stored result: an ordinary duplicate
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
    assert deliveries.ignores_result(task, Context(id="j")) is False
    assert deliveries.ignores_result(task, Context(id="j", ignore_result=True)) is True
    task.ignore_result = True
    try:
        assert deliveries.ignores_result(task, Context(id="j")) is True
        assert deliveries.ignores_result(task, Context(id="j", ignore_result=False)) is False
    finally:
        task.ignore_result = False
