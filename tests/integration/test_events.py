"""What Flower sees of leased jobs: Celery's own event state fed by real ``-E`` workers' events.

Each test builds ``celery.events.state.State`` (what Flower is built on) from the event stream
of Redis db 7 while real worker subprocesses and the reaper move a job, and asserts what that
state says of the job: the reaper's dead letter is a FAILURE with its reason, a requeue or a
release shows as a retry, a duplicate delivery changes nothing.
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.events.state import State

from celery_lease.messaging import events, messages
from celery_lease.ops import recovery
from celery_lease.store import COMPLETED, FAILED, PENDING, ClaimTerms
from tests.helpers import wait_for
from tests.reaper_env import APP, ReaperEnv, reaper_loop
from tests.workers import celery_processes, worker

pytestmark = pytest.mark.integration

EVENTS = {"worker_send_task_events": True}
MARKER = "lease-test-marker"
TERMS = ClaimTerms(duration=30.0, grace=0.5, max_attempts=3, max_expirations=3, takeover=True)
OWNER = "gone@nowhere:1"


class Monitor:
    """A thread that feeds every event of the broker into a ``State``, as Flower does."""

    def __init__(self, app: Any) -> None:
        self.app, self.state = app, State()
        self.seen: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on(self, event: dict[str, Any]) -> None:
        self.seen.append(event)
        self.state.event(event)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def mark(self) -> None:
        """Send a marker and wait for it: every event the broker took before it has arrived."""
        token = uuid.uuid4().hex
        with self.app.events.default_dispatcher(hostname="test@monitor") as d:
            d.send(MARKER, token=token)
        wait_for(lambda: any(e.get("token") == token for e in self.seen), timeout=10,
                 message="the monitor never saw its own marker")

    def of(self, job_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("uuid") == job_id and (kind is None or e["type"] == kind)]

    def task(self, job_id: str) -> Any:
        return self.state.tasks.get(job_id)

    def __enter__(self) -> Monitor:
        self._thread.start()
        wait_for(lambda: self._receiver is not None, timeout=10, message="monitor never connected")
        # The receiver's queue is bound once its first marker comes back.
        for _ in range(50):
            try:
                self.mark()
                break
            except AssertionError:
                continue
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(5)


@pytest.fixture
def monitor(renv: ReaperEnv) -> Iterator[Monitor]:
    with Monitor(renv.app(**EVENTS)) as seen:
        yield seen


def events_worker(renv: ReaperEnv, conf: dict, tmp_path) -> Any:
    """A prefork worker of the reaper app that sends task events (``-E``), with ``conf`` in its env."""
    return worker(APP, renv.env(**conf), tmp_path, pool="prefork", extra=("-E",))


def started(renv: ReaperEnv, monitor: Monitor, job_id: str) -> None:
    wait_for(lambda: renv.count(job_id, "started") >= 1 and monitor.task(job_id) is not None
             and monitor.task(job_id).state == "STARTED", timeout=30, message=f"job {job_id} never started")


def test_a_job_the_reaper_dead_letters_shows_failure_with_its_reason(renv, monitor, tmp_path):
    conf = {**EVENTS, "lease_max_attempts": 1}
    app = renv.app(**conf)
    with celery_processes(tmp_path) as procs:
        proc = events_worker(renv, conf, tmp_path)
        procs.append(proc)
        job = app.tasks["reaper_app.work"].delay(60.0)
        started(renv, monitor, job.id)
        proc.kill()  # the whole worker: nobody but the reaper can end the job now
        with reaper_loop(app):
            wait_for(lambda: renv.status(job.id) == FAILED, timeout=20, message="job never dead-lettered")
            wait_for(lambda: monitor.of(job.id, "task-failed"), timeout=10, message="no task-failed")
    task = monitor.task(job.id)
    assert task.state == "FAILURE"
    assert "max attempts reached" in task.exception
    [failed] = monitor.of(job.id, "task-failed")
    assert failed["hostname"] == events.node(events.REAPER) and failed["attempt"] == 1
    assert failed["reason"] == renv.store.get(job.id).last_error


def test_a_job_the_reaper_requeues_shows_the_retry_then_its_success(renv, monitor, tmp_path):
    app = renv.app(**EVENTS)
    with celery_processes(tmp_path) as procs:
        first = events_worker(renv, EVENTS, tmp_path)
        procs.append(first)
        job = app.tasks["reaper_app.work"].delay(60.0)
        started(renv, monitor, job.id)
        first.kill()
        with reaper_loop(app):
            wait_for(lambda: monitor.of(job.id, "task-retried"), timeout=20, message="no task-retried")
        assert monitor.task(job.id).state == "RETRY"
        procs.append(events_worker(renv, EVENTS, tmp_path))
        wait_for(lambda: monitor.task(job.id).state == "SUCCESS", timeout=30, message="rerun never succeeded")
    [retried] = monitor.of(job.id, "task-retried")
    assert retried["hostname"] == events.node(events.REAPER)
    assert retried["attempt"] == 1 and "gone" in retried["reason"]
    assert renv.status(job.id) == COMPLETED


def test_a_lease_given_back_on_shutdown_shows_as_released_by_its_worker(renv, monitor, tmp_path):
    # The worker is told to send events only by -E: the release's event follows the worker's flag.
    conf = {"lease_duration": 30.0, "lease_heartbeat_interval": 1.0, "lease_dispatch_timeout": 600.0}
    app = renv.app(**conf)
    with celery_processes(tmp_path) as procs:
        proc = events_worker(renv, conf, tmp_path)
        procs.append(proc)
        job = app.tasks["reaper_app.work"].delay(60.0)
        started(renv, monitor, job.id)
        node = monitor.task(job.id).worker.hostname
        proc.popen.send_signal(signal.SIGQUIT)  # a cold shutdown: the lease is given back
        proc.popen.wait(30)
        wait_for(lambda: renv.status(job.id) == PENDING, timeout=10, message="lease not released")
        wait_for(lambda: monitor.of(job.id, "task-retried"), timeout=10, message="no task-retried")
    [retried] = monitor.of(job.id, "task-retried")
    assert retried["hostname"] == node and retried["reason"] == events.RELEASED_ON_SHUTDOWN
    assert retried["attempt"] == 1
    assert monitor.task(job.id).state != "STARTED"


def test_an_operator_requeue_and_redrive_show_as_retries(renv, monitor):
    app = renv.app(**EVENTS)
    job = app.tasks["reaper_app.work"].delay(0.1)  # no worker: the job stays pending
    store = renv.store
    token = "t" * 32
    claim = store.jobs.claim(job.id, OWNER, token, TERMS, "reaper_app.work", renv.queue, lambda: None)
    assert claim.claimed
    [outcome] = recovery.requeue(app, store, [store.get(job.id)], force=True, who="cli:ops@host")
    assert outcome.action == "requeued"
    wait_for(lambda: monitor.of(job.id, "task-retried"), timeout=10, message="requeue sent no task-retried")
    assert monitor.task(job.id).state == "RETRY"
    assert monitor.of(job.id, "task-retried")[0]["hostname"] == events.node("celery_lease.cli")
    # Dead-lettered by its own worker, then redriven from the page.
    store.jobs.claim(job.id, OWNER, token, TERMS, "reaper_app.work", renv.queue, lambda: None)
    assert store.jobs.fail(job.id, token, "boom")
    [outcome] = recovery.redrive(app, store, [store.get(job.id)], who="web:ops@10.0.0.1")
    assert outcome.action == "redriven"
    wait_for(lambda: len(monitor.of(job.id, "task-retried")) == 2, timeout=10, message="redrive sent none")
    assert monitor.of(job.id, "task-retried")[1]["hostname"] == events.node("celery_lease.web")
    assert "redriven" in monitor.task(job.id).exception


def _shown(task: Any) -> tuple[Any, ...]:
    """What Flower's task page shows of a job: state, worker, times."""
    return task.state, task.worker.hostname, task.received, task.started, task.succeeded, task.failed


