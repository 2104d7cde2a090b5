"""Raising LeaseLost into a running body (an OS thread, or a gevent greenlet from another thread), and
Celery's soft time limit held while a run is outside its body."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded

import celery_lease.worker.interrupt as interrupt
from celery_lease.errors import LeaseLost
from celery_lease.worker.interrupt import GreenletInterrupter, ThreadInterrupter, soft_limit_held


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


# Run in a process of its own: the interpreter state it checks is process-wide.
AFTER_AN_INTERRUPTION = textwrap.dedent("""
    import sys, threading, time
    from celery_lease.errors import LeaseLost
    from celery_lease.worker.interrupt import ThreadInterrupter

    def run(landing):
        interrupter, ready, sent = ThreadInterrupter(), threading.Event(), threading.Event()

        def body():
            interrupter.bind()
            ready.set()
            try:
                if landing:
                    while True:
                        sum(range(100))
                sent.wait(10)
            except LeaseLost:
                pass
            interrupter.cancel()

        worker = threading.Thread(target=body)
        worker.start()
        ready.wait(10)
        if landing:
            interrupter.interrupt(LeaseLost("job-1", "lost", None), lambda: True)
        sent.set()
        worker.join(10)

    run(landing=True)   # an interruption that landed, then the body's end cancels
    run(landing=False)  # nothing sent, the body's end cancels
    sys.setprofile(lambda *args: None)
    (lambda: None)()
    sys.setprofile(None)
    print("ran on")
""")


def test_cancelling_after_an_interruption_leaves_the_process_able_to_run_under_a_profiler():
    # A cancel that cleared through the C API left the interpreter's pending flag set for good:
    # every call took the slow path, and the first call under a profiler never returned.
    done = subprocess.run([sys.executable, "-c", AFTER_AN_INTERRUPTION], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran on"


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


@pytest.fixture
def billiard_soft_limit():
    """SIGUSR1 handled as in a prefork child: billiard's handler raises SoftTimeLimitExceeded."""
    from billiard.pool import soft_timeout_sighandler

    before = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    yield
    signal.signal(signal.SIGUSR1, before)


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(10_000):  # bytecode for the Python handler to run in
        pass


def test_a_soft_time_limit_held_outside_the_body_lands_as_the_body_starts(billiard_soft_limit):
    with soft_limit_held("job-1", enabled=True) as soft:
        _signal_self()  # in the claim: held
        with pytest.raises(SoftTimeLimitExceeded):
            soft.release()  # the body starts
        soft.hold()  # the body ended: the settle's writes are held again
        _signal_self()
    with pytest.raises(SoftTimeLimitExceeded):  # billiard's handler is back
        _signal_self()


def test_a_soft_time_limit_after_the_body_ended_is_logged_not_raised(billiard_soft_limit, caplog):
    # The level is this logger's own: a test earlier in the session may leave the root logger at ERROR.
    with caplog.at_level(logging.WARNING, logger=interrupt.__name__), \
            soft_limit_held("job-2", enabled=True) as soft:
        soft.release()
        soft.hold()
        _signal_self()
    assert [r.action for r in caplog.records if r.name == interrupt.__name__] == ["soft_limit_held"]
    assert "after the body ended" in caplog.text


def test_a_soft_limit_hold_leaves_a_signal_that_is_not_billiards_alone():
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with soft_limit_held("job-3", enabled=True):
            _signal_self()
            assert seen == [signal.SIGUSR1]  # a gevent or threads worker's own SIGUSR1 handler still runs
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_soft_limit_held_again_after_its_run_ended_leaves_billiards_handler_in_place(billiard_soft_limit):
    """A body's context closed late by the garbage collector holds again after the run: nothing is held, or
    every later task in the child would ignore its soft time limit."""
    from billiard.pool import soft_timeout_sighandler

    with soft_limit_held("job-4", enabled=True) as soft:
        soft.release()
    soft.hold()
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler
    with pytest.raises(SoftTimeLimitExceeded):
        _signal_self()


def test_an_eager_runs_soft_limit_is_not_held_so_its_callers_time_limit_still_lands(billiard_soft_limit):
    with pytest.raises(SoftTimeLimitExceeded), soft_limit_held("job-5", enabled=False):
        _signal_self()
