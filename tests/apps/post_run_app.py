"""The app of the post-run crash tests: a chain of two LeaseTasks whose worker dies once at a
chosen point of Celery's post-run work.

Configured from the environment: POST_RUN_BROKER (RabbitMQ, which hands an unacknowledged
message on at once when its worker dies), POST_RUN_BACKEND (Redis db 5, which also holds the
run counters), POST_RUN_STORE, POST_RUN_PREFIX, POST_RUN_QUEUE and POST_RUN_KILL_AT:
- ``before_result``: after the store completed ``first`` and Celery sent the chain's next step,
  before it stores ``first``'s result;
- ``before_next_step``: after the store completed ``first``, before Celery sends the next step.
The whole worker (its process group) is SIGKILLed, once per test run.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import redis
from celery import Celery
from celery.signals import after_task_publish, before_task_publish

from celery_lease import LeaseTask

app = Celery("post_run_app", broker=os.environ.get("POST_RUN_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
             backend=os.environ.get("POST_RUN_BACKEND", "redis://127.0.0.1:6379/5"), set_as_current=False)
app.conf.update(
    lease_store_url=os.environ.get("POST_RUN_STORE", "sqlite:///post_run.sqlite3"),
    lease_table_prefix=os.environ.get("POST_RUN_PREFIX", "post_run_"),
    lease_duration=3.0, lease_heartbeat_interval=0.5, lease_grace_period=0.5,
    task_acks_late=True, worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("POST_RUN_QUEUE", "post_run"),
    broker_connection_retry_on_startup=True,
)
KILL_AT = os.environ.get("POST_RUN_KILL_AT", "")
reports = redis.Redis.from_url(app.conf.result_backend)


def _die_once(point: str) -> None:
    """SIGKILL this worker's whole process group the first time ``point`` is reached."""
    if KILL_AT == point and reports.set(f"killed:{point}", os.getpid(), nx=True):
        os.killpg(os.getpgid(0), signal.SIGKILL)


@app.task(base=LeaseTask, bind=True, shared=False, name="post_run.first")
def first(self, x: int) -> int:
    reports.rpush(f"runs:{self.request.id}", os.getpid())
    return x * 10


@app.task(base=LeaseTask, bind=True, shared=False, name="post_run.second")
def second(self, y: int) -> int:
    reports.rpush(f"runs:{self.request.id}", os.getpid())
    return y + 1


# Inside a worker only the chain's next step is published, by the first task's post-run work,
# which sends it before it stores the result.
@before_task_publish.connect
def _before_publish(sender: str | None = None, **_: Any) -> None:
    if sender == "post_run.second" and os.environ.get("POST_RUN_IN_WORKER"):
        _die_once("before_next_step")


@after_task_publish.connect
def _after_publish(sender: str | None = None, **_: Any) -> None:
    if sender == "post_run.second" and os.environ.get("POST_RUN_IN_WORKER"):
        _die_once("before_result")
