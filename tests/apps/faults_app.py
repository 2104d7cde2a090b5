"""The app of the fault matrix (tests/faults/): one LeaseTask whose scenario is its argument.

Configured from the environment: FAULTS_BROKER, FAULTS_REDIS (result backend, scenarios, the
bodies' log), FAULTS_STORE, FAULTS_PREFIX, FAULTS_QUEUE. The store and the library's backend
calls go through tests/faults/injector.py (lease_fault_injector), which fails the one call the
job's scenario names. Each body logs (pid, token, monotonic start, end, done) to
``faults:body:<job>``; effects and link callbacks count their runs in Redis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, chain
from celery.exceptions import Ignore, Reject

from celery_lease import LeaseLost, LeaseTask

app = Celery("faults_app", broker=os.environ.get("FAULTS_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("FAULTS_REDIS", "redis://127.0.0.1:6379/0"), set_as_current=False)
app.conf.update(
    lease_store_url=os.environ.get("FAULTS_STORE", "sqlite:///faults.sqlite3"),
    lease_table_prefix=os.environ.get("FAULTS_PREFIX", "faults_"),
    lease_fault_injector="tests.faults.injector:INJECTOR",
    lease_duration=3.0, lease_heartbeat_interval=0.5, lease_grace_period=0.5,
    lease_store_retry_delay=0.5, lease_reaper_hard_grace=4.0, lease_store_retry_max=2.0,
    lease_backoff_base=0.2, lease_backoff_max=1.0,
    task_acks_late=True, worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("FAULTS_QUEUE", "faults"),
    # Nobody consumes it: the matrix counts each job's dead letters there.
    lease_dead_letter_queue=os.environ.get("FAULTS_QUEUE", "faults") + "_dlq",
    broker_connection_retry_on_startup=True,
    beat_schedule={"lease-reaper": {"task": "celery_lease.reap", "schedule": 1.0}},
)
log = redis.Redis.from_url(app.conf.result_backend)

#: Seconds the ``long`` kind's body runs: heartbeats renew its lease meanwhile.
LONG_BODY = 1.6


def _runs(job_id: str) -> int:
    return int(log.incr(f"faults:runs:{job_id}"))


@app.task(base=LeaseTask, bind=True, shared=False, name="faults.run")
def run(self: Any, scenario: dict[str, Any]) -> str:
    """Behave as the scenario's run kind says; log this body's interval."""
    return _body(self, scenario)


def _body(self: Any, scenario: dict[str, Any]) -> str:
    job_id, kind = self.request.id, scenario["kind"]
    lease = self.lease
    start, done = time.monotonic(), False
    try:
        n = _runs(job_id)
        if kind in ("retry0", "retry_later") and self.request.retries == 0:
            raise self.retry(countdown=0 if kind == "retry0" else 1, max_retries=3)
        if kind == "ignore":
            raise Ignore()
        if kind == "reject_requeue" and n == 1:
            raise Reject("try again", requeue=True)
        if kind == "reject_drop":
            raise Reject("refused", requeue=False)
        if kind == "raise":
            raise ValueError("boom")
        if kind == "leaselost" and n == 1:
            raise LeaseLost(job_id, "the body saw its lease lost")
        if kind == "replace_task" and not scenario.get("replaced"):
            raise self.replace(run.si({**scenario, "replaced": True}))
        if kind == "replace_chain" and not scenario.get("replaced"):
            raise self.replace(chain(run.si({"kind": "return", "child": True}),
                                     run.si({**scenario, "replaced": True})))
        if kind == "effects":
            lease.checkpoint({"step": 1})
            # Keys are global: one per job, so each job's effect is counted on its own.
            with lease.effect(f"k1:{job_id}") as first:
                if first:
                    log.incr(f"faults:effect:{job_id}:k1")
            with lease.lock(f"r-{job_id}"):
                pass
        if kind == "long":
            while time.monotonic() - start < LONG_BODY:
                time.sleep(0.05)
        done = True
        return f"ok:{kind}"
    finally:
        log.rpush(f"faults:body:{job_id}", json.dumps({
            "pid": os.getpid(), "token": getattr(lease, "token", None), "start": start,
            "end": time.monotonic(), "done": done}))


@app.task(base=LeaseTask, bind=True, shared=False, name="faults.tracked", track_started=True)
def tracked(self: Any, scenario: dict[str, Any]) -> str:
    """The ``started`` kind: Celery's task_track_started, which the library writes after the claim."""
    return _body(self, scenario)


@app.task(base=LeaseTask, bind=True, shared=False, name="faults.revocable", lease_dispatch_timeout=2.0)
def revocable(self: Any, scenario: dict[str, Any]) -> str:
    """The ``revoke`` kind: a short dispatch timeout, so a cancel the store refused is tried again on
    the copy the dispatch scan sends (which the worker discards as revoked) within the settle bound."""
    return _body(self, scenario)


@app.task(shared=False, name="faults.linked")
def linked(_result: Any, job_id: str) -> None:
    """A link callback: counts its runs per job."""
    log.incr(f"faults:linked:{job_id}")
