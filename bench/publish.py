"""LeaseTask's publish cost next to plain Celery: apply_async calls per second, with and without an
idempotency key, and what each publish writes to the store.

Plain and LeaseTask publishes alternate in rounds on the same Redis broker and the same
producer; each ratio is to the mean of the plain rounds just before and after, so drift of the
machine cancels. On PostgreSQL the commits, rows and WAL bytes per publish come from the
server's own statistics, in a database of the bench's own (WAL is counted for the whole server:
run it on an otherwise idle one). PostgreSQL runs twice: at the defaults, and with the opt-in
lease_publish_async_commit. Before them, per store, the floor (bench/_floor.py): plain
publishes each after the least a durable record of it costs, to the same plain rounds. Then
whole groups: a group of 1,000 signatures published at once,
tasks per second. Then publishes from many threads at once (a web server's): ``--threads``
threads share the calls, plain and LeaseTask alternating (at the defaults, then with
lease_group_commit), next to the group floor (each record sharing a commit with those due at the
same moment). Usage: python -m bench.publish [--calls 2000]
[--rounds 3] [--group 1000] [--threads 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery, group

from bench import _pg, _results
from bench._floor import Floor, GroupFloor
from celery_lease import LeaseTask
from celery_lease.store import Store
from celery_lease.store.publishes import RECORD_BATCH

BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/15")


# A store of the bench, and the settings its app adds: "postgres-async" is PostgreSQL with the
# opt-in publish that does not wait for the WAL flush.
MODES: dict[str, dict[str, Any]] = {"postgres": {}, "postgres-async": {"lease_publish_async_commit": True},
                                    "sqlite": {}}


def build(store_url: str, prefix: str, **settings: Any) -> tuple[Celery, Any, Any]:
    app = Celery("bench_publish", broker=BROKER, set_as_current=False)
    app.conf.update(lease_store_url=store_url, lease_table_prefix=prefix, task_ignore_result=True, **settings)

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


def floor_rate(app: Celery, task: Any, calls: int, floor: Floor, payload: str) -> float:
    """Plain apply_async calls per second, each after the least a durable record of it costs."""
    with app.producer_or_acquire() as producer:
        started = time.perf_counter()
        for i in range(calls):
            job_id = str(uuid.uuid4())
            floor.record(job_id, payload)
            task.apply_async((i,), producer=producer, task_id=job_id)
        return calls / (time.perf_counter() - started)


def threaded_rate(app: Celery, task: Any, calls: int, threads: int, floor: Floor | None = None,
                  payload: str = "") -> float:
    """apply_async calls per second with ``threads`` threads publishing at once, each on its own
    producer (``floor``: each call after the floor's record of it)."""
    start = threading.Barrier(threads + 1)

    def publish(share: int) -> None:
        with app.producer_or_acquire() as producer:
            start.wait()
            for i in range(share):
                job_id = str(uuid.uuid4())
                if floor is not None:
                    floor.record(job_id, payload)
                task.apply_async((i,), producer=producer, task_id=job_id)

    workers = [threading.Thread(target=publish, args=(calls // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    return (calls // threads * threads) / (time.perf_counter() - started)


def group_rate(app: Celery, task: Any, size: int) -> float:
    """Tasks per second published as one ``group`` of a list of ``size`` signatures (a group made
    from a generator is sent as the generator yields, one record per publish)."""
    started = time.perf_counter()
    group([task.s(i) for i in range(size)]).apply_async()
    return size / (time.perf_counter() - started)


def per_publish(app: Celery, task: Any, url: str, calls: int, keyed: bool) -> dict[str, float]:
    """What the store did per LeaseTask publish, from PostgreSQL's statistics.

    The app's pooled connections are closed before each reading, so that the server
    processes report every publish.
    """
    from celery_lease.store import for_app

    for_app(app, check=False).engine.dispose()
    before = _pg.counters(url)
    rate(app, task, calls, keyed)
    for_app(app, check=False).engine.dispose()
    time.sleep(0.5)  # the exiting server processes flush their counters as they go
    return _pg.per_job(before, _pg.counters(url), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group", type=int, default=1000, help="signatures per group in the group rounds")
    parser.add_argument("--stores", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=8, help="publishing threads in the threaded rounds")
    parser.add_argument("--save", action="store_true", help="write the figures to bench/results/publish.json")
    args = parser.parse_args()
    client = redis.Redis.from_url(BROKER)
    print(f"{args.calls} apply_async calls per round, Redis broker {BROKER}; plain rounds alternate with "
          f"LeaseTask rounds, each ratio to the mean of the plain rounds around it; {args.rounds} rounds")
    print(f"{'store':14} {'key':4} {'plain/s':>8} {'lease/s':>8}  {'ratios by round':20} median")
    rows: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    floor_rows: list[dict[str, Any]] = []
    threaded: list[dict[str, Any]] = []
    costs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pg = _pg.bench_database()
        urls = {"postgres": pg, "postgres-async": pg, "sqlite": f"sqlite:///{Path(tmp) / 'publish.sqlite3'}"}
        for name in args.stores.split(","):
            prefix = f"bp{uuid.uuid4().hex[:6]}_"
            app, plain, leased = build(urls[name], prefix, **MODES[name])
            store = Store(urls[name], prefix)
            store.migrate()
            try:
                rate(app, plain, 200, False)  # warm the producer and the pools
                rate(app, leased, 200, False)
                # The floor's record holds a message of the size LeaseTask's records hold.
                with store.engine.connect() as c:
                    length = sa.func.length(store.t.jobs.c.payload)
                    size = c.execute(sa.select(sa.func.avg(length))).scalar_one()
                payload = "x" * int(size)
                floor = Floor(urls[name], prefix)
                floor.create()
                if name != "postgres-async":
                    plains, floors = [rate(app, plain, args.calls, False)], []
                    for _ in range(args.rounds):
                        floors.append(floor_rate(app, plain, args.calls, floor, payload))
                        plains.append(rate(app, plain, args.calls, False))
                        floors[-1] /= statistics.mean(plains[-2:])
                        client.flushdb()
                    floor_rows.append({"store": name, "ratios": floors, "median": statistics.median(floors)})
                    print(f"{name:14} {'floor':18} {statistics.median(plains):8.0f} {'':8}  "
                          f"{' '.join(f'{r:.2f}' for r in floors):20} {statistics.median(floors):.2f}")
                floor.drop()
                floor.close()
                for keyed in (False, True):
                    plains, leases, ratios = [rate(app, plain, args.calls, False)], [], []
                    for _ in range(args.rounds):
                        leases.append(rate(app, leased, args.calls, keyed))
                        plains.append(rate(app, plain, args.calls, False))
                        ratios.append(leases[-1] / statistics.mean(plains[-2:]))
                        client.flushdb()
                    rows.append({"store": name, "key": keyed, "plain": statistics.median(plains),
                                 "lease": statistics.median(leases), "ratios": ratios,
                                 "median": statistics.median(ratios)})
                    print(f"{name:14} {'yes' if keyed else 'no':4} {statistics.median(plains):8.0f} "
                          f"{statistics.median(leases):8.0f}  {' '.join(f'{r:.2f}' for r in ratios):20} "
                          f"{statistics.median(ratios):.2f}")
                plains, leases, ratios = [group_rate(app, plain, args.group)], [], []
                for _ in range(args.rounds):
                    leases.append(group_rate(app, leased, args.group))
                    plains.append(group_rate(app, plain, args.group))
                    ratios.append(leases[-1] / statistics.mean(plains[-2:]))
                    client.flushdb()
                groups.append({"store": name, "plain": statistics.median(plains),
                               "lease": statistics.median(leases), "ratios": ratios,
                               "median": statistics.median(ratios)})
                print(f"{name:14} {'group of ' + str(args.group):18} {statistics.median(plains):8.0f} "
                      f"{statistics.median(leases):8.0f}  {' '.join(f'{r:.2f}' for r in ratios):20} "
                      f"{statistics.median(ratios):.2f}")
                if name != "postgres-async":
                    # The same publishes with lease_group_commit: records due at once share a commit.
                    grouped_app, _, grouped = build(urls[name], prefix, **MODES[name],
                                                    lease_group_commit=True)
                    try:
                        row = threaded_rounds(app, plain, leased, grouped, urls[name], prefix, payload, args,
                                              client)
                    finally:
                        grouped_app.close()
                    threaded.append({"store": name, **row})
                    print(f"{name:14} {str(args.threads) + ' threads':18} {row['plain']:8.0f} "
                          f"{row['lease']:8.0f}  "
                          f"{' '.join(f'{r:.2f}' for r in row['ratios']):20} {row['median']:.2f}"
                          f"  (lease_group_commit {row['grouped']:.2f}: "
                          f"{' '.join(f'{r:.2f}' for r in row['grouped_ratios'])}; "
                          f"group floor {row['floor']:.2f})")
                if name == "postgres":
                    for keyed in (False, True):
                        cost = per_publish(app, leased, urls[name], 1000, keyed)
                        costs["with a key" if keyed else "without a key"] = cost
                        print(f"  per publish ({'with' if keyed else 'without'} a key): {_pg.describe(cost)}")
            finally:
                client.flushdb()
                store.drop_schema()
                store.engine.dispose()
                app.close()
    if args.save:
        _results.save("publish", {"calls": args.calls, "rounds": args.rounds, "rows": rows,
                                  "group": args.group, "batch": RECORD_BATCH, "groups": groups,
                                  "floors": floor_rows, "threads": args.threads, "threaded": threaded,
                                  "store_writes_per_publish": costs})


def threaded_rounds(app: Celery, plain: Any, leased: Any, grouped: Any, url: str, prefix: str, payload: str,
                    args: argparse.Namespace, client: Any) -> dict[str, Any]:
    """Plain, LeaseTask (the default, then with lease_group_commit) and group-floor publishes from
    ``args.threads`` threads, alternating by round."""
    floor = GroupFloor(url, prefix)
    floor.create()
    try:
        threaded_rate(grouped.app, grouped, 200, args.threads)  # warm the grouped app's producer and pool
        plains = [threaded_rate(app, plain, args.calls, args.threads)]
        leases, ratios, floors, groups = [], [], [], []
        for _ in range(args.rounds):
            leases.append(threaded_rate(app, leased, args.calls, args.threads))
            groups.append(threaded_rate(grouped.app, grouped, args.calls, args.threads))
            floors.append(threaded_rate(app, plain, args.calls, args.threads, floor, payload))
            plains.append(threaded_rate(app, plain, args.calls, args.threads))
            mean = statistics.mean(plains[-2:])
            ratios.append(leases[-1] / mean)
            groups[-1] /= mean
            floors[-1] /= mean
            client.flushdb()
    finally:
        floor.drop()
        floor.close()
    return {"plain": statistics.median(plains), "lease": statistics.median(leases), "ratios": ratios,
            "median": statistics.median(ratios), "grouped_ratios": groups,
            "grouped": statistics.median(groups), "floors": floors, "floor": statistics.median(floors)}


if __name__ == "__main__":
    main()