def test_a_duplicate_of_a_finished_job_changes_nothing_monitors_show(renv, monitor, tmp_path):
    app = renv.app(**EVENTS)
    with celery_processes(tmp_path) as procs:
        procs.append(events_worker(renv, EVENTS, tmp_path))
        job = app.tasks["reaper_app.work"].delay(0.1)
        wait_for(lambda: monitor.task(job.id) is not None and monitor.task(job.id).state == "SUCCESS",
                 timeout=30, message="job never succeeded")
        before = _shown(monitor.task(job.id))
        messages.republish(app, job.id, renv.store.get(job.id).payload)  # a redelivery of the same message
        wait_for(lambda: renv.store.reports.events(job.id, "duplicate_delivery_skipped"), timeout=20,
                 message="duplicate never skipped")
        monitor.mark()
    assert _shown(monitor.task(job.id)) == before
    assert len(monitor.of(job.id, "task-received")) == 1
    assert renv.count(job.id, "started") == 1


def test_a_duplicate_of_a_job_leased_elsewhere_changes_nothing_monitors_show(renv, monitor, tmp_path):
    # acks_late: the busy worker holds its one message, so the duplicate goes to the other worker.
    conf = {**EVENTS, "task_acks_late": True, "lease_duration": 30.0, "lease_heartbeat_interval": 1.0}
    app = renv.app(**conf)
    with celery_processes(tmp_path) as procs:
        procs.append(events_worker(renv, conf, tmp_path))
        job = app.tasks["reaper_app.work"].delay(8.0)
        started(renv, monitor, job.id)
        procs.append(events_worker(renv, conf, tmp_path))
        before = _shown(monitor.task(job.id))
        messages.republish(app, job.id, renv.store.get(job.id).payload)
        skipped = wait_for(lambda: renv.store.reports.events(job.id, "duplicate_delivery_skipped"),
                           timeout=20,
                           message="duplicate never skipped")
        monitor.mark()
        assert _shown(monitor.task(job.id)) == before
        assert renv.store.get(job.id).locked_by in str(skipped[0]["detail"])
        wait_for(lambda: monitor.task(job.id).state == "SUCCESS", timeout=20, message="job never finished")
    assert monitor.task(job.id).worker.hostname == before[1]
    assert len(monitor.of(job.id, "task-received")) == 1
