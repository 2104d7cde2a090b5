"""The app that real worker subprocesses of the broker-alignment tests run.

Configured from the environment: BROKER_APP_BROKER (Redis db 9 or RabbitMQ), BROKER_APP_STORE,
BROKER_APP_PREFIX, BROKER_APP_EXTEND (1/0: lease_extend_visibility), BROKER_APP_VT (Redis
visibility timeout, seconds), BROKER_APP_COUNTERS (a Redis URL for the counters),
BROKER_APP_QUEUE (the default queue), BROKER_APP_TIME_LIMIT (the task's time limit, seconds)
BROKER_APP_CONSUMER_TIMEOUT (lease_rabbitmq_consumer_timeout, seconds), BROKER_APP_LEASE
(lease_duration, seconds; the call bound is a third of it), BROKER_APP_KEYPREFIX:
kombu's ``global_keyprefix`` and the counters' prefix, so that concurrent runs sharing the
Redis database do not see each other's keys, and BROKER_APP_TRANSPORT (a JSON object merged
into ``broker_transport_options``: an SQS endpoint's region, queue name prefix, polling),
BROKER_APP_QUEUE_ARGS (a JSON object: the default queue's arguments, a RabbitMQ quorum queue's).

Counters, per job id (after the key prefix): ``delivered:<id>`` and ``redelivered:<id>`` in the
main process for every message received (task_received); ``executed:<id>`` for every request
that reached the pool (task_prerun, whether the lease then ran the body or skipped it);
``started:<id>`` and ``finished:<id>`` in the body.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, signals
from kombu import Queue

from celery_lease import LeaseTask

DEFAULTS = {
    "BROKER_APP_BROKER": "redis://127.0.0.1:6379/9",
    "BROKER_APP_STORE": "sqlite:///broker_app.sqlite3",
    "BROKER_APP_PREFIX": "broker_",
    "BROKER_APP_EXTEND": "1",
    "BROKER_APP_VT": "2",
    "BROKER_APP_COUNTERS": "redis://127.0.0.1:6379/9",
    "BROKER_APP_QUEUE": "celery",
    "BROKER_APP_TIME_LIMIT": "",
    "BROKER_APP_CONSUMER_TIMEOUT": "",
    "BROKER_APP_LEASE": "1",
    "BROKER_APP_KEYPREFIX": "",
    "BROKER_APP_TRANSPORT": "{}",
    "BROKER_APP_QUEUE_ARGS": "",
}


class Counters:
    """Redis counters under a key prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client, self.prefix = redis.Redis.from_url(url), prefix

    def incr(self, key: str) -> None:
        self.client.incr(self.prefix + key)

    def rpush(self, key: str, value: str) -> None:
        self.client.rpush(self.prefix + key, value)

    def count(self, key: str) -> int:
        return int(self.client.get(self.prefix + key) or 0)

    def names(self, key: str) -> list[str]:
        """The node names pushed to a list, without their host part."""
        return [v.decode().split("@")[0] for v in self.client.lrange(self.prefix + key, 0, -1)]


def make_app(env: Mapping[str, str]) -> tuple[Celery, Counters]:
    """The app and its counter client, from an environment (the test process builds its twin)."""
    conf = {key: env.get(key, default) for key, default in DEFAULTS.items()}
    app = Celery("broker_app", broker=conf["BROKER_APP_BROKER"], set_as_current=False)
    app.conf.update(
        lease_store_url=conf["BROKER_APP_STORE"], lease_table_prefix=conf["BROKER_APP_PREFIX"],
        lease_duration=float(conf["BROKER_APP_LEASE"]), lease_heartbeat_interval=0.25, lease_grace_period=0.3,
        lease_worker_stale_after=1.0, lease_extend_visibility=conf["BROKER_APP_EXTEND"] == "1",
        task_acks_late=True, task_ignore_result=True, worker_prefetch_multiplier=2,
        broker_transport_options={
            "visibility_timeout": float(conf["BROKER_APP_VT"]),
            "unacked_restore_interval": 1, "unacked_restore_throttle": 1,
            **({"global_keyprefix": conf["BROKER_APP_KEYPREFIX"]} if conf["BROKER_APP_KEYPREFIX"] else {}),
            **json.loads(conf["BROKER_APP_TRANSPORT"]),
        },
        broker_connection_retry_on_startup=True, task_default_queue=conf["BROKER_APP_QUEUE"],
        lease_rabbitmq_consumer_timeout=float(conf["BROKER_APP_CONSUMER_TIMEOUT"] or 0) or None,
    )
    if conf["BROKER_APP_QUEUE_ARGS"]:
        name = conf["BROKER_APP_QUEUE"]
        app.conf.task_queues = [Queue(name, routing_key=name,
                                      queue_arguments=json.loads(conf["BROKER_APP_QUEUE_ARGS"]))]
    time_limit = float(conf["BROKER_APP_TIME_LIMIT"] or 0) or None
    counters = Counters(conf["BROKER_APP_COUNTERS"], conf["BROKER_APP_KEYPREFIX"])

    @app.task(base=LeaseTask, bind=True, shared=False, name="broker_app.work", time_limit=time_limit)
    def work(self: Any, seconds: float) -> float:
        """Counts its starts and finishes; holds its lease for ``seconds``."""
        counters.incr(f"started:{self.request.id}")
        counters.rpush(f"ran_on:{self.request.id}", self.request.hostname)
        deadline, pause = time.monotonic() + seconds, threading.Event()
        while time.monotonic() < deadline:
            pause.wait(0.05)  # simulated work, checking the lease as it goes
            self.lease.check()
        counters.incr(f"finished:{self.request.id}")
        return seconds

    return app, counters


app, counters = make_app(os.environ)


def _count_delivery(request: Any = None, **_: Any) -> None:
    counters.incr(f"delivered:{request.id}")
    counters.rpush(f"delivered_to:{request.id}", request.hostname)
    if (request.delivery_info or {}).get("redelivered"):
        counters.incr(f"redelivered:{request.id}")


def _count_execution(task_id: str | None = None, **_: Any) -> None:
    counters.incr(f"executed:{task_id}")


@signals.celeryd_init.connect
def _in_the_worker_only(instance: Any = None, **_: Any) -> None:
    # `celery worker` sends celeryd_init; in-process test workers of other modules do not.
    if instance is not None and instance.app is app:
        signals.task_received.connect(_count_delivery, weak=False)
        signals.task_prerun.connect(_count_execution, weak=False)
