"""LeaseTask's cost next to plain Celery: tasks/s for no-op and 10 ms tasks, and heartbeat statements.

Both kinds of task run in the same run, on the same Redis broker and the same worker
settings (prefork -c4 and threads -c8 by default); the ratio is what counts. On PostgreSQL
the worker's commits, rows written and WAL bytes per job come from the server's own
statistics (a database of the bench's own). Each round also runs the two floors (bench/_floor.py):
plain tasks with the least a durable claim and completion cost at one commit per job ("floor"),
and with the same writes sharing a commit with those due at the same moment in the process
("group"), to the same plain runs; on prefork a third, "main": the same writes made by the worker's main
process for its children, the claims and completions of one event-loop turn in one commit.
Usage: python -m bench.overhead [--tasks 5000]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
import sqlalchemy as sa

from bench import _pg, _results
from bench._floor import Floor
from celery_lease import deadline
from celery_lease.app_state import app_state
from celery_lease.config import load
from celery_lease.store import ClaimTerms, Store
from celery_lease.worker.lease import Lease
from celery_lease.worker.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/15")


def run(task: str, seconds: float, n: int, store_url: str, prefix: str, pool: str, concurrency: int,
        cost: dict[str, float] | None = None) -> float:
    """Publish n tasks, start a worker, return tasks/s between the first and last execution.

    ``cost`` (PostgreSQL stores) receives the worker's store writes per job.
    """
    client = redis.Redis.from_url(BROKER)
    client.flushdb()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_BROKER": BROKER, "BENCH_STORE": store_url,
           "BENCH_PREFIX": prefix}
    os.environ.update({k: env[k] for k in ("BENCH_BROKER", "BENCH_STORE", "BENCH_PREFIX")})
    from bench import _overhead_app as bench_app

    bench_app.app.conf.update(lease_store_url=store_url, lease_table_prefix=prefix)
    app_state(bench_app.app).config = None
    app_state(bench_app.app).store = None
    target = {"leased": bench_app.leased, "floor": bench_app.floored, "groupfloor": bench_app.group_floored,
              "mainfloor": bench_app.main_floored}.get(task, bench_app.plain)
    floor = Floor(store_url, prefix) if task in ("floor", "groupfloor", "mainfloor") else None
    if floor is not None:
        floor.create()
    if task == "leased":
        from celery_lease.store import for_app

        for_app(bench_app.app, check=False).migrate()  # publishing never creates tables
    with bench_app.app.producer_or_acquire() as producer:
        for _ in range(n):
            target.apply_async((seconds,), producer=producer)
    measured = cost is not None and store_url.startswith("postgresql")
    if measured:
        from celery_lease.store import for_app

        for_app(bench_app.app, check=False).engine.dispose()
        time.sleep(0.5)  # the publisher's server processes flush their counters as they exit
        before = _pg.counters(store_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench._overhead_app", "worker", "-P", pool,
         "-c", str(concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat",
         "-l", "WARNING"], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while int(client.get("done") or 0) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{task}: only {client.get('done')} of {n} tasks ran in 600 s")
            time.sleep(0.2)
        first, last = float(client.get("first")), float(client.get("last"))
        # A floor counts only if it wrote what it stands for: every job's completion committed.
        while floor is not None and floor.completed() < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{task}: {floor.completed()} of {n} completions committed in 600 s")
            time.sleep(0.2)
        return (n - 1) / (last - first)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        client.flushdb()
        if floor is not None:
            floor.drop()
            floor.close()
        if measured and cost is not None:
            time.sleep(0.5)
            cost.update(_pg.per_job(before, _pg.counters(store_url), n))


def heartbeat_statements(store: Store, leases: int, rounds: int = 5) -> tuple[float, float]:
    """Statements per heartbeat round while this process holds ``leases`` leases: (lease renewals, all)."""
    rt = Runtime(store, "bench", 1.0, worker=f"bench:{leases}")
    hb = rt.heartbeat
    policy = load({}).policy()
    for i in range(leases):
        job_id = f"hb-{leases}-{i}"
        store.publishes.record(job_id, "bench.leased", "celery", None, 5)
        tok = secrets.token_hex(16)
        sent = deadline.monotonic()
        store.jobs.claim(job_id, rt.worker, tok,
                         ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=3,
                                    takeover=False),
                         task_name="bench.leased", queue="celery", payload=lambda: None)
        rt.attach(object(), Lease(rt, job_id, tok, 1, policy, job_id, None, sent_at=sent))
    hb.beat()  # the first round registers the process
    statements: list[str] = []

    me = threading.get_ident()

    def collect(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        # The runtime's own heartbeat thread beats too while a long round runs: count ours only.
        if threading.get_ident() == me:
            statements.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", collect)
    try:
        for _ in range(rounds):
            hb.beat()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", collect)
        rt.stop()
    renewals = [s for s in statements if f"UPDATE {store.t.jobs.name} " in s]
    return len(renewals) / rounds, len(statements) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--pools", default="prefork:4,threads:8", help="comma-separated POOL:CONCURRENCY")
    parser.add_argument("--bodies", default="no-op,10 ms", help="comma-separated: no-op, 10 ms")
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--rounds", type=int, default=3, help="LeaseTask runs per body and store")
    parser.add_argument("--save", action="store_true", help="write bench/results/overhead.json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    every = {"sqlite": f"sqlite:///{tmp / 'lease.sqlite3'}", "postgres": _pg.bench_database()}
    stores = {name: every[name] for name in args.stores.split(",")}
    bodies = {name: seconds for name, seconds in (("no-op", 0.0), ("10 ms", 0.01))
              if name in args.bodies.split(",")}
    pools = [(pool, int(c)) for pool, c in (item.split(":") for item in args.pools.split(","))]
    print(f"{args.tasks} tasks per run, Redis broker {BROKER}")
    print("plain runs alternate with LeaseTask runs; each ratio is to the mean of the plain runs"
          f" just before and after, so drift of the machine shows and cancels; {args.rounds} rounds,"
          " the median ratio counts")
    print("floor: plain Celery with the least a durable claim and completion cost, one commit each"
          " (bench/_floor.py); group: the same writes sharing commits within a process; main (prefork): the"
          " same writes made by the main process, one commit per event-loop turn; all to the same plain runs")
    print(f"{'pool':<11} {'task body':<10} {'store':<9} {'plain/s':>9} {'lease/s':>9} {'ratios by round':>18}"
          f" {'median':>7} {'floor':>7} {'group':>7} {'main':>7}")
    costs: dict[str, dict[str, float]] = {}
    rows: list[dict[str, object]] = []
    for pool, concurrency in pools:
        for label, seconds in bodies.items():
            ratios: dict[str, list[float]] = {name: [] for name in stores}
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
            floors: dict[str, list[float]] = {name: [] for name in stores}
            groups: dict[str, list[float]] = {name: [] for name in stores}
            mains: dict[str, list[float]] = {name: [] for name in stores}
            plain = run("plain", seconds, args.tasks, every["sqlite"], "unused_", pool, concurrency)
            for _ in range(args.rounds):
                for name, url in stores.items():
                    prefix = f"b{secrets.token_hex(3)}_"
                    cost: dict[str, float] = {}
                    leased = run("leased", seconds, args.tasks, url, prefix, pool, concurrency, cost)
                    if cost:
                        costs[f"{pool} -c{concurrency}, {label}"] = cost
                    floor_cost: dict[str, float] = {}
                    floored = run("floor", seconds, args.tasks, url, prefix, pool, concurrency, floor_cost)
                    group_cost: dict[str, float] = {}
                    grouped = run("groupfloor", seconds, args.tasks, url, prefix, pool, concurrency,
                                  group_cost)
                    main_cost: dict[str, float] = {}
                    main = (run("mainfloor", seconds, args.tasks, url, prefix, pool, concurrency, main_cost)
                            if pool == "prefork" else None)
                    if floor_cost:
                        costs[f"{pool} -c{concurrency}, {label}, floor"] = floor_cost
                        costs[f"{pool} -c{concurrency}, {label}, group"] = group_cost
                    if main_cost:
                        costs[f"{pool} -c{concurrency}, {label}, main"] = main_cost
                    after = run("plain", seconds, args.tasks, every["sqlite"], "unused_", pool, concurrency)
                    ratios[name].append(leased / ((plain + after) / 2))
                    floors[name].append(floored / ((plain + after) / 2))
                    groups[name].append(grouped / ((plain + after) / 2))
                    if main is not None:
                        mains[name].append(main / ((plain + after) / 2))
                    rates[name].append(((plain + after) / 2, leased))
                    store = Store(url, prefix)
                    store.drop_schema()
                    store.engine.dispose()
                    plain = after
            for name in stores:
                plain_rate = statistics.median(p for p, _ in rates[name])
                lease_rate = statistics.median(lr for _, lr in rates[name])
                by_round = " ".join(f"{r:.2f}" for r in ratios[name])
                rows.append({"pool": f"{pool} -c{concurrency}", "body": label, "store": name,
                             "plain": plain_rate, "lease": lease_rate, "ratios": ratios[name],
                             "median": statistics.median(ratios[name]), "floors": floors[name],
                             "floor": statistics.median(floors[name]), "groups": groups[name],
                             "group": statistics.median(groups[name]),
                             **({"mains": mains[name], "main": statistics.median(mains[name])}
                                if mains[name] else {})})
                main_median = f"{statistics.median(mains[name]):>7.2f}" if mains[name] else f"{'-':>7}"
                print(f"{pool + ' -c' + str(concurrency):<11} {label:<10} {name:<9} {plain_rate:>9.0f}"
                      f" {lease_rate:>9.0f} {by_round:>18} {statistics.median(ratios[name]):>7.2f}"
                      f" {statistics.median(floors[name]):>7.2f} {statistics.median(groups[name]):>7.2f}"
                      f" {main_median}")
    if costs:
        print("\nthe worker's PostgreSQL writes per job (last round; LeaseTask, then the floors):")
        for label, cost in costs.items():
            print(f"  {label:<24} {_pg.describe(cost)}")
    print("\nstatements per heartbeat round and process, by leases held: lease renewals / all"
          " (PostgreSQL: renewal and worker registry in one statement; SQLite: BEGIN IMMEDIATE,"
          " registry upsert, renewal)")
    heartbeats: dict[str, dict[str, list[float]]] = {}
    for name, url in stores.items():
        store = Store(url, f"h{secrets.token_hex(3)}_")
        store.migrate()
        try:
            counts = {n: heartbeat_statements(store, n) for n in (1, 10, 100, 1000)}
            row = "  ".join(f"{n} leases: {r:.0f} / {a:.0f}" for n, (r, a) in counts.items())
            print(f"  {name:<9} {row}")
            heartbeats[name] = {str(n): list(v) for n, v in counts.items()}
        finally:
            store.drop_schema()
            store.engine.dispose()
    if args.save:
        _results.save("overhead", {"tasks": args.tasks, "rounds": args.rounds, "rows": rows,
                                   "store_writes_per_job": costs, "heartbeat_statements": heartbeats})


if __name__ == "__main__":

    main()
