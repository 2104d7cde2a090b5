"""The cost of the strategy's read (store.deliveries.glance) next to Celery's own work for one delivery.

With task events on, LeaseTask's consumer reads the delivery's job once by its primary key
before Celery's task-received. This times that read (median of N on a table of M jobs) on
SQLite, PostgreSQL and MariaDB, and in the same run what plain Celery's consumer does for
every delivery before it hands it to the pool: building the Request from the message
(celery.worker.request.Request); the ratio is the read over that.
Usage: python -m bench.glance [--reads 2000] [--jobs 10000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

from bench import _results
from celery_lease.store import Store

STORES = {
    "sqlite": None,
    "postgresql": os.environ.get("CELERY_LEASE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mariadb": os.environ.get("CELERY_LEASE_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}


def _median_us(call, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def plain_delivery(n: int) -> float:
    """Median µs of Celery's Request built from a task message, as its default strategy does."""
    app = Celery("bench_glance", set_as_current=False)

    @app.task(shared=False, name="bench.plain")
    def plain(x):
        return x

    message = TaskMessage("bench.plain", str(uuid.uuid4()), args=(1,), kwargs={})
    return _median_us(lambda: Request(message, app=app, task=plain, hostname="bench@host"), n)


def glance(url: str, jobs: int, n: int) -> float:
    """Median µs of store.deliveries.glance on a store holding ``jobs`` rows."""
    store = Store(url, prefix=f"bg{uuid.uuid4().hex[:6]}_")
    store.migrate()
    try:
        ids = [str(uuid.uuid4()) for _ in range(jobs)]
        with store.begin() as c:
            c.execute(sa.insert(store.t.jobs), [
                {"id": i, "task_name": "bench.leased", "queue_name": "celery", "status": "completed",
                 "attempt_count": 1, "max_attempts": 3, "available_at": 0.0, "created_at": 0.0,
                 "updated_at": 0.0} for i in ids])
        store.deliveries.glance(ids[0])  # the schema check and the first connection
        probe = iter(ids * (n // jobs + 1))
        return _median_us(lambda: store.deliveries.glance(next(probe)), n)
    finally:
        store.drop_schema()
        store.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--save", action="store_true", help="write bench/results/glance.json")
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, url in STORES.items():
            url = url or f"sqlite:///{tmp}/glance.sqlite3"
            plain = plain_delivery(args.reads)
            read = glance(url, args.jobs, args.reads)
            figures[name] = {"glance_us": round(read, 1), "plain_delivery_us": round(plain, 1),
                             "ratio": round(read / plain, 2)}
            print(f"{name:10s} glance {read:8.1f} µs   plain Celery delivery {plain:6.1f} µs   "
                  f"ratio {read / plain:5.2f}")
    if args.save:
        _results.save("glance", {"reads": args.reads, "jobs": args.jobs, "stores": figures})


if __name__ == "__main__":
    main()
