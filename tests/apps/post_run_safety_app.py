"""The app of the post-run safety tests: a duplicate of a finished job, a replaced chain, a revoke.

Configured from the environment: SAFETY_BROKER (Redis db 13, or RabbitMQ), SAFETY_REPORTS (Redis, the
reports: SAFETY_BROKER unless told), SAFETY_BACKEND (``rpc://`` or a Redis URL), SAFETY_STORE (the
lease store, possibly through a proxy the test can cut), SAFETY_PREFIX (table prefix and report key
prefix) and SAFETY_QUEUE. 2 s leases.

Reports, under ``<prefix>:``: ``callback`` (link-callback calls), ``runs:<task>:<id>`` (bodies);
``safety.gate`` (acks_late) returns once ``open:<id>`` is pushed.
With SAFETY_KILL_BEFORE_STEP set, a worker SIGKILLs its whole process group the first time it
is about to publish ``safety.add`` (the first step of ``safety.replacer``'s chain), once per test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, chain
from celery.signals import before_task_publish

from celery_lease import LeaseTask

DEFAULTS = {
    "SAFETY_BROKER": "redis://127.0.0.1:6379/13",
    "SAFETY_BACKEND": "rpc://",
    "SAFETY_STORE": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "SAFETY_PREFIX": "safety_",
    "SAFETY_QUEUE": "safety",
}


def make_app(env: Mapping[str, str]) -> Celery:
    """The app from an environment (the test process builds its twin to send and read)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("post_run_safety_app", broker=conf["SAFETY_BROKER"], backend=conf["SAFETY_BACKEND"],
                 set_as_current=False)
    app.conf.update(
        lease_store_url=conf["SAFETY_STORE"], lease_table_prefix=conf["SAFETY_PREFIX"],
        lease_duration=2.0, lease_heartbeat_interval=0.4, lease_grace_period=0.5,
        lease_dispatch_timeout=2.0, task_default_queue=conf["SAFETY_QUEUE"],
        worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True,
    )
    reports = redis.Redis.from_url(env.get("SAFETY_REPORTS") or conf["SAFETY_BROKER"])
    prefix = conf["SAFETY_PREFIX"]

    def ran(task: Any) -> None:
        reports.incr(f"{prefix}:runs:{task.name}:{task.request.id}")

    @app.task(base=LeaseTask, bind=True, shared=False, name="safety.total")
    def total(self: Any, x: int) -> int:
        ran(self)
        return x * 10

    @app.task(shared=False, name="safety.callback")
    def callback(value: Any) -> None:
        reports.incr(f"{prefix}:callback")

    @app.task(base=LeaseTask, bind=True, shared=False, name="safety.add")
    def add(self: Any, x: int, y: int) -> int:
        ran(self)
        return x + y

    @app.task(base=LeaseTask, bind=True, shared=False, name="safety.sleeper")
    def sleeper(self: Any, seconds: float) -> None:
        ran(self)
        time.sleep(seconds)

    @app.task(base=LeaseTask, bind=True, shared=False, name="safety.gate", acks_late=True)
    def gate(self: Any, value: int) -> int:
        ran(self)
        reports.blpop(f"{prefix}:open:{self.request.id}", timeout=60)  # the test's go, or give up after 60 s
        return value

    @app.task(base=LeaseTask, bind=True, shared=False, name="safety.replacer")
    def replacer(self: Any, x: int) -> Any:
        ran(self)
        return self.replace(chain(add.s(x, 1), add.s(10)))

    if env.get("SAFETY_KILL_BEFORE_STEP"):
        @before_task_publish.connect(weak=False)
        def die_before_step(sender: str | None = None, **_: Any) -> None:
            if sender == "safety.add" and reports.set(f"{prefix}:killed", os.getpid(), nx=True):
                os.killpg(os.getpgid(0), signal.SIGKILL)

    return app


app = make_app(os.environ)
