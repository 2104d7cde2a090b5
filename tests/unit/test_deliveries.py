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
