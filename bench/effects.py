"""effect() per call next to a bare INSERT of the same row, on PostgreSQL by default.

Each pair writes the same effects row (key, job id, store clock) in its own transaction:
the bare INSERT is the floor any "record this key" costs; effect() adds the token fence
(an ``INSERT ... SELECT`` from the job row). Also timed: both inside a caller's
transaction, effect() on a key that exists (first=False, a second read), and
lock()+release next to a bare INSERT+DELETE. Rounds alternate; medians are printed.

Usage: python -m bench.effects [--calls 500] [--rounds 5] [--url URL]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from collections.abc import Callable
from itertools import count

import sqlalchemy as sa

from celery_lease import deadline
from celery_lease.config import load
from celery_lease.store import ClaimTerms, Store
from celery_lease.worker.effects import effect
from celery_lease.worker.lease import Lease
from celery_lease.worker.locks import lock
from celery_lease.worker.runtime import Runtime

POSTGRES = os.environ.get("CELERY_LEASE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def held_lease(store: Store) -> Lease:
    rt = Runtime(store, "bench", default_interval=10.0, worker="bench:1")
    store.publishes.record("bench-job", "bench.effects", "q", "{}", 5)
    token = secrets.token_hex(16)
    sent = deadline.monotonic()
    got = store.jobs.claim("bench-job", rt.worker, token,
                           ClaimTerms(duration=3600.0, grace=0.0,
                                      max_attempts=5, max_expirations=5, takeover=False),
                           task_name="bench.effects", queue="q", payload=lambda: None)
    assert got.claimed
    policy = load({}).policy({"lease_duration": 3600.0, "lease_heartbeat_interval": 10.0})
    return Lease(rt, "bench-job", token, 1, policy, "bench.effects:bench-job", None, sent_at=sent)


def per_call(fn: Callable[[], None], calls: int) -> float:
    """Microseconds per call of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--url", default=POSTGRES)
    args = parser.parse_args()

    store = Store(args.url, prefix=f"bench{secrets.token_hex(3)}_")
    store.migrate()
    try:
        run(store, args.calls, args.rounds)
    finally:
        store.drop_schema()
        store.engine.dispose()


def run(store: Store, calls: int, rounds: int) -> None:
    lease, e, engine = held_lease(store), store.t.effects, store.engine
    ids = count()

    def bare() -> None:
        with engine.begin() as c:
            c.execute(sa.insert(e).values(key=f"bare:{next(ids)}", job_id=lease.job_id, at=store.now_sql))

    def fenced() -> None:
        with effect(lease, f"fx:{next(ids)}"):
            pass

    def bare_in_tx() -> None:
        with engine.begin() as c:
            c.execute(sa.insert(e).values(key=f"bare:{next(ids)}", job_id=lease.job_id, at=store.now_sql))

    def fenced_in_tx() -> None:
        with engine.begin() as c, effect(lease, f"fx:{next(ids)}", connection=c):
            pass

    with effect(lease, "fx:existing"):
        pass

    def duplicate() -> None:
        with effect(lease, "fx:existing"):
            pass

    locks = store.t.locks

    def bare_lock() -> None:
        with engine.begin() as c:
            c.execute(sa.insert(locks).values(resource="acct:1", token="t", job_id=lease.job_id,
                                              owner=lease.worker, expires_at=store.now_sql + 30.0))
        with engine.begin() as c:
            c.execute(sa.delete(locks).where(locks.c.resource == "acct:1", locks.c.token == "t"))

    def fenced_lock() -> None:
        with lock(lease, "acct:1", ttl=60.0, timeout=0):
            pass

    pairs = {
        "effect(), own transaction": (bare, fenced),
        "effect(connection=...)": (bare_in_tx, fenced_in_tx),
        "effect(), key exists": (bare, duplicate),
        "lock() vs INSERT+DELETE": (bare_lock, fenced_lock),
    }
    for fn in [f for pair in pairs.values() for f in pair]:
        per_call(fn, min(200, calls))  # warm the pool and the plans
    times: dict[str, list[list[float]]] = {name: [[], []] for name in pairs}
    for _ in range(rounds):
        for name, (base, ours) in pairs.items():
            times[name][0].append(per_call(base, calls))
            times[name][1].append(per_call(ours, calls))

    print(f"store: {store.safe_url} ({store.dialect.name}); {calls} calls x {rounds} rounds, medians")
    print(f"{'case':<28}{'bare SQL us':>13}{'celery_lease us':>17}{'ratio':>8}")
    for name, (base, ours) in times.items():
        b, o = statistics.median(base), statistics.median(ours)
        print(f"{name:<28}{b:>13.1f}{o:>17.1f}{o / b:>8.2f}")


if __name__ == "__main__":
    main()
