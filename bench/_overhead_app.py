"""The app the overhead benchmark's workers run: the same bodies as plain Task and LeaseTask."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time

import redis
from celery import Celery

from bench._floor import Floor, GroupFloor, MainFloor
from celery_lease import LeaseTask

BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/15")
app = Celery("bench_overhead", broker=BROKER)
app.conf.update(
    lease_store_url=os.environ.get("BENCH_STORE", "sqlite:///bench.sqlite3"),
    lease_table_prefix=os.environ.get("BENCH_PREFIX", "bench_"),
    task_ignore_result=True, worker_prefetch_multiplier=4,
)
# BENCH_CONF: JSON of extra settings, e.g. '{"lease_sqlite_synchronous": "NORMAL"}' to price durability.
app.conf.update(json.loads(os.environ.get("BENCH_CONF", "{}")))
counter = redis.Redis.from_url(BROKER)
floor = Floor(app.conf.lease_store_url, app.conf.lease_table_prefix)
group_floor = GroupFloor(app.conf.lease_store_url, app.conf.lease_table_prefix)
main_floor = MainFloor(GroupFloor(app.conf.lease_store_url, app.conf.lease_table_prefix))
_pause = threading.Event()


def _body(seconds: float) -> None:
    if seconds:
        _pause.wait(seconds)
    pipe = counter.pipeline()
    pipe.incr("done")
    pipe.setnx("first", time.time())
    pipe.set("last", time.time())
    pipe.execute()


@app.task(name="bench.plain")
def plain(seconds: float) -> None:
    _body(seconds)


@app.task(base=LeaseTask, name="bench.leased")
def leased(seconds: float) -> None:
    _body(seconds)


@app.task(name="bench.floor", bind=True)
def floored(self, seconds: float) -> None:
    """A plain task with the least a leased run writes: a claim before the body, a completion after."""
    token = secrets.token_hex(16)
    floor.claim(self.request.id, token)
    _body(seconds)
    floor.complete(self.request.id, token)


@app.task(name="bench.groupfloor", bind=True)
def group_floored(self, seconds: float) -> None:
    """The floor's writes, shared with the claims and completions due at the same moment in this process."""
    token = secrets.token_hex(16)
    group_floor.claim(self.request.id, token)
    _body(seconds)
    group_floor.complete(self.request.id, token)


def main_strategy(task, app, consumer, **kwargs):
    return main_floor.strategy(task, app, consumer, **kwargs)


@app.task(name="bench.mainfloor", Strategy="bench._overhead_app:main_strategy")
def main_floored(seconds: float) -> None:
    """A plain task whose claim and completion the main process writes (prefork), shared per loop turn."""
    _body(seconds)
