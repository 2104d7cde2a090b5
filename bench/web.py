"""The web page's overview over a 1,000,000-row jobs table on PostgreSQL, and what its means cost writers.

The table is bench/exporter.py's busy week (generate_series: mostly completed history, plus
1,000 running jobs, 5,000 pending, 2,000 dead letters, the last 15 minutes' completions and an
events table as large). The overview is requested over real HTTP from `celery lease web`'s
application served by waitress in a process of its own, as a browser does; the whole-table
GROUP BY of `lease status` is timed beside it for comparison.

The overview's counts need no index and no table of their own (ranges of the status
indexes that claim and completion already maintain), so their cost to writers is the read
load of an operator's open page: claim + complete runs alternately alone and while the
overview is polled at the page's own refresh interval, round after round, and the ratio of
the two rates is printed. For comparison, the same with the index that a whole-table count
by queue and status would want, (status, queue_name): its cost falls on every write.

Usage: python -m bench.web [--rows 1000000] [--requests 30] [--jobs 6000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import secrets
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from celery import Celery

from bench.exporter import POSTGRES, fill, timed
from celery_lease.config import LONG_CALL_TIMEOUT
from celery_lease.store import ClaimTerms, Store
from celery_lease.web.app import create_app, make_server

REFRESH = 3.0  # seconds between the overview's refreshes (web.js REFRESH_MS)
THREADS = 4  # claim + complete loops at once
TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=3, takeover=False)


def get(port: int, path: str) -> Callable[[], None]:
    """A GET of ``path`` on the local server that checks the answer."""

    def request() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            if response.status != 200 or b"Expired, not yet reaped" not in body:
                raise SystemExit(f"GET {path}: {response.status} {body[:300]!r}")
        finally:
            conn.close()

    return request


def serve(prefix: str, port: int) -> None:
    """`celery lease web`'s application over the bench's store, served until the process ends."""
    app = Celery("bench_web", broker="memory://", set_as_current=False)
    app.conf.update(lease_store_url=POSTGRES, lease_table_prefix=prefix)
    store = Store(POSTGRES, prefix, call_timeout=LONG_CALL_TIMEOUT)
    make_server(create_app(app, store), "127.0.0.1", port).run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the page never listened on port {port}") from None
            time.sleep(0.1)


def pending(store: Store, n: int, tag: str) -> list[str]:
    """Record ``n`` pending jobs in one statement; their ids."""
    j, now = store.t.jobs, store.now()
    ids = [f"cc-{tag}-{i}" for i in range(n)]
    with store.begin() as c:
        c.execute(sa.insert(j), [{"id": i, "queue_name": "q1", "task_name": "bench.task", "payload": None,
                                  "status": "pending", "attempt_count": 0, "expired_count": 0,
                                  "dispatch_count": 0, "max_attempts": 5, "available_at": now,
                                  "created_at": now, "updated_at": now} for i in ids])
    return ids


def claim_complete(store: Store, ids: list[str]) -> float:
    """Claim and complete each job from THREADS threads; jobs per second."""
    chunks = [ids[k::THREADS] for k in range(THREADS)]

    def work(chunk: list[str]) -> None:
        worker = f"bench-{uuid.uuid4().hex[:6]}"
        for job_id in chunk:
            token = secrets.token_hex(16)
            claim = store.jobs.claim(job_id, worker, token, TERMS, task_name="bench.task", queue="q1",
                                     payload=lambda: None)
            if not claim.claimed or not store.jobs.complete(job_id, token, worker):
                raise SystemExit(f"job {job_id} was not claimed and completed")

    threads = [threading.Thread(target=work, args=(chunk,)) for chunk in chunks]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(ids) / (time.perf_counter() - start)


class Poller:
    """Requests the overview every REFRESH seconds, as an open page does, until stopped."""

    def __init__(self, request: Callable[[], None]) -> None:
        self.request, self.stop = request, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.request()
            self.stop.wait(REFRESH)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def side_by_side(store: Store, jobs: int, rounds: int, other: Callable[[], Any], label: str) -> list[float]:
    """Rates of claim + complete alone and with ``other`` in force; ratios by round.

    The order flips every round (alone first, then with it first), so the machine's drift
    during a round counts against each side as often.
    """
    ratios = []
    for r in range(rounds):
        rates: dict[bool, float] = {}
        for loaded in ((False, True) if r % 2 == 0 else (True, False)):
            ids = pending(store, jobs, f"{label[:8]}-{r}-{int(loaded)}")
            if loaded:
                with other():
                    rates[loaded] = claim_complete(store, ids)
            else:
                rates[loaded] = claim_complete(store, ids)
        ratios.append(rates[True] / rates[False])
        print(f"  {label:<28} round {r + 1}: alone {rates[False]:7.0f} jobs/s, with it {rates[True]:7.0f} "
              f"jobs/s, ratio {ratios[-1]:.3f}", flush=True)
    return ratios


class Indexed:
    """The (status, queue_name) index in place for the duration of a ``with`` block."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"{store.prefix}jobs_status_queue_bench_ix"

    def __enter__(self) -> Indexed:
        with self.store.begin(long=True) as c:
            c.exec_driver_sql(f"CREATE INDEX {self.name} ON {self.store.t.jobs.name} (status, queue_name)")
        return self

    def __exit__(self, *_: object) -> None:
        with self.store.begin(long=True) as c:
            c.exec_driver_sql(f"DROP INDEX {self.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=30, help="overview requests timed")
    parser.add_argument("--jobs", type=int, default=6000, help="jobs claimed and completed per run")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    prefix = f"b{uuid.uuid4().hex[:8]}_"
    store = Store(POSTGRES, prefix, call_timeout=LONG_CALL_TIMEOUT)  # an operator's store, as the CLI's
    store.migrate()
    port = free_port()
    # The page runs in a process of its own, as `celery lease web` does: its rendering must not
    # take the writers' interpreter lock.
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(prefix, port), daemon=True)
    server.start()
    try:
        wait_listening(port)
        start = time.perf_counter()
        fill(store, args.rows, history=True)
        with store.begin(long=True) as c:
            count = c.execute(sa.select(sa.func.count()).select_from(store.t.jobs)).scalar_one()
        print(f"PostgreSQL, {count:,} jobs rows (and as many events), filled in "
              f"{time.perf_counter() - start:.1f}s")
        page, live = get(port, "/"), get(port, "/overview/live")
        first = timed(page, 1)
        n = args.requests
        print(f"overview page (GET /), first after start        {first * 1e3:8.1f} ms  (imports, templates, "
              "connections)")
        print(f"overview page (GET /), median of {n:<4}           {timed(page, n) * 1e3:8.1f} ms")
        print(f"overview refresh (GET /overview/live), median   {timed(live, n) * 1e3:8.1f} ms")
        counts = timed(lambda: store.reports.overview_counts(3600), 10)
        print(f"  its counts alone (overview_counts), median    {counts * 1e3:8.1f} ms")
        print(f"  for comparison, lease status's whole-table GROUP BY (job_counts) "
              f"{timed(store.reports.job_counts, 3) * 1e3:.1f} ms")
        busy = timed(page, n) / REFRESH
        print(f"an open overview asks for {100 * busy:.1f}% of one core's time (a request every "
              f"{REFRESH:g} s): the most it can take from writers")
        claim_complete(store, pending(store, args.jobs, "warm-up"))
        print(f"\nclaim + complete, {THREADS} threads, {args.jobs} jobs per run, on the same table; "
              f"{args.rounds} rounds alternating, the median ratio counts")
        polled = side_by_side(store, args.jobs, args.rounds, lambda: Poller(page),
                              "overview polled every 3 s")
        indexed = side_by_side(store, args.jobs, args.rounds, lambda: Indexed(store),
                               "(status, queue_name) index")
        for label, ratios in (("with an overview open", polled), ("with the index instead", indexed)):
            ratio = statistics.median(ratios)
            print(f"claim + complete {label:<23} {ratio:.3f} of the rate alone "
                  f"(slowdown {100 * (1 - ratio):.1f}%)")
    finally:
        server.terminate()
        server.join()
        store.drop_schema()
        store.engine.dispose()


if __name__ == "__main__":
    main()
