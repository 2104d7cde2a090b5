"""A ``lease_fault_injector`` that sends the worker its own soft time limit signal (billiard's SIGUSR1) inside
one store call of a job: ``soft_signal:<job id>`` in Redis (CORE_BROKER) names it ``<verb>:<pool event>``,
``claim:checkin`` (after the claim committed) or ``complete:checkout`` (before the completion is written). It
fires once per job and records ``soft_signal:fired:<job id>``."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import redis
import sqlalchemy as sa


class SoftSignal:
    def __init__(self) -> None:
        self._redis: redis.Redis | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(os.environ["CORE_BROKER"])
        return self._redis

    def engine_built(self, engine: sa.Engine, store: Any) -> None:
        sa.event.listen(engine.pool, "checkout", lambda *_: self._maybe_fire("checkout"))
        sa.event.listen(engine.pool, "checkin", lambda *_: self._maybe_fire("checkin"))

    def _maybe_fire(self, event: str) -> None:
        frame = sys._getframe(1)
        while frame is not None:  # the store's public call this connection serves, and its job
            job_id = frame.f_locals.get("job_id")
            in_store = frame.f_globals.get("__name__", "").startswith("celery_lease.store")
            if in_store and isinstance(job_id, str):
                wanted = self.redis.get(f"soft_signal:{job_id}")
                if wanted is not None and wanted.decode() == f"{frame.f_code.co_name}:{event}":
                    break
            frame = frame.f_back
        if frame is None:
            return
        if not self.redis.set(f"soft_signal:fired:{job_id}", os.getpid(), nx=True):
            return
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(10_000):  # bytecode for the signal's Python handler to run in, here
            pass


INJECTOR = SoftSignal()
