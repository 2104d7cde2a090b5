"""A worker whose deliveries find the store unreachable stops consuming until it answers.

A delivery that cannot claim its job sends its message again for later and is acknowledged
(deliveries.fail_closed). A worker that went on consuming would take every message of its
queues only to send each one back, the whole backlog churning through the broker for as
long as the outage lasts. So the worker's main process, told by the delivery's outcome
(``FailedClosed``, seen by LeaseRequest in every pool, a prefork child's included), cancels
its task consumer, asks the store from a thread of its own every ``lease_store_retry_delay``,
and consumes again once the store answers. The consumer is only ever touched from its own
event loop (``Consumer.call_soon``); messages the worker already holds still run, or fail
closed with their backoff.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

import celery_lease.worker.runtime as runtime

from ..config import app_config
from .pause import ConsumerPause

__all__ = ["ConsumerPause", "PauseStep", "store_unreachable"]


class PauseStep(bootsteps.StartStopStep):
    """Consumer step of the main process: gives its runtime a ConsumerPause bound to the consumer."""

    label = "celery_lease pause"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.pause: ConsumerPause | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self.pause is None:
            from ..store import for_app

            store = for_app(c.app, check=False)
            rt = runtime.for_app(c.app, store, c.hostname)
            rt.pause = self.pause = ConsumerPause(store, app_config(c.app).store_retry_delay)
        self.pause.bind(c)

    def shutdown(self, c: Any) -> None:
        if self.pause is not None:
            self.pause.stop()


def store_unreachable(app: Any, why: str) -> None:
    """Tell this worker process's consumer that a delivery met an unreachable store (a no-op in a
    process without one: a prefork child, a process that is no worker)."""
    rt = runtime.current(app)
    pause = rt.pause if rt is not None else None
    if pause is not None:
        pause.store_unreachable(why)
