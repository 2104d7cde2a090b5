"""Raising LeaseLost into a running body: an OS thread, or a gevent greenlet from another thread."""

from __future__ import annotations

import threading
import time

import pytest

from celery_lease.errors import LeaseLost
from celery_lease.worker.interrupt import GreenletInterrupter, ThreadInterrupter


def test_a_thread_is_interrupted_at_its_next_bytecode():
    interrupter, caught, bound = ThreadInterrupter(), [], threading.Event()

    def body() -> None:
        interrupter.bind()
        bound.set()
        try:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                sum(range(100))
        except LeaseLost as exc:
            caught.append(exc)

    worker = threading.Thread(target=body)
    worker.start()
    bound.wait(5)
    interrupter.interrupt(LeaseLost("job-1", "taken_over", "other:1"), lambda: True)
    worker.join(10)
    [exc] = caught
    assert (exc.job_id, exc.reason, exc.owner) == ("job-1", "taken_over", "other:1")


def test_a_greenlet_is_interrupted_from_a_real_thread_through_its_hub():
    gevent = pytest.importorskip("gevent")
    interrupter, caught = GreenletInterrupter(), []

    def body() -> None:
        interrupter.bind()
        try:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                gevent.sleep(0.01)
        except LeaseLost as exc:
            caught.append(exc)

    greenlet = gevent.spawn(body)
    gevent.sleep(0.05)
    lost = LeaseLost("job-1", "local deadline")
    timer = threading.Thread(target=interrupter.interrupt, args=(lost, lambda: True))
    timer.start()
    timer.join(5)
    greenlet.join(timeout=5)
    assert [exc.reason for exc in caught] == ["local deadline"]


def test_a_greenlet_whose_body_is_over_is_left_alone():
    gevent = pytest.importorskip("gevent")
    interrupter, finished = GreenletInterrupter(), []

    def body() -> None:
        interrupter.bind()
        gevent.sleep(0.1)
        finished.append(True)

    greenlet = gevent.spawn(body)
    gevent.sleep(0.02)
    interrupter.interrupt(LeaseLost("job-1", "late"), lambda: False)  # the body already left
    greenlet.join(timeout=5)
    assert finished == [True]
