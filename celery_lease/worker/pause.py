"""ConsumerPause: a worker's task consumer cancelled while the store is unreachable, resumed when it answers
(outage.py says why)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import StoreUnavailable
from .threads import Loop

__all__ = ["ConsumerPause"]

log = logging.getLogger(__name__)


class ConsumerPause:
    """Cancels a worker's task consumer while the store is unreachable; one per worker main process."""

    def __init__(self, store: Any, interval: float) -> None:
        self.store = store
        self.interval = interval
        self.paused = False  # what the consumer should be; its loop applies it
        self._consumer: Any = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()  # the worker stops: never probe again
        self._probe = Loop("celery-lease-store-probe", self._ask_store, self._ask_failed)

    def bind(self, consumer: Any) -> None:
        """The consumer (re)started and consumes: cancel it again if the store is still down."""
        with self._mutex:
            self._consumer = consumer
            paused = self.paused
        if paused:
            consumer.call_soon(self._apply)

    def store_unreachable(self, why: str) -> None:
        """A delivery met an unreachable store (from any thread of the main process): stop consuming."""
        with self._mutex:
            consumer = self._consumer
            if self.paused or consumer is None or self._stop.is_set():
                return
            self.paused = True
            self._probe.start(delay=self.interval)
        log.warning("this worker stops consuming until the lease store answers (asked every %gs): %s",
                    self.interval, why, extra={"action": "consuming_paused"})
        consumer.call_soon(self._apply)

    def _apply(self) -> None:
        """In the consumer's loop: cancel or resume the task consumer, as ``paused`` says now."""
        task_consumer = getattr(self._consumer, "task_consumer", None)
        if task_consumer is None:
            return  # reconnecting: bind() applies it to the next one
        if self.paused:
            task_consumer.cancel()
        else:
            task_consumer.consume()

    def _ask_store(self) -> float:
        """One probe: ask the store again in ``interval`` seconds while it is down, else resume."""
        try:
            self.store.now()
        except StoreUnavailable:
            return self.interval
        with self._mutex:
            self.paused = False
            self._probe.stop()  # under the mutex: the next outage starts a new probe
            consumer = self._consumer
        log.info("lease store answers again: this worker consumes again",
                 extra={"action": "consuming_resumed"})
        consumer.call_soon(self._apply)
        return self.interval

    def _ask_failed(self) -> float:
        log.exception("probe of the lease store failed")
        return self.interval

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._probe.stop(timeout)
