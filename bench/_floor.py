"""The floor of the benchmarks: the least a durable publish record, or a claim and a completion, can cost.

The writes here have what the guarantees need and nothing else: one bare table (an id, a
token and the message), one statement per write on the driver's own connection (no pool, no
SQLAlchemy, no audit event, no lease columns), a claim that does not wait for its WAL flush
on PostgreSQL and a record and completion that do (on SQLite, ``synchronous=FULL``, as the
store's defaults). Plain Celery with these writes added is the best that any design which
writes a job's record before its message is sent, and its claim and completion around its
body, reaches on the same machine: the benchmarks print it next to LeaseTask's figures.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import sqlalchemy as sa

__all__ = ["Floor"]


class Floor:
    """Bare writes on ``url``'s database into the table ``<prefix>floor``, one connection per thread."""

    def __init__(self, url: str, prefix: str) -> None:
        parsed = sa.engine.make_url(url)
        self.sqlite = parsed.get_backend_name() == "sqlite"
        self.url = url
        self.table = f"{prefix}floor"
        if not self.table.replace("_", "").isalnum():
            raise ValueError(f"bench table prefix {prefix!r} must be letters, digits and underscores")
        self._local = threading.local()

    def _connect(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        parsed = sa.engine.make_url(self.url)
        if self.sqlite:
            conn = sqlite3.connect(parsed.database, isolation_level=None, timeout=60, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        else:
            import psycopg

            conn = psycopg.connect(host=parsed.host or "127.0.0.1", port=parsed.port or 5432,
                                   user=parsed.username, password=parsed.password, dbname=parsed.database,
                                   autocommit=True)
        self._local.conn = conn
        return conn

    def _run(self, sql: str, params: tuple[Any, ...]) -> None:
        conn = self._connect()
        if self.sqlite:
            # BEGIN IMMEDIATE as the store's writes: the write lock first, not a retry on upgrade.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(sql.replace("%s", "?"), params)
            conn.execute("COMMIT")
        else:
            conn.execute(sql, params, prepare=True)

    def create(self) -> None:
        self._run(f"CREATE TABLE IF NOT EXISTS {self.table} "
                  "(id VARCHAR(64) PRIMARY KEY, token VARCHAR(64), done INTEGER, payload TEXT)", ())

    def drop(self) -> None:
        self._run(f"DROP TABLE IF EXISTS {self.table}", ())

    def record(self, job_id: str, payload: str) -> None:
        """A publish's record: the job and its message, committed durably."""
        self._run(f"INSERT INTO {self.table} (id, payload, done) VALUES (%s, %s, 0)", (job_id, payload))

    def claim(self, job_id: str, token: str) -> None:
        """A claim: the job's row taken under a token (PostgreSQL: without waiting for the flush)."""
        if self.sqlite:
            self._run(f"INSERT INTO {self.table} (id, token, done) VALUES (%s, %s, 0)", (job_id, token))
        else:
            self._run(f"WITH s AS (SELECT set_config('synchronous_commit', 'off', true)) "
                      f"INSERT INTO {self.table} (id, token, done) SELECT %s, %s, 0 FROM s", (job_id, token))

    def complete(self, job_id: str, token: str) -> None:
        """A completion: fenced by the token, committed durably."""
        self._run(f"UPDATE {self.table} SET done = 1 WHERE id = %s AND token = %s", (job_id, token))

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
