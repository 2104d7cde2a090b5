"""The app of the crash tests: jobs of a few steps, each step an effect and a checkpoint.

Configured from the environment: CRASH_BROKER (a private Redis the test may kill), CRASH_STORE
(the lease store, a private PostgreSQL the test may kill, or a failover pair), CRASH_PREFIX,
CRASH_RECORD (the file every execution writes its record to) and CRASH_CONF (JSON of extra
settings). Fast settings: 3 s leases, 0.5 s heartbeats, 0.5 s grace, 2 s dispatch timeout.

The record is a file, not a table: it must take writes while the store is down. Each line is
one ``os.write`` to a file opened with O_APPEND (atomic for lines this short), of the form
``<kind> <job id> <attempt> <lock token> <pid> <wall time> [<detail>]``; the token names the
execution (a job given back and claimed again may keep its attempt number). ``kind`` is
``started``, ``effect`` (the block of ``lease.effect(key)`` saw ``first``; detail: the key),
``step`` (a step's effect and checkpoint are done; detail: the step), ``finished``, ``lost``
(LeaseLost; detail: its reason) or ``error`` (any other exception out of the body; its type).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_lease import LeaseLost, LeaseTask

DEFAULTS = {
    "CRASH_BROKER": "redis://127.0.0.1:6379/0",
    "CRASH_STORE": "sqlite:///crash_app.sqlite3",
    "CRASH_PREFIX": "crash_",
    "CRASH_RECORD": "crash-record.txt",
    "CRASH_CONF": "{}",
}
SETTINGS = dict(
    lease_duration=3.0, lease_heartbeat_interval=0.5, lease_grace_period=0.5, lease_reaper_hard_grace=10.0,
    lease_backoff_base=0.1, lease_backoff_max=0.5, lease_reaper_lock_ttl=3.0, lease_max_attempts=5,
    lease_store_retry_delay=0.5, lease_store_retry_max=1.0,
    # A pending job whose message is gone (a broker emptied, a claim undone) is re-sent within seconds.
    lease_dispatch_timeout=2.0, lease_dispatch_backoff_max=4.0,
    task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True, worker_lost_wait=1.0,
    broker_connection_retry_on_startup=True, broker_connection_max_retries=None,
)


class Record:
    """Appends one line per event of an execution to the record file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def note(self, kind: str, task: Any, detail: Any = "") -> None:
        lease = task.lease
        line = (f"{kind} {task.request.id} {lease.attempt} {lease.token} {os.getpid()} {time.time()!r} "
                f"{detail}")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (" ".join(line.split()) + "\n").encode())
        finally:
            os.close(fd)


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to publish and reap)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("crash_app", broker=conf["CRASH_BROKER"], set_as_current=False)
    app.conf.update(SETTINGS, lease_store_url=conf["CRASH_STORE"], lease_table_prefix=conf["CRASH_PREFIX"])
    app.conf.update(json.loads(conf["CRASH_CONF"]))
    record = Record(conf["CRASH_RECORD"])

    @app.task(base=LeaseTask, bind=True, shared=False, name="crash.steps")
    def steps(self: Any, count: int, pause: float) -> int:
        """``count`` steps of ``pause`` seconds; each records an effect and checkpoints past it."""
        lease = self.lease
        record.note("started", self)
        try:
            for step in range((lease.checkpoint_state or {}).get("step", 0), count):
                key = f"{self.request.id}:{step}"
                with lease.effect(key) as first:
                    if first:
                        record.note("effect", self, key)
                lease.checkpoint({"step": step + 1})
                record.note("step", self, step)
                threading.Event().wait(pause)
                lease.check()
        except LeaseLost as exc:
            record.note("lost", self, exc.reason)
            raise
        except BaseException as exc:
            record.note("error", self, type(exc).__name__)
            raise
        record.note("finished", self)
        return count

    return app


app = make_app(os.environ)
