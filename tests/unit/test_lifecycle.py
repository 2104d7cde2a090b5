"""The run lifecycle (an eager run's retry), and how far one delivery travels through the library: the
modules it enters and how often control leaves the lifecycle module (celery_lease/worker/lifecycle.py),
measured under ``sys.setprofile``.

The path measured is a prefork child's: the claim succeeds and the body returns. The bounds are the
figures of today's code (13 modules, 6 departures: the settle step is part of the lifecycle module, so its
two calls out count), so a change that spreads a delivery over more modules, or adds a crossing out of the
lifecycle, fails here and says where the path went. The layering's target is 8 modules and 6 departures:
the departures meet it; the modules do not (the store's engine, audited writes, dialect, statements and
rows are modules of their own), and each change that reaches closer lowers the bound. A delivery after
the first reads its policy, claim terms and store from the runtime; an app whose store follows a Django
database still looks the store up on every delivery (config, app_state and the store package: 16).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

import kombu.exceptions
import kombu.messaging
import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Reject
from celery.signals import before_task_publish, task_postrun

from celery_lease import LeaseTask
from celery_lease.errors import StoreRejected, StoreUnavailable
from celery_lease.messaging import messages
from celery_lease.reaper.run import Reaper
from celery_lease.store import ClaimTerms, Store, for_app
from celery_lease.vocabulary import Status
from celery_lease.worker import runtime
from tests.conftest import unique_prefix
from tests.helpers import wait_for

LIFECYCLE = "celery_lease.worker.lifecycle"
# Today's figures (see the module docstring).
MAX_MODULES = 13
MAX_DEPARTURES = 6


@pytest.fixture
def leased_add(tmp_path) -> Any:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery(f"path_{unique_prefix()}", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=url, lease_duration=30.0)

    @app.task(base=LeaseTask, bind=True, name="path.add", acks_late=True, shared=False)
    def add(self: Any, a: int, b: int) -> int:
        return a + b

    app.finalize()
    Store(url).migrate()
    return add


def _deliver_once(task: Any, job_id: str) -> Any:
    """Run one delivery of ``job_id`` as a prefork child's tracer does; Celery's (result, info)."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    request = {"id": job_id, "task": task.name, "hostname": "path@test", "headers": {}, "is_eager": False,
               "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
    return tracer(job_id, (), {}, request)


