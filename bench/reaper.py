"""Reaper run time over a large jobs table: it grows with the expired leases, not with the table.

For each store (SQLite file, PostgreSQL) and each table size (10,000 and 1,000,000 rows by
default) it builds a jobs table in one INSERT ... SELECT (generate_series on PostgreSQL, a
recursive CTE on SQLite): 80 % completed, 10 % pending, 10 % running under valid leases, and
1,000 running jobs of a dead owner. It times ``Reaper.run_once()`` while those 1,000 leases
are still valid (an empty run: lock, both scans, three prune probes), then after moving them
1 minute into the past (one run with batch size 1,000 requeues all of them and publishes
1,000 messages to Redis), and prints milliseconds and the ratio.

    python -m bench.reaper [--rows 10000,1000000] [--expired 1000] [--stores sqlite,postgres]

Environment: BENCH_POSTGRES (postgresql+psycopg://postgres@127.0.0.1:5432/test) and
BENCH_BROKER (redis://127.0.0.1:6379/7; only the queue ``bench_reaper`` is used and deleted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import redis
import sqlalchemy as sa
from celery import Celery

from celery_lease.app_state import app_state
from celery_lease.messaging import messages
from celery_lease.reaper.run import Reaper
from celery_lease.store import Store

QUEUE = "bench_reaper"
EMPTY_RUNS = 5


def numbers(store: Store, rows: int) -> sa.FromClause:
    """A one-column ``n`` source of 1..rows."""
    if store.dialect.name == "postgresql":
        return sa.select(sa.func.generate_series(1, rows).label("n")).subquery("seq")
    seq = sa.select(sa.literal(1).label("n")).cte("seq", recursive=True)
    return seq.union_all(sa.select(seq.c.n + 1).where(seq.c.n < rows))


def build(store: Store, rows: int, expired: int, payload: str) -> None:
    """Fill the jobs table in one statement; the first ``expired`` rows are the victims-to-be."""
    j, now = store.t.jobs, store.now()
    seq = numbers(store, rows)
    n = seq.c.n
    victim = n <= expired
    live_running = sa.and_(n > expired, n % 10 == 2)
    status = sa.case((victim, "running"), (n % 10 == 1, "pending"), (live_running, "running"),
                     else_="completed")
    running = sa.or_(victim, live_running)
    source = sa.select(
        sa.literal("job-") + sa.cast(n, sa.String), sa.literal("celery"), sa.literal("bench.work"),
        sa.case((victim, payload), else_=sa.null()), status, sa.literal(1), sa.literal(0), sa.literal(0),
        sa.literal(5), sa.literal(now - 1.0), sa.case((running, now + 3600.0), else_=sa.null()),
        sa.literal(30.0), sa.literal(0.0),
        sa.case((running, sa.literal("gone@bench:") + sa.cast(n, sa.String))),
        sa.case((running, sa.literal("tok-") + sa.cast(n, sa.String))), sa.literal(now), sa.literal(now),
    ).select_from(seq)
    columns = ["id", "queue_name", "task_name", "payload", "status", "attempt_count", "expired_count",
               "dispatch_count", "max_attempts", "available_at", "lease_expires_at", "lease_duration",
               "grace_period", "locked_by", "lock_token", "created_at", "updated_at"]
    with store.begin(long=True) as c:
        c.execute(sa.insert(j).from_select(columns, source))
    with store.engine.connect() as c:
        c.execute(sa.text("ANALYZE"))
        c.commit()


def expire(store: Store, expired: int) -> None:
    j = store.t.jobs
    with store.begin() as c:
        c.execute(sa.update(j).where(j.c.id.in_([f"job-{n}" for n in range(1, expired + 1)]))
                  .values(lease_expires_at=store.now_sql - 60.0))


def timed(reaper: Reaper) -> tuple[float, object]:
    started = time.perf_counter()
    result = reaper.run_once()
    return (time.perf_counter() - started) * 1000.0, result


def bench(url: str, rows: int, expired: int, broker: str) -> tuple[float, float, float]:
    """(build seconds, median empty run ms, run ms with ``expired`` leases to reap)."""
    prefix = f"b{uuid.uuid4().hex[:8]}_"
    store = Store(url, prefix)
    store.migrate()
    app = Celery("bench_reaper", broker=broker, set_as_current=False)
    app.conf.update(lease_store_url=url, lease_table_prefix=prefix, lease_reaper_batch_size=expired)
    app_state(app).store = store
    try:
        started = time.perf_counter()
        build(store, rows, expired, messages.encode("bench.work", [1], {}, {"queue": QUEUE}))
        built = time.perf_counter() - started
        reaper = Reaper(app, store)
        timed(reaper)  # warm the connection pool and the caches
        empty = []
        for _ in range(EMPTY_RUNS):
            ms, result = timed(reaper)
            assert result.seen == 0 and not result.changed, result
            empty.append(ms)
        expire(store, expired)
        full, result = timed(reaper)
        assert result.reaped == expired, result
        return built, statistics.median(empty), full
    finally:
        store.drop_schema()
        store.engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,1000000")
    parser.add_argument("--expired", type=int, default=1000)
    parser.add_argument("--stores", default="sqlite,postgres")
    args = parser.parse_args()
    broker = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/7")
    client = redis.Redis.from_url(broker)
    client.ping()
    urls = {"postgres": os.environ.get("BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")}
    print(f"{'store':<9}{'rows':>11}{'expired':>9}{'build s':>9}{'empty ms':>10}{'reap ms':>10}"
          f"{'ratio':>8}{'ms/job':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        urls["sqlite"] = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        for name in args.stores.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                built, empty, full = bench(urls[name], rows, args.expired, broker)
                client.delete(QUEUE)
                print(f"{name:<9}{rows:>11,}{args.expired:>9,}{built:>9.1f}{empty:>10.2f}{full:>10.1f}"
                      f"{full / empty:>8.1f}{(full - empty) / args.expired:>8.2f}", flush=True)
    client.close()


if __name__ == "__main__":
    main()
