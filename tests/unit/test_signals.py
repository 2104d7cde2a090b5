"""Worker hooks: the pool checks and the start-up step that refuses LeaseTask options that cannot work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.errors import LeaseConfigError
from celery_lease.integration.signals import RERUN, check_pool, pool_name, validate_tasks
from celery_lease.vocabulary import CancelReason, WorkerLostOutcome

ROOT = Path(__file__).resolve().parents[2]


def app_with(**policies) -> Celery:
    app = Celery("steps", set_as_current=False)
    app.conf.lease_queue_policies = policies
    return app


def test_a_worker_refuses_to_start_with_a_lease_too_short_for_its_heartbeat(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BAD_STORE": f"sqlite:///{tmp_path / 'lease.sqlite3'}"}
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.bad_task_app", "worker", "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == os.EX_CONFIG  # as `celery lease` exits on a bad setting
    output = result.stdout + result.stderr
    [line] = [line for line in output.splitlines() if "LeaseConfigError" in line]
    assert "worker not started: LeaseConfigError: lease_heartbeat_interval=10.0 is invalid" in line
    assert "task bad.short_lease" in line and "ready." not in output
    assert "Traceback" not in output  # one line, not the error under Celery's frames


def test_an_embedded_worker_with_a_bad_setting_raises_the_lease_error_to_its_caller(tmp_path):
    # start_worker() and a test's own WorkController get the typed error, not the command line's SystemExit.
    from celery.contrib.testing.worker import TestWorkController

    app = Celery("steps_embedded", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(lease_store_url=f"sqlite:///{tmp_path / 'lease.sqlite3'}", lease_duration=6.0,
                    lease_heartbeat_interval=1.0)

    @app.task(base=LeaseTask, name="steps.embedded", shared=False, lease_heartbeat_interval=5.0)
    def embedded() -> None: ...

    app.finalize()
    with pytest.raises(LeaseConfigError, match=r"lease_heartbeat_interval=5\.0 is invalid"):
        TestWorkController(app=app, pool="solo", concurrency=1, without_heartbeat=True)


def test_every_lease_task_is_resolved_on_each_queue_the_worker_consumes():
    app = app_with(fast={"lease_duration": 3.0, "lease_heartbeat_interval": 1.0})

    @app.task(base=LeaseTask, name="steps.ok", shared=False, lease_heartbeat_interval=2.0)
    def ok() -> None: ...

    validate_tasks(app, ["celery"])  # 2 s beats within the default 30 s lease
    with pytest.raises(LeaseConfigError) as info:
        validate_tasks(app, ["celery", "fast"])  # but not within the fast queue's 3 s lease
    assert info.value.setting == "lease_heartbeat_interval"
    assert "task steps.ok" in str(info.value) and "on queue 'fast'" in str(info.value)


def test_a_queue_policy_can_make_a_task_option_valid_on_that_queue():
    app = app_with(reports={"lease_duration": 600.0})
    app.conf.task_routes = {"steps.report": {"queue": "reports"}}

    @app.task(base=LeaseTask, name="steps.report", shared=False, lease_heartbeat_interval=60.0)
    def report() -> None: ...

    validate_tasks(app, ["reports"])
    with pytest.raises(LeaseConfigError):
        validate_tasks(app, ["reports", "celery"])


# Celery 5.7 deprecates the task's queue attribute (task_routes instead); it still routes by it.
@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
def test_a_task_declared_on_a_queue_is_resolved_on_that_queue():
    app = app_with(reports={"lease_duration": 600.0})

    @app.task(base=LeaseTask, name="steps.declared", shared=False, queue="reports",
              lease_heartbeat_interval=60.0)
    def declared() -> None: ...

    validate_tasks(app, [])  # its routed queue is its own: 60 s beats within the queue's 600 s lease


def test_a_routing_function_that_needs_a_publishs_arguments_does_not_stop_the_worker():
    app = app_with()

    def by_tenant(name, args, kwargs, options, task=None, **kw):
        return {"queue": f"tenant-{args[0]}"}  # no arguments at start-up: IndexError

    app.conf.task_routes = (by_tenant,)

    @app.task(base=LeaseTask, name="steps.tenant", shared=False)
    def tenant(who: int) -> None: ...

    validate_tasks(app, ["celery"])


def test_plain_tasks_are_left_alone():
    app = app_with()

    @app.task(name="steps.plain", shared=False, lease_duration=1.0)
    def plain() -> None: ...

    validate_tasks(app, ["celery"])


def app_losing(on_lost: str) -> Celery:
    app = Celery(f"signals_{on_lost}", set_as_current=False)
    app.conf.update(lease_store_url="sqlite://")

    @app.task(base=LeaseTask, shared=False, name="t.work", lease_on_lost=on_lost)
    def work():  # pragma: no cover - never called
        return None

    return app


def test_raise_on_lost_is_refused_in_the_eventlet_pool_at_worker_start():
    with pytest.raises(LeaseConfigError, match="lease_on_lost='raise' is invalid: cannot interrupt a body in "
                                               "the eventlet pool"):
        check_pool(app_losing("raise"), "eventlet")


def test_raise_on_lost_set_for_a_queue_the_worker_consumes_is_refused_in_the_eventlet_pool():
    app = Celery("signals_queue_policy", set_as_current=False)
    app.conf.update(lease_store_url="sqlite://", lease_on_lost="flag",
                    task_routes={"t.work": {"queue": "payments"}},
                    lease_queue_policies={"payments": {"lease_on_lost": "raise"}})

    @app.task(base=LeaseTask, shared=False, name="t.work")
    def work():  # pragma: no cover - never called
        return None

    check_pool(app, "eventlet", ["io"])  # routed to payments, whose policy raises, but never delivered here
    with pytest.raises(LeaseConfigError, match=r"eventlet pool \(task t\.work on queue 'payments'\)"):
        check_pool(app, "eventlet", ["io", "payments"])


STARTS = [("flag", "eventlet"), ("raise", "gevent"), ("raise", "prefork"), ("raise", "threads")]


@pytest.mark.parametrize(("on_lost", "pool"), STARTS)
def test_every_other_pool_and_policy_starts(on_lost, pool):
    check_pool(app_losing(on_lost), pool)


def test_a_lost_child_is_rerun_by_the_lease_unless_its_job_was_settled_for_good_or_not_ours():
    assert all(isinstance(outcome, WorkerLostOutcome) for outcome in RERUN)
    assert set(WorkerLostOutcome) - set(RERUN) == {
        WorkerLostOutcome.DEAD_LETTER, WorkerLostOutcome.FAIL, WorkerLostOutcome.COMPLETED,
        WorkerLostOutcome.NONE}


def test_the_pool_is_named_from_the_worker_setting_or_its_class():
    class Worker:
        def __init__(self, pool_cls):
            self.pool_cls, self.app = pool_cls, Celery("w", set_as_current=False)

    from celery.concurrency.eventlet import TaskPool

    assert pool_name(Worker("gevent")) == "gevent"
    assert pool_name(Worker(TaskPool)) == "eventlet"


def test_a_revoke_whose_cancel_meets_an_outage_does_not_raise_and_keeps_the_cancel():
    import socket
    from types import SimpleNamespace

    from celery.signals import task_revoked

    from celery_lease.worker import runtime

    with socket.socket() as s:  # a port nothing listens on: the store refuses every connection
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Celery("revokes", set_as_current=False)
    app.conf.lease_store_url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/test"

    @app.task(base=LeaseTask, shared=False, name="revokes.task")
    def task():
        return None

    try:
        # Celery's own send, as the worker sends it when it discards a revoked delivery
        replies = task_revoked.send(sender=task, request=SimpleNamespace(id="job-r"), terminated=False,
                                    signum=None, expired=False)
        assert not [r for _, r in replies if isinstance(r, BaseException)]
        rt = runtime.current(app)
        assert rt is not None and len(rt.kept_writes) == 1
    finally:
        app.close()


@pytest.mark.parametrize(("expired", "reason"), [(False, CancelReason.REVOKED), (True, CancelReason.EXPIRED)])
def test_a_discarded_delivery_cancels_its_job_with_the_reason_celery_gave(monkeypatch, expired, reason):
    from types import SimpleNamespace

    from celery.signals import task_revoked

    from celery_lease.integration import signals

    cancels = []
    monkeypatch.setattr(signals, "_cancel", lambda app, job_id, why, **where: cancels.append((job_id, why)))
    app = Celery("discards", set_as_current=False)

    @app.task(base=LeaseTask, shared=False, name="discards.task")
    def task():
        return None

    request = SimpleNamespace(id="job-d", delivery_info={"routing_key": "celery"})
    task_revoked.send(sender=task, request=request, terminated=False, signum=None, expired=expired)
    app.close()

    assert cancels == [("job-d", reason)] and type(cancels[0][1]) is CancelReason


@pytest.mark.parametrize(("pool", "concurrency", "processes"), [("threads", 2, 1), ("prefork", 2, 2)])
def test_an_idle_worker_is_alive_in_the_registry_before_its_first_task(tmp_path, pool, concurrency,
                                                                       processes):
    """Given a worker that has run no task, the registry (what `lease status` counts) has its
    body-running processes alive: the worker itself for threads, each child for prefork."""
    from celery_lease.store import for_app
    from tests.conftest import unique_prefix
    from tests.helpers import wait_for
    from tests.workers import celery_processes, worker

    env = {"CORE_STORE": f"sqlite:///{tmp_path / 'lease.sqlite3'}", "CORE_PREFIX": unique_prefix()}
    app = Celery("registry", set_as_current=False)
    app.conf.update(lease_store_url=env["CORE_STORE"], lease_table_prefix=env["CORE_PREFIX"])
    store = for_app(app, check=False)
    node = f"idle{unique_prefix()}"
    with celery_processes(tmp_path) as procs:
        procs.append(proc := worker("tests.apps.core_app", env, tmp_path, pool=pool, concurrency=concurrency,
                                    queues=f"idle-{node}", name=node))
        wait_for(lambda: "ready." in proc.output() or proc.popen.poll() is not None, timeout=60,
                 message="worker never started")
        assert "ready." in proc.output(), proc.output()

        def alive_now() -> list[str]:
            return [w["worker_id"] for w in store.reports.list_workers()[1] if w["alive"]]

        wait_for(lambda: len(alive_now()) >= processes, timeout=60, message="workers never registered")
        alive = alive_now()
        assert len(alive) == processes and all(a.startswith(f"{node}@") for a in alive), alive
        assert store.reports.worker_counts()["alive"] == processes
        assert "Task core." not in proc.output()  # it ran nothing



# Built in a process of its own: a WorkController sets process-wide state (the pool's join guard, the
# current app) that later tests in this process would inherit.
LATE_WORKER = """
import sys
from celery import Celery
from celery_lease import LeaseTask

