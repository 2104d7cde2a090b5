"""PostgreSQL helpers of the benchmarks: a database of their own and the server's own counters."""

from __future__ import annotations

import os

import sqlalchemy as sa

POSTGRES = os.environ.get("CELERY_LEASE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
COUNTERS = ("commits", "rows written", "WAL bytes")


def bench_database(url: str = POSTGRES) -> str:
    """The URL of a database of the bench's own on the same server (created when missing).

    Its statistics then count the bench alone (WAL is counted for the whole server: run the
    benchmarks on an otherwise idle one).
    """
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            exists = sa.text("SELECT 1 FROM pg_database WHERE datname = 'celery_lease_bench'")
            if not c.execute(exists).scalar():
                c.execute(sa.text("CREATE DATABASE celery_lease_bench"))
    finally:
        engine.dispose()
    return sa.engine.make_url(url).set(database="celery_lease_bench").render_as_string(hide_password=False)


def counters(url: str) -> tuple[int, int, int]:
    """(transactions committed, rows inserted/updated/deleted, WAL bytes) of the database so far.

    A server process reports its counters when it goes idle for a while or exits: close the
    pools of the processes measured before reading.
    """
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            xact, rows = c.execute(sa.text(
                "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
                "WHERE datname = current_database()")).one()
            wal = c.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
    finally:
        engine.dispose()
    return int(xact), int(rows), int(wal)


def per_job(before: tuple[int, int, int], after: tuple[int, int, int], jobs: int) -> dict[str, float]:
    """The counters' growth per job (the reading's own connection commits once per reading)."""
    return {name: (b - a - (1 if name == "commits" else 0)) / jobs
            for name, a, b in zip(COUNTERS, before, after, strict=True)}


def describe(cost: dict[str, float]) -> str:
    return ", ".join(f"{v:.0f} {k}" if k == "WAL bytes" else f"{v:.2f} {k}" for k, v in cost.items())
