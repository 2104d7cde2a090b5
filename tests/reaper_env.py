"""Shared set-up of the reaper's worker tests: Redis db 7 broker, PostgreSQL store, run counters.

db 7 is never flushed: each test gets queues of its own (jobs and the reaper task), so runs of
these tests in parallel processes cannot take each other's messages.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import redis
import sqlalchemy as sa

from celery_lease.errors import StoreUnavailable
from celery_lease.reaper.run import Reaper, ReapResult
from celery_lease.store import Store
from tests.apps.reaper_app import make_app, runs_table
from tests.conftest import unique_prefix

REDIS_DB = 7
APP = "tests.apps.reaper_app"


class ReaperEnv:
    """One test's broker, store, counters and the environment its subprocesses get."""

    def __init__(self, redis_url: str, postgres_url: str) -> None:
        self.broker_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
        self.broker = redis.Redis.from_url(self.broker_url)
        self.prefix = unique_prefix()
        self.queue = f"rq-{self.prefix}"
        self.reaper_queue = f"{self.queue}.reaper"
        self.store = Store(postgres_url, self.prefix)
        self.store.migrate()
        self.runs = runs_table(self.prefix)
        self.runs.create(self.store.engine)
        self.vars = {"REAPER_BROKER": self.broker_url, "REAPER_STORE": postgres_url,
                     "REAPER_PREFIX": self.prefix, "REAPER_CONF": "{}"}

    def env(self, **conf: Any) -> dict[str, str]:
        """The subprocess environment, with this test's queues and extra settings as REAPER_CONF."""
        own = {"task_default_queue": self.queue,
               "task_routes": {"celery_lease.reap": {"queue": self.reaper_queue}}}
        return {**self.vars, "REAPER_CONF": json.dumps({**own, **conf})}

    def app(self, **conf: Any):
        """The test process's twin of the subprocesses' app (to send jobs and run reapers)."""
        return make_app(self.env(**conf))

    def count(self, job_id: str, phase: str) -> int:
        r = self.runs
        with self.store.begin() as c:
            return c.execute(sa.select(sa.func.count()).select_from(r)
                             .where(r.c.job_id == job_id, r.c.phase == phase)).scalar_one()

    def pids(self, job_id: str) -> list[int]:
        r = self.runs
        with self.store.begin() as c:
            return [row[0] for row in c.execute(sa.select(r.c.pid).where(r.c.job_id == job_id,
                                                                         r.c.phase == "started"))]

    def attempts(self, job_id: str) -> list[int]:
        """The attempt number of each execution of ``job_id`` that started."""
        r = self.runs
        with self.store.begin() as c:
            return [row[0] for row in c.execute(sa.select(r.c.attempt).where(r.c.job_id == job_id,
                                                                             r.c.phase == "started"))]

    def status(self, job_id: str) -> str | None:
        job = self.store.get(job_id)
        return job.status if job else None

    def first_event_at(self, job_id: str, name: str) -> float | None:
        found = self.store.reports.events(job_id, name)
        return found[0]["at"] if found else None

    def close(self) -> None:
        self.runs.drop(self.store.engine)
        self.store.t.metadata.drop_all(self.store.engine)
        self.store.engine.dispose()
        for key in self.broker.scan_iter(f"*{self.queue}*"):
            self.broker.delete(key)
        self.broker.close()


def reap_round(reaper: Reaper) -> ReapResult | None:
    """One reaper round, as beat runs it: a round the store does not answer within its bound fails
    alone and the next one runs (None here), so a test polling rounds on a loaded machine goes on."""
    try:
        return reaper.run_once()
    except StoreUnavailable:
        return None


@contextlib.contextmanager
def reaper_loop(app: Any, interval: float = 0.5) -> Iterator[Reaper]:
    """Reaper.run_forever in a thread of the test process, stopped on exit."""
    stop = threading.Event()
    reaper = Reaper(app)
    thread = threading.Thread(target=reaper.run_forever, args=(interval, stop), daemon=True)
    thread.start()
    try:
        yield reaper
    finally:
        stop.set()
        thread.join(10)
