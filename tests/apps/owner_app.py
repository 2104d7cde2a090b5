"""The app of the one-live-owner tests: bodies that report every check of their lease to Redis.

Configured from the environment: OWNER_BROKER (Redis db 13, also the result backend and the
reports), OWNER_STORE (the lease store, possibly through a proxy the test can freeze),
OWNER_PREFIX (table prefix and report key prefix) and OWNER_CONF (JSON of extra settings).
Fast settings: 2 s leases, 0.4 s heartbeats, 0.5 s grace.

Reports, under ``<prefix>:<job id>``: ``:started`` (one ``attempt:pid:wall time`` per body),
``:checked:<attempt>`` (the wall time of the last check() that passed), ``:lost:<attempt>``
(``wall time:reason`` of the LeaseLost the body got), ``:errback`` (errback calls).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery

from celery_lease import LeaseLost, LeaseTask

DEFAULTS = {
    "OWNER_BROKER": "redis://127.0.0.1:6379/13",
    "OWNER_STORE": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "OWNER_PREFIX": "owner_",
    "OWNER_CONF": "{}",
}
SETTINGS = dict(
    lease_duration=2.0, lease_heartbeat_interval=0.4, lease_grace_period=0.5, lease_reaper_hard_grace=5.0,
    lease_backoff_base=0.1, lease_backoff_max=0.3, lease_reaper_lock_ttl=3.0, lease_max_attempts=3,
    task_acks_late=True, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True,
    worker_lost_wait=1.0,
)
HOLD = 60.0  # seconds a body that lost its lease keeps its pool slot, at most


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to send and reap)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("owner_app", broker=conf["OWNER_BROKER"], backend=conf["OWNER_BROKER"], set_as_current=False)
    app.conf.update(SETTINGS, lease_store_url=conf["OWNER_STORE"], lease_table_prefix=conf["OWNER_PREFIX"])
    app.conf.update(json.loads(conf["OWNER_CONF"]))
    reports = redis.Redis.from_url(conf["OWNER_BROKER"])
    prefix = conf["OWNER_PREFIX"]

    def key(task: Any, *parts: Any) -> str:
        return ":".join([prefix, task.request.id, *map(str, parts)])

    def started(task: Any) -> int:
        attempt = task.lease.attempt
        reports.rpush(key(task, "started"), f"{attempt}:{os.getpid()}:{time.time()!r}")
        return attempt

    def lost(task: Any, attempt: int, exc: LeaseLost) -> None:
        reports.set(key(task, "lost", attempt), f"{time.time()!r}:{exc.reason}")

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.guarded", lease_on_lost="flag")
    def guarded(self: Any, seconds: float) -> int:
        """Checks its lease every 20 ms for ``seconds``; after a LeaseLost it keeps its slot until ``:go``."""
        attempt = started(self)
        end = time.monotonic() + (seconds if attempt == 1 else 0.2)
        pause = threading.Event()
        while time.monotonic() < end:
            try:
                self.lease.check()
            except LeaseLost as exc:
                lost(self, attempt, exc)
                # Keep the pool slot, so the job's next delivery goes to another worker.
                deadline = time.monotonic() + HOLD
                while not reports.get(f"{prefix}:go") and time.monotonic() < deadline:
                    pause.wait(0.05)
                raise
            reports.set(key(self, "checked", attempt), repr(time.time()))
            pause.wait(0.02)
        return attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.overrun", lease_max_runtime=1.0)
    def overrun(self: Any) -> int:
        """Holds a resource lock and outlives lease_max_runtime on its first attempt (raise mode)."""
        attempt = started(self)
        pause = threading.Event()
        try:
            with self.lease.lock(f"res:{self.request.id}", ttl=1.5):
                end = time.monotonic() + (30.0 if attempt == 1 else 0.1)
                while time.monotonic() < end:
                    pause.wait(0.02)
        except LeaseLost as exc:
            lost(self, attempt, exc)
            raise
        return attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.waits")
    def waits(self: Any, seconds: float) -> int:
        """Waits cooperatively (gevent) for ``seconds``; reports the LeaseLost raised into it."""
        attempt = started(self)
        pause = threading.Event()
        try:
            end = time.monotonic() + (seconds if attempt == 1 else 0.1)
            while time.monotonic() < end:
                pause.wait(0.02)
        except LeaseLost as exc:
            lost(self, attempt, exc)
            raise
        return attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.sleeps")
    def sleeps(self: Any, seconds: float) -> int:
        """Sleeps ``seconds`` (a short body of a threads pool); reports each body it ran."""
        attempt = started(self)
        time.sleep(seconds)
        return attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.hard_limited", time_limit=1.0)
    def hard_limited(self: Any) -> None:
        """Outlives its hard time limit on every attempt."""
        started(self)
        pause = threading.Event()
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            pause.wait(0.02)

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.dies_once")
    def dies_once(self: Any) -> int:
        """Kills its own pool process on the first attempt (SIGKILL: an OOM kill looks the same)."""
        attempt = started(self)
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return attempt

    @app.task(base=LeaseTask, bind=True, shared=False, name="owner.exits")
    def exits(self: Any) -> None:
        """Raises SystemExit from the body: a failed attempt, not a worker shutdown."""
        started(self)
        raise SystemExit(3)

    @app.task(shared=False, name="owner.errback")
    def errback(request: Any, exc: Any, traceback: Any) -> None:
        """Counts the errbacks a job fires."""
        reports.incr(f"{prefix}:{request.id}:errback")

    return app


app = make_app(os.environ)
