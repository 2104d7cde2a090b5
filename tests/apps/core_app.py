"""The app that real worker subprocesses of the leased-execution tests run.

Configured from the environment: CORE_BROKER, CORE_STORE, CORE_PREFIX, and CORE_CONF
(JSON of extra settings).
"""

from __future__ import annotations

import json
import os
import threading

import redis
from celery import Celery

from celery_lease import LeaseTask

app = Celery("core_app", broker=os.environ.get("CORE_BROKER", "redis://127.0.0.1:6379/4"),
             backend=os.environ.get("CORE_BROKER", "redis://127.0.0.1:6379/4"))
app.conf.update(
    lease_store_url=os.environ.get("CORE_STORE", "sqlite:///core.sqlite3"),
    lease_table_prefix=os.environ.get("CORE_PREFIX", "core_"),
    lease_duration=1.5, lease_heartbeat_interval=0.2, lease_grace_period=0.5,
    task_acks_late=True, worker_prefetch_multiplier=1,
)
app.conf.update(json.loads(os.environ.get("CORE_CONF", "{}")))
counter = redis.Redis.from_url(app.conf.broker_url)


@app.task(base=LeaseTask, bind=True, name="core.work")
def work(self, seconds: float = 0.0) -> dict:
    """Counts its executions in Redis and holds its lease for ``seconds``."""
    counter.incr(f"runs:{self.request.id}")
    threading.Event().wait(seconds)
    return {"pid": os.getpid(), "worker": self.lease.worker, "attempt": self.lease.attempt}


@app.task(base=LeaseTask, bind=True, name="core.limited", soft_time_limit=0.5)
def limited(self) -> None:
    """Outlives its soft time limit."""
    counter.incr(f"runs:{self.request.id}")
    threading.Event().wait(10)


@app.task(base=LeaseTask, bind=True, name="core.cleans_up")
def cleans_up(self) -> str:
    """Waits 30 s; a soft time limit (``revoke(..., terminate=True, signal="SIGUSR1")``) makes it return."""
    from celery.exceptions import SoftTimeLimitExceeded

    try:
        counter.incr(f"runs:{self.request.id}")  # the test signals once the body counts itself
        threading.Event().wait(30)
    except SoftTimeLimitExceeded:
        return "cleaned-up"
    return "ran out"