app = Celery("late", broker="memory://", set_as_current=False)

def late_work():
    pass

@app.on_after_finalize.connect(weak=False)
def define(sender, **_):
    sender.task(base=LeaseTask, shared=False, name="late.work")(late_work)

app.finalize()  # no lease_* setting yet: only the task tells that the app uses leases
app.conf.lease_store_url = sys.argv[1]
assert "late.work" in app.tasks
worker = app.WorkController(pool_cls="solo", hostname="late@test", without_heartbeat=True,
                            without_mingle=True, without_gossip=True, concurrency=1)
worker.consumer.update_strategies()
print("reap registered:", "celery_lease.reap" in app.tasks, "celery_lease.reap" in worker.consumer.strategies)
"""


def test_a_worker_whose_lease_task_is_defined_after_finalize_still_runs_the_reaper_task(tmp_path):
    """A LeaseTask first defined in an ``on_after_finalize`` receiver is bound inside Celery's finalize,
    after that signal's receivers were listed: the worker still registers ``celery_lease.reap``, or the
    beat entry's messages would be refused as unknown tasks and no lease would ever be reaped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", LATE_WORKER, f"sqlite:///{tmp_path / 'lease.sqlite3'}"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "reap registered: True True" in result.stdout, result.stdout + result.stderr
