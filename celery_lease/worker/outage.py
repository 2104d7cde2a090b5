"""A worker whose deliveries find the store unreachable stops consuming until it answers, rather than take its
whole backlog only to send each message back. Told by ``FailedClosed`` (seen by LeaseRequest in every
pool), the main process cancels its task consumer, from the consumer's own event loop only."""

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
    """Tell this process's consumer, if it has one, that a delivery met an unreachable store."""
    rt = runtime.current(app)
    pause = rt.pause if rt is not None else None
    if pause is not None:
        pause.store_unreachable(why)
