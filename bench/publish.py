"""LeaseTask's publish cost next to plain Celery: apply_async calls per second, with and without an
idempotency key, and what each publish writes to the store.

Plain and LeaseTask publishes alternate in rounds on the same Redis broker and the same
producer; each ratio is to the mean of the plain rounds just before and after, so drift of the
machine cancels. On PostgreSQL the commits, rows and WAL bytes per publish come from the
server's own statistics, in a database of the bench's own (WAL is counted for the whole server:
run it on an otherwise idle one). Usage: python -m bench.publish [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_lease import LeaseTask
from celery_lease.store import Store

BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/15")
POSTGRES = os.environ.get("CELERY_LEASE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def build(store_url: str, prefix: str) -> tuple[Celery, Any, Any]:
    app = Celery("bench_publish", broker=BROKER, set_as_current=False)
    app.conf.update(lease_store_url=store_url, lease_table_prefix=prefix, task_ignore_result=True)

    @app.task(name="bench.plain", shared=False)
    def plain(n: int) -> int:
        return n

    @app.task(base=LeaseTask, name="bench.leased", shared=False)
    def leased(n: int) -> int:
        return n

    return app, plain, leased


def rate(app: Celery, task: Any, calls: int, keyed: bool) -> float:
    """apply_async calls per second over one round (``keyed``: a fresh idempotency key each)."""
    round_id = uuid.uuid4().hex[:8]
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for i in range(calls):
            options = {"idempotency_key": f"{round_id}:{i}"} if keyed else {}
            task.apply_async((i,), producer=producer, **options)
        return calls / (time.perf_counter() - started)


def _pg_counters(store: Store) -> tuple[int, int, int]:
    """(transactions committed, rows inserted, WAL bytes) of the test database so far."""
    with store.engine.connect() as c:
        xact, rows = c.execute(sa.text(
            "SELECT xact_commit, tup_inserted FROM pg_stat_database WHERE datname = current_database()"
        )).one()
        wal = c.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
    return int(xact), int(rows), int(wal)


def per_publish(app: Celery, task: Any, store: Store, calls: int, keyed: bool) -> dict[str, float]:
    """What the store did per LeaseTask publish, from PostgreSQL's statistics.

    A server process reports its counters when it goes idle for a while or exits: the app's
    pooled connections are closed before each reading, so every publish is counted.
    """
    from celery_lease.store import for_app

    for_app(app, check=False).engine.dispose()
    before = _pg_counters(store)
    rate(app, task, calls, keyed)
    for_app(app, check=False).engine.dispose()
    time.sleep(0.5)  # the exiting server processes flush their counters as they go
    after = _pg_counters(store)
    # The reading's own connection commits once per reading.
    return {name: (b - a - (1 if name == "commits" else 0)) / calls
            for name, a, b in zip(("commits", "rows", "WAL bytes"), before, after, strict=True)}


def bench_database(url: str) -> str:
    """The URL of a database of the bench's own on the same server (created when missing)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            exists = sa.text("SELECT 1 FROM pg_database WHERE datname = 'celery_lease_bench'")
            if not c.execute(exists).scalar():
                c.execute(sa.text("CREATE DATABASE celery_lease_bench"))
    finally:
        engine.dispose()
    return sa.engine.make_url(url).set(database="celery_lease_bench").render_as_string(hide_password=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stores", default="postgres,sqlite")
    args = parser.parse_args()
    client = redis.Redis.from_url(BROKER)
    print(f"{args.calls} apply_async calls per round, Redis broker {BROKER}; plain rounds alternate with "
          f"LeaseTask rounds, each ratio to the mean of the plain rounds around it; {args.rounds} rounds")
    print(f"{'store':10} {'key':4} {'plain/s':>8} {'lease/s':>8}  {'ratios by round':20} median")
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"postgres": bench_database(POSTGRES), "sqlite": f"sqlite:///{Path(tmp) / 'publish.sqlite3'}"}
        for name in args.stores.split(","):
            prefix = f"bp{uuid.uuid4().hex[:6]}_"
            app, plain, leased = build(urls[name], prefix)
            store = Store(urls[name], prefix)
            store.migrate()
            try:
                rate(app, plain, 200, False)  # warm the producer and the pools
                rate(app, leased, 200, False)
                for keyed in (False, True):
                    plains, leases, ratios = [rate(app, plain, args.calls, False)], [], []
                    for _ in range(args.rounds):
                        leases.append(rate(app, leased, args.calls, keyed))
                        plains.append(rate(app, plain, args.calls, False))
                        ratios.append(leases[-1] / statistics.mean(plains[-2:]))
                        client.flushdb()
                    print(f"{name:10} {'yes' if keyed else 'no':4} {statistics.median(plains):8.0f} "
                          f"{statistics.median(leases):8.0f}  {' '.join(f'{r:.2f}' for r in ratios):20} "
                          f"{statistics.median(ratios):.2f}")
                if name == "postgres":
                    for keyed in (False, True):
                        cost = per_publish(app, leased, store, 1000, keyed)
                        print(f"  per publish ({'with' if keyed else 'without'} a key): "
                              + ", ".join(f"{v:.2f} {k}" if k != "WAL bytes" else f"{v:.0f} {k}"
                                          for k, v in cost.items()))
            finally:
                client.flushdb()
                store.drop_schema()
                store.engine.dispose()
                app.close()


if __name__ == "__main__":
    main()