def _deliver(task: Any, profile: Any = None) -> tuple[str, Any]:
    """Publish one job, then run its delivery as a prefork child's tracer does."""
    job_id = task.apply_async((1, 2)).id
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=True)
    request = {"id": job_id, "task": task.name, "hostname": "path@test", "headers": {}, "is_eager": False,
               "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
    sys.setprofile(profile)
    try:
        value = tracer(job_id, (1, 2), {}, request)[0]
    finally:
        sys.setprofile(None)
    return job_id, value


def test_one_delivery_enters_no_more_library_modules_and_leaves_the_lifecycle_no_more_often(leased_add):
    _deliver(leased_add)  # the first delivery sets up the process's runtime; it is not measured
    entered: Counter[str] = Counter()
    departures: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("celery_lease"):
            return
        entered[module] += 1
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller == LIFECYCLE and module != LIFECYCLE:
            departures.append(f"{module}.{frame.f_code.co_name}")

    # In a thread of its own, joined with a deadline: a delivery that never ends fails here rather
    # than hanging the suite.
    measured: list[tuple[str, Any]] = []
    runner = threading.Thread(target=lambda: measured.append(_deliver(leased_add, profile)), daemon=True)
    runner.start()
    runner.join(60)
    assert measured, "the measured delivery did not end within 60 s"
    job_id, value = measured[0]

    assert value == 3
    job = Store(leased_add.app.conf.lease_store_url).get(job_id)
    assert job is not None and job.status == Status.COMPLETED
    assert LIFECYCLE in entered, "the delivery did not run through the lifecycle module"
    assert len(entered) <= MAX_MODULES, f"{len(entered)} modules entered: {sorted(entered)}"
    assert len(departures) <= MAX_DEPARTURES, f"{len(departures)} departures from the lifecycle: {departures}"


def test_a_failure_that_landed_sends_its_dead_letter_once_the_store_answers_whatever_the_lease(tmp_path):
    # The failure is written, then the store stops answering before the dead letter's read: the run's lease
    # passes its local deadline meanwhile. The dead letter is kept and sent once the store answers, not lost
    # with the lease (the failure no longer needs it).
    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery(f"dlq_{unique_prefix()}", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=url, lease_duration=3.0, lease_heartbeat_interval=1.0,
                    lease_max_attempts=1, lease_dead_letter_queue=f"dlq_{unique_prefix()}")

    @app.task(base=LeaseTask, bind=True, name="path.boom", acks_late=True, shared=False)
    def boom(self: Any) -> None:
        raise ValueError("boom")

    app.finalize()
    Store(url).migrate()
    store = for_app(app)
    real_get, down = store.get, threading.Event()

    def get(job_id: str) -> Any:
        if down.is_set():
            raise StoreUnavailable("no answer (injected)")
        return real_get(job_id)

    real_fail = store.jobs.fail

    def fail(*args: Any, **kwargs: Any) -> bool:
        written = real_fail(*args, **kwargs)
        down.set()  # the failure landed; the store goes away before its dead letter is read
        return written

    store.get, store.jobs.fail = get, fail
    job_id = boom.apply_async().id
    _deliver_once(boom, job_id)
    assert Store(url).get(job_id).status == Status.FAILED
    down.clear()
    runtime.current(app).kept_writes.flush()
    with app.connection_for_write() as conn:
        message = conn.SimpleQueue(app.conf.lease_dead_letter_queue, no_ack=True).get(timeout=5)
    assert message.headers["id"] == job_id
    assert "dead_letter_published" in [e["event"] for e in Store(url).reports.events(job_id)]


@pytest.mark.parametrize("ending", ["raised", "rejected"])
def test_a_final_failure_the_store_refuses_to_record_ends_failed_and_celery_sees_the_bodys_error(
        tmp_path, ending):
    # The body's error cannot be written (too long for a column, a text the driver refuses): the job must
    # still end, or the reaper would run the failed body again once its lease, no longer renewed, expired.
    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery(f"refused_{unique_prefix()}", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=url, lease_duration=30.0, lease_max_attempts=1)

    @app.task(base=LeaseTask, bind=True, name="path.refused", acks_late=True, shared=False)
    def refused(self: Any) -> None:
        if ending == "rejected":
            raise Reject("not for us", requeue=False)
        raise ValueError("boom")

    app.finalize()
    Store(url).migrate()
    store = for_app(app)
    real_fail, refusals = store.jobs.fail, []

    def fail(job_id: str, token: str, error: str, *args: Any, **kwargs: Any) -> bool:
        if not refusals:
            refusals.append(error)
            raise StoreRejected("lease store refused a statement (data: injected)")
        return real_fail(job_id, token, error, *args, **kwargs)

    store.jobs.fail = fail
    job_id = refused.apply_async().id
    retval = _deliver_once(refused, job_id)[0]
    job = Store(url).get(job_id)
    assert refusals and job.status == Status.FAILED
    assert "the store refused" in (job.last_error or "")
    raised = getattr(retval, "exception", retval)
    raised = getattr(raised, "exc", raised)  # a Reject reaches Celery's tracer wrapped with its traceback
    assert isinstance(raised, Reject if ending == "rejected" else ValueError), repr(retval)


@pytest.mark.parametrize("ending", ["retry", "reject_requeue"])
def test_a_checkpoint_held_back_by_an_outage_is_written_before_an_end_that_runs_the_job_again(
        tmp_path, ending):
    # The checkpoint meets a blip and is kept for the heartbeat; the store answers again and the body ends
    # (a retry, a requeue) before the heartbeat's next round: the next attempt must resume from that progress.
    url = f"sqlite:///{tmp_path / 'store.db'}"
    app = Celery(f"cp_{unique_prefix()}", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(lease_store_url=url, lease_duration=60.0, lease_heartbeat_interval=20.0)
    down = threading.Event()

    @app.task(base=LeaseTask, bind=True, name="path.step", acks_late=True, shared=False, max_retries=3)
    def step(self: Any) -> None:
        wait_for(lambda: runtime.current(app).heartbeat.beats >= 1, timeout=10, message="no first round")
        down.set()
        self.lease.checkpoint({"done": 500})  # kept: the store does not answer
        down.clear()
        assert self.lease.pending_checkpoint == ({"done": 500},)
        if ending == "retry":
            raise self.retry(countdown=60)
        raise Reject("try again", requeue=True)

    app.finalize()
    Store(url).migrate()
    store = for_app(app)
    real_checkpoint = store.jobs.checkpoint

    def checkpoint(*args: Any, **kwargs: Any) -> bool:
        if down.is_set():
            raise StoreUnavailable("no answer (injected)")
        return real_checkpoint(*args, **kwargs)

    store.jobs.checkpoint = checkpoint
    job_id = step.apply_async().id
    _deliver_once(step, job_id)
    job = Store(url).get(job_id)
    assert job.status == Status.PENDING and job.checkpoint_state() == {"done": 500}


def test_an_eager_run_with_a_store_retries_at_once_as_celerys_apply_does(tmp_path):
    app = Celery(f"eager_{unique_prefix()}", broker="memory://", set_as_current=False)
    app.conf.update(lease_eager_store=True, lease_store_url=f"sqlite:///{tmp_path / 'store.db'}")
    attempts: list[int] = []

    @app.task(base=LeaseTask, bind=True, name="path.flaky", shared=False, max_retries=2)
    def flaky(self: Any) -> str:
        attempts.append(self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=60)  # the countdown an eager apply() does not wait for
        return "ok"

    Store(app.conf.lease_store_url).migrate()
    result = flaky.apply(task_id="eager-retry")
    assert (result.state, result.result, attempts) == ("SUCCESS", "ok", [0, 1])
    assert Store(app.conf.lease_store_url).get("eager-retry").status == Status.COMPLETED


def test_what_a_body_sets_on_its_request_reaches_celerys_tracer_as_a_plain_tasks_does(leased_add):
    """A body that stops its chain and its callbacks, starts a child and marks its request: Celery's tracer
    and its signals read the same request (the body does not run under a copy)."""
    app, add = leased_add.app, leased_add

    @app.task(base=LeaseTask, bind=True, name="path.steers", shared=False)
    def steers(self: Any, a: int) -> int:
        self.request.spawned = add.delay(a, 1).id
        self.request.chain = None
        self.request.callbacks = None
        self.request.marked = "by the body"
        return a

    sent: list[str] = []
    seen: list[Any] = []

    def on_publish(headers: Any = None, **_: Any) -> None:
        sent.append(headers["id"])

    def on_postrun(task: Any = None, **_: Any) -> None:
        if task is steers:
            seen.append(getattr(task.request, "marked", None))

    before_task_publish.connect(on_publish, weak=False)
    task_postrun.connect(on_postrun, weak=False)
    try:
        job_id = steers.apply_async((5,)).id
        step, link = add.s(10).set(task_id="step-after"), add.s(20).set(task_id="linked-after")
        tracer = build_tracer(steers.name, steers, app=app, eager=False, propagate=True)
        request = {"id": job_id, "task": steers.name, "hostname": "path@test", "headers": {},
                   "is_eager": False, "chain": [dict(step)], "callbacks": [dict(link)],
                   "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
        assert tracer(job_id, (5,), {}, request)[0] == 5
    finally:
        before_task_publish.disconnect(on_publish)
        task_postrun.disconnect(on_postrun)
    assert "step-after" not in sent and "linked-after" not in sent, sent
    assert seen == ["by the body"]
    [child] = [c.id for c in steers.AsyncResult(job_id).children or []]
    assert child in sent
    eager = steers.apply((6,))
    assert eager.get() == 6 and seen[-1] == "by the body"


@pytest.mark.parametrize("then", ["returns", "raises"])
def test_a_body_that_retries_without_raising_ends_as_a_plain_tasks_and_its_retry_goes_once(leased_add, then):
    """``retry(throw=False)`` then the body's own end: Celery stores that end (SUCCESS, or the body's
    error), the job waits for its retry's message, and no other copy of the message is sent."""
    app = leased_add.app

    @app.task(base=LeaseTask, bind=True, name=f"path.retries_{then}", shared=False, max_retries=3)
    def retries(self: Any) -> str:
        self.retry(countdown=60, throw=False)
        if then == "raises":
            raise ValueError("after the retry")
        return "first"

    sent: list[str] = []

    def on_publish(headers: Any = None, **_: Any) -> None:
        sent.append(headers["id"])

    before_task_publish.connect(on_publish, weak=False)
    try:
        job_id = retries.apply_async().id
        tracer = build_tracer(retries.name, retries, app=app, eager=False, propagate=False)
        request = {"id": job_id, "task": retries.name, "hostname": "path@test", "headers": {},
                   "is_eager": False, "delivery_info": {"routing_key": "celery", "exchange": "",
                                                        "redelivered": False}}
        outcome = tracer(job_id, (), {}, request)
    finally:
        before_task_publish.disconnect(on_publish)
    state = retries.AsyncResult(job_id).state
    assert (state, outcome[0] if then == "returns" else type(outcome[0].exception).__name__) == (
        ("SUCCESS", "first") if then == "returns" else ("FAILURE", "ValueError"))
    assert sent.count(job_id) == 2  # its publish and its retry's
    assert Store(app.conf.lease_store_url).get(job_id).status == Status.PENDING


def queued(app: Celery) -> list[tuple[str, str, int]]:
    """Take every message waiting in the app's default queue: (id, task, replaced_task_nesting) each."""
    found = []
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("celery", no_ack=True)
        while True:
            try:
                headers = queue.get(timeout=0.1).headers
            except queue.Empty:
                return found
            found.append((headers.get("id"), headers.get("task"), headers.get("replaced_task_nesting") or 0))


@pytest.mark.skipif(not messages.NESTING_CARRIED,
                    reason="this Celery's messages do not carry replaced_task_nesting")
def test_a_copy_of_a_replaced_runs_message_never_runs_its_body_again_nor_strands_its_replacement(leased_add):
    """A second copy of a replaced job's message (an outage's re-send, a give-back's) delivered after the
    replacement took the row: the replaced body does not run again, the replacement's message goes out once
    more (its first may have been lost with the hand-over's answer), and the replacement runs."""
    app, add = leased_add.app, leased_add
    ran: list[str] = []

    @app.task(base=LeaseTask, bind=True, name="path.replaced", shared=False, acks_late=True)
    def replaced(self: Any) -> int:
        ran.append(self.request.id)
        raise self.replace(add.si(2, 3))

    def deliver(task: Any, job_id: str, args: tuple, nesting: int) -> Any:
        tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
        request = {"id": job_id, "task": task.name, "hostname": "path@test", "headers": {}, "is_eager": False,
                   "replaced_task_nesting": nesting,
                   "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
        return tracer(job_id, args, {}, request)[0]

    queued(app)  # what earlier tests of this process left in the in-memory broker
    job_id = replaced.apply_async().id
    assert queued(app) == [(job_id, replaced.name, 0)]
    deliver(replaced, job_id, (), 0)  # replaced: the row now waits for the carrier
    assert queued(app) == [(job_id, add.name, 1)]
    deliver(replaced, job_id, (), 0)  # the copy
    store = Store(app.conf.lease_store_url)
    assert ran == [job_id]
    assert queued(app) == [(job_id, add.name, 1)]
    assert store.get(job_id).status == Status.PENDING
    assert deliver(add, job_id, (2, 3), 1) == 5
    assert store.get(job_id).status == Status.COMPLETED


def test_with_task_protocol_1_a_replacement_runs_though_its_message_carries_no_nesting(leased_add):
    """Protocol 1 messages drop replaced_task_nesting: the replacement's delivery reads 0, as a copy of the
    replaced run's would, and must still run (it is the job's only way on)."""
    app, add = leased_add.app, leased_add
    app.conf.task_protocol = 1

    @app.task(base=LeaseTask, bind=True, name="path.replaced_v1", shared=False, acks_late=True)
    def replaced(self: Any) -> int:
        raise self.replace(add.si(2, 3))

    def deliver(task: Any, job_id: str, args: tuple) -> Any:
        tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
        request = {"id": job_id, "task": task.name, "hostname": "path@test", "headers": {}, "is_eager": False,
                   "delivery_info": {"routing_key": "celery", "exchange": "", "redelivered": False}}
        return tracer(job_id, args, {}, request)[0]

    queued(app)  # what earlier tests of this process left in the in-memory broker
    try:
        job_id = replaced.apply_async().id
        deliver(replaced, job_id, ())
        assert deliver(add, job_id, (2, 3)) == 5
        assert Store(app.conf.lease_store_url).get(job_id).status == Status.COMPLETED
    finally:
        queued(app)  # protocol 1 messages (no id header) are not for the next test of this process


def test_an_eager_run_with_a_store_returns_what_its_replacement_returns(tmp_path):
    """Celery's eager replace() applies the replacement in the replaced body and returns its value: with the
    store on, the replacement (same id) runs rather than meeting the replaced run's own lease."""
    app = Celery(f"eager_{unique_prefix()}", broker="memory://", set_as_current=False)
    app.conf.update(lease_eager_store=True, lease_store_url=f"sqlite:///{tmp_path / 'store.db'}")

    @app.task(base=LeaseTask, shared=False, name="eager.add")
    def add(a: int, b: int) -> int:
        return a + b

    @app.task(base=LeaseTask, bind=True, shared=False, name="eager.replaced")
    def replaced(self: Any) -> int:
        return self.replace(add.si(2, 3))  # eager: Celery returns the replacement's value

    Store(app.conf.lease_store_url).migrate()
    result = replaced.apply(task_id="eager-replaced")
    assert (result.state, result.result) == ("SUCCESS", 5)
    assert Store(app.conf.lease_store_url).get("eager-replaced").status == Status.COMPLETED


def _refusing_the_first_retry(monkeypatch: Any, then: Any = None) -> list[str]:
    """The broker refuses the first retry's message it is handed (``then`` runs first): the ids refused."""
    real, refused = kombu.messaging.Producer.publish, []

    def publish(self: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or {}
        if headers.get("retries") and not refused:
            refused.append(headers["id"])
            if then is not None:
                then(headers["id"])
            raise kombu.exceptions.OperationalError("the broker refused the message (injected)")
        return real(self, body, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging.Producer, "publish", publish)
    return refused


def _retries_once(app: Celery, name: str, runs: list[str]) -> Any:
    """A task whose first run calls retry(); every later run returns."""
    @app.task(base=LeaseTask, bind=True, name=name, shared=False, acks_late=True, max_retries=3)
    def retries_once(self: Any) -> str:
        runs.append(self.request.id)
        if len(runs) == 1:
            raise self.retry(countdown=0)
        return "ok"

    return retries_once


def _rejected(outcome: Any) -> bool:
    """Whether Celery's tracer ended the delivery with Celery's Reject, as it shows a plain task's."""
    raised = getattr(outcome[0], "exception", outcome[0])
    return isinstance(getattr(raised, "exc", raised), Reject)


def test_a_retry_whose_message_the_broker_refuses_fails_the_job_and_its_body_never_runs_again(
        leased_add, monkeypatch):
    """Plain Celery ends such a run with a final Reject (FAILURE, errbacks): the job is failed, and no message
    of it goes out again, from the settle step or from the reaper's dispatch scan."""
    app, runs = leased_add.app, []
    task = _retries_once(app, "path.retry_refused", runs)
    refused = _refusing_the_first_retry(monkeypatch)
    queued(app)  # what earlier tests of this process left in the in-memory broker
    job_id = task.apply_async().id
    assert queued(app) == [(job_id, task.name, 0)]  # taken here: delivered by hand
    assert _rejected(_deliver_once(task, job_id))
    store = Store(app.conf.lease_store_url)
    assert refused == [job_id] and store.get(job_id).status == Status.FAILED
    reaped = Reaper(app).run_once(now=store.now() + 3600)  # past any dispatch wait
    for found, _, _ in queued(app):
        _deliver_once(task, found)
    assert (runs, reaped.redispatched, store.get(job_id).status) == ([job_id], 0, Status.FAILED)


def test_a_job_failed_by_its_refused_retry_sends_its_dead_letter(leased_add, monkeypatch):
    app, runs = leased_add.app, []
    app.conf.lease_dead_letter_queue = f"dlq_{unique_prefix()}"
    task = _retries_once(app, "path.retry_refused_dlq", runs)
    _refusing_the_first_retry(monkeypatch)
    queued(app)
    job_id = task.apply_async().id
    queued(app)
    _deliver_once(task, job_id)
    with app.connection_for_write() as conn:
        message = conn.SimpleQueue(app.conf.lease_dead_letter_queue, no_ack=True).get(timeout=5)
    events = [e["event"] for e in Store(app.conf.lease_store_url).reports.events(job_id)]
    assert message.headers["id"] == job_id and "dead_letter_published" in events


def test_a_refused_retry_whose_job_was_claimed_since_is_left_to_that_claim_and_nothing_is_sent(
        leased_add, monkeypatch):
    """Another worker took the pending retry (and gave it back) before the settle step: the row is no longer
    this run's retry, so it is neither failed nor sent again by this run."""
    app, runs = leased_add.app, []
    task = _retries_once(app, "path.retry_refused_taken", runs)
    store = for_app(app)
    terms = ClaimTerms(duration=30.0, grace=0.0, max_attempts=5, max_expirations=5, takeover=False)

    def taken_and_given_back(job_id: str) -> None:
        assert store.jobs.claim(job_id, "other@test", "f" * 32, terms, task_name=task.name, queue="celery",
                                payload=lambda: None).claimed
        assert store.jobs.release(job_id, "f" * 32, "other@test")

    _refusing_the_first_retry(monkeypatch, then=taken_and_given_back)
    queued(app)
    job_id = task.apply_async().id
    queued(app)
    assert _rejected(_deliver_once(task, job_id))
    job = Store(app.conf.lease_store_url).get(job_id)
    assert (job.status, job.locked_by, queued(app)) == (Status.PENDING, None, [])


def test_a_refused_retrys_failure_the_store_cannot_take_is_written_once_it_answers_and_nothing_is_sent(
        leased_add, monkeypatch):
    app, runs = leased_add.app, []
    task = _retries_once(app, "path.retry_refused_outage", runs)
    _refusing_the_first_retry(monkeypatch)
    store, down = for_app(app), threading.Event()
    real_fail = store.jobs.fail_unsent_retry

    def fail_unsent_retry(*args: Any, **kwargs: Any) -> bool:
        if down.is_set():
            raise StoreUnavailable("no answer (injected)")
        return real_fail(*args, **kwargs)

    store.jobs.fail_unsent_retry = fail_unsent_retry
    queued(app)
    job_id = task.apply_async().id
    queued(app)
    down.set()
    assert _rejected(_deliver_once(task, job_id))  # what Celery sees does not wait for the store
    assert Store(app.conf.lease_store_url).get(job_id).status == Status.PENDING
    down.clear()
    runtime.current(app).flush_deferred()
    assert Store(app.conf.lease_store_url).get(job_id).status == Status.FAILED
    assert (runs, queued(app)) == ([job_id], [])


def test_a_body_that_rejects_after_a_retry_whose_message_went_out_leaves_that_retry_to_run(leased_add):
    """retry(throw=False) sent its message, then the body raises its own Reject: as in plain Celery, this
    delivery ends rejected and the retry runs; only a retry whose own message was refused fails the job."""
    app, runs = leased_add.app, []

    @app.task(base=LeaseTask, bind=True, name="path.rejects_after_retry", shared=False, acks_late=True,
              max_retries=3)
    def rejects(self: Any) -> str:
        runs.append(self.request.id)
        if len(runs) == 1:
            self.retry(countdown=0, throw=False)
            raise Reject("not this delivery", requeue=False)
        return "ok"

    queued(app)
    job_id = rejects.apply_async().id
    queued(app)
    assert _rejected(_deliver_once(rejects, job_id))
    store = Store(app.conf.lease_store_url)
    assert store.get(job_id).status == Status.PENDING
    waiting = [found for found, _, _ in queued(app)]
    assert job_id in waiting
    for found in waiting:
        _deliver_once(rejects, found)
    assert (runs, store.get(job_id).status) == ([job_id, job_id], Status.COMPLETED)
