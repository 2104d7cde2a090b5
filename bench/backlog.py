"""Claim and complete on a table with a long history and a backlog, next to an empty table.

A worker's two writes per job must not slow down as the jobs table fills: 1,000,000
completed jobs (with three events each) and a 100,000-job pending backlog are generated
inside the database, and the same claim + complete of fresh jobs is timed on it and on an
empty table of the same schema, alternately, in one process. Also printed: what the two
writes cost per job on PostgreSQL: statements (counted by a SQLAlchemy hook), and commits,
rows written and WAL bytes from the server's own statistics.

Usage: python -m bench.backlog [--history 1000000] [--backlog 100000] [--jobs 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
import uuid

import sqlalchemy as sa

from bench import _pg, _results
from celery_lease.store import ClaimTerms, Store

TERMS = ClaimTerms(duration=30.0, grace=5.0, max_attempts=5, max_expirations=3, takeover=False)

JOBS = """
INSERT INTO {jobs} (id, queue_name, task_name, payload, status, attempt_count, expired_count,
    dispatch_count, max_attempts, available_at, started_at, completed_at, created_at, updated_at)
SELECT 'old-' || i, 'celery', 'bench.task', '{{"v": 1}}',
    CASE WHEN i <= :backlog THEN 'pending' ELSE 'completed' END,
    CASE WHEN i <= :backlog THEN 0 ELSE 1 END, 0, 0, 5,
    :now - (i % 3600),
    CASE WHEN i > :backlog THEN :now - 86400 + (i % 86400) END,
    CASE WHEN i > :backlog THEN :now - 86400 + (i % 86400) + 0.01 END,
    :now - 86400 - (i % 86400), :now - (i % 86400)
FROM generate_series(1, :total) AS g(i)
"""
EVENTS = """
INSERT INTO {events} (job_id, event, worker, at)
SELECT 'old-' || i, e.name, 'w1', :now - 86400 + (i % 86400)
FROM generate_series(:backlog + 1, :total) AS g(i),
     (VALUES ('published'), ('claimed'), ('completed')) AS e(name)
"""


def fill(store: Store, url: str, history: int, backlog: int) -> None:
    """``history`` completed jobs with their events and ``backlog`` pending ones, made by the server.

    On an engine of its own: the store's engine bounds every statement to seconds.
    """
    params = {"now": store.now(), "backlog": backlog, "total": history + backlog}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(sa.text(JOBS.format(jobs=store.t.jobs.name)), params)
            c.execute(sa.text(EVENTS.format(events=store.t.events.name)), params)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            for table in (store.t.jobs.name, store.t.events.name):
                c.exec_driver_sql(f"VACUUM ANALYZE {table}")
            # The fill's WAL would otherwise be flushed during the first timed rounds.
            c.exec_driver_sql("CHECKPOINT")
    finally:
        engine.dispose()


def analyze(url: str, store: Store) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            for table in (store.t.jobs.name, store.t.events.name):
                c.exec_driver_sql(f"VACUUM ANALYZE {table}")
    finally:
        engine.dispose()
    store.engine.dispose()  # new connections, new plans


def claim_and_complete(store: Store, jobs: int) -> float:
    """Seconds per job for the claim and the completion of ``jobs`` freshly published jobs."""
    ids = [f"new-{uuid.uuid4().hex}" for _ in range(jobs)]
    for job_id in ids:
        store.publishes.record(job_id, "bench.task", "celery", '{"v": 1}', 5)
    started = time.perf_counter()
    for job_id in ids:
        token = secrets.token_hex(16)
        claim = store.jobs.claim(job_id, "bench:1", token, TERMS, task_name="bench.task", queue="celery",
                                 payload=lambda: None)
        assert claim.claimed, claim
        assert store.jobs.complete(job_id, token, "bench:1")
    return (time.perf_counter() - started) / jobs


def cost_per_job(store: Store, url: str, jobs: int) -> dict[str, float]:
    """Statements, commits, rows written and WAL bytes of one claim + complete."""
    ids = [f"cost-{uuid.uuid4().hex}" for _ in range(jobs)]
    for job_id in ids:
        store.publishes.record(job_id, "bench.task", "celery", '{"v": 1}', 5)
    statements = []

    def count(*_: object) -> None:
        statements.append(1)

    # The hot transitions run compiled statements on the driver, past SQLAlchemy's events.
    compiled = store.audited._execute_compiled

    def counted(*args: object) -> object:
        statements.append(1)
        return compiled(*args)

    store.engine.dispose()
    before = _pg.counters(url)
    sa.event.listen(store.engine, "before_cursor_execute", count)
    store.audited._execute_compiled = counted  # type: ignore[method-assign]
    try:
        for job_id in ids:
            token = secrets.token_hex(16)
            store.jobs.claim(job_id, "bench:1", token, TERMS, task_name="bench.task", queue="celery",
                             payload=lambda: None)
            store.jobs.complete(job_id, token, "bench:1")
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", count)
        del store.audited._execute_compiled
    store.engine.dispose()
    time.sleep(0.5)  # the exiting server process flushes its counters as it goes
    cost = _pg.per_job(before, _pg.counters(url), jobs)
    return {"statements": len(statements) / jobs, **cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save", action="store_true", help="write the figures to bench/results/backlog.json")
    args = parser.parse_args()
    url = _pg.bench_database()
    empty = Store(url, f"be{secrets.token_hex(3)}_")
    full = Store(url, f"bf{secrets.token_hex(3)}_")
    try:
        for store in (empty, full):
            store.migrate()
        started = time.perf_counter()
        fill(full, url, args.history, args.backlog)
        print(f"PostgreSQL; {args.history:,} completed jobs ({3 * args.history:,} events) and a "
              f"{args.backlog:,}-job backlog generated in {time.perf_counter() - started:.0f} s; "
              f"{args.jobs} jobs claimed and completed per run, one connection, empty and full alternate "
              f"(order flipped each round)")
        claim_and_complete(empty, 200)  # warm both pools and statement caches
        claim_and_complete(full, 200)
        # Both tables analyzed, as autovacuum leaves them: a table the planner has never seen
        # analyzed plans its first statements for an empty table (measured: twice as slow).
        analyze(url, empty)
        ratios, times = [], {"empty": [], "full": []}
        for i in range(args.rounds):
            # The order flips each round, so neither table always runs on a warmer machine.
            for name in ("empty", "full") if i % 2 == 0 else ("full", "empty"):
                times[name].append(claim_and_complete(empty if name == "empty" else full, args.jobs))
            ratios.append(times["full"][-1] / times["empty"][-1])
        print(f"{'table':8} {'ms per job (claim + complete), by round':40} median")
        for name, values in times.items():
            by_round = " ".join(f"{v * 1000:.3f}" for v in values)
            print(f"{name:8} {by_round:40} {statistics.median(values) * 1000:.3f}")
        print(f"full / empty, by round: {' '.join(f'{r:.2f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}")
        costs = {}
        for name, store in (("empty", empty), ("full", full)):
            cost = costs[name] = cost_per_job(store, url, 1000)
            print(f"  per job on the {name} table: {cost['statements']:.2f} statements, "
                  + _pg.describe({k: v for k, v in cost.items() if k != "statements"}))
        if args.save:
            _results.save("backlog", {"history": args.history, "backlog": args.backlog, "jobs": args.jobs,
                                      "seconds_per_job": times, "ratios": ratios,
                                      "median": statistics.median(ratios), "store_writes_per_job": costs})
    finally:
        for store in (empty, full):
            store.drop_schema()
            store.engine.dispose()


if __name__ == "__main__":
    main()
