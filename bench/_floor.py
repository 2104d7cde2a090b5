"""The floors of the benchmarks: the least a durable publish record, or a claim and a completion, can cost.

The writes here have what the guarantees need and nothing else: one bare table (an id, a
token and the message), one statement per write on the driver's own connection (no pool, no
SQLAlchemy, no audit event, no lease columns), each committed durably as the store's defaults
are (PostgreSQL waits for the WAL flush; SQLite runs ``synchronous=FULL``). Plain Celery with
these writes added is the best that any design writing **one commit per job** reaches on the same
machine. ``GroupFloor`` is the second floor: the same statements, but the writes due at the same
moment in one process share one commit (leader/follower, no tick), which is the best that sharing
commits allows. ``MainFloor`` is the prefork variant's floor: a prefork child runs one job at a time,
so nothing inside it can share, but the worker's main process sees every delivery and every result;
there a writer thread commits the claims of the deliveries and the completions of the results that
arrived while its last commit was in flight in one commit, before a delivery goes to a child and before
a result is acknowledged. The benchmarks print the floors next to LeaseTask's figures;
``tests/unit/test_bench_floor.py`` pins their statements.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from celery.worker.strategy import default
from kombu.asynchronous import get_event_loop

from celery_lease.store.group import Group

__all__ = ["Floor", "GroupFloor", "MainFloor"]


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
        """A claim: the job's row taken under a token, committed durably (as the store's default claim)."""
        self._run(f"INSERT INTO {self.table} (id, token, done) VALUES (%s, %s, 0)", (job_id, token))

    def complete(self, job_id: str, token: str) -> None:
        """A completion: fenced by the token, committed durably."""
        self._run(f"UPDATE {self.table} SET done = 1 WHERE id = %s AND token = %s", (job_id, token))

    def completed(self) -> int:
        """How many jobs carry a committed completion (the bench checks every run wrote all of its)."""
        conn = self._connect()
        return conn.execute(f"SELECT COUNT(*) FROM {self.table} WHERE done = 1").fetchone()[0]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class GroupFloor(Floor):
    """The floor whose writes due at once share one commit: one statement per kind per batch."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix)
        self._conn_lock = threading.Lock()
        self._shared: Any = None
        # The library's own leader/follower queue (store/group.py), as lease_group_commit uses it.
        self.group: Group[tuple[str, tuple[Any, ...]], None] = Group(self._write_all)

    def record(self, job_id: str, payload: str) -> None:
        self.group.submit(("record", (job_id, payload)))

    def claim(self, job_id: str, token: str) -> None:
        self.group.submit(("claim", (job_id, token)))

    def complete(self, job_id: str, token: str) -> None:
        self.group.submit(("complete", (job_id, token)))

    def _write_all(self, batch: list[tuple[str, tuple[Any, ...]]]) -> list[None]:
        self._write(batch)
        return [None] * len(batch)

    def statements(self, batch: Sequence[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, list[Any]]]:
        """The statements of one batch: one per kind present, with its bound parameters."""
        by_kind: dict[str, list[tuple[Any, ...]]] = {}
        for kind, params in batch:
            by_kind.setdefault(kind, []).append(params)
        out: list[tuple[str, list[Any]]] = []
        mark = "?" if self.sqlite else "%s"
        for kind in ("record", "claim", "complete"):
            rows = by_kind.get(kind)
            if not rows:
                continue
            pairs = ", ".join(f"({mark}, {mark})" for _ in rows)
            flat = [value for row in rows for value in row]
            if kind == "record":
                sql = f"INSERT INTO {self.table} (id, payload, done) SELECT v.*, 0 FROM (VALUES {pairs}) AS v"
            elif kind == "claim":
                sql = f"INSERT INTO {self.table} (id, token, done) SELECT v.*, 0 FROM (VALUES {pairs}) AS v"
            elif self.sqlite:
                sql = f"UPDATE {self.table} SET done = 1 WHERE (id, token) IN (VALUES {pairs})"
            else:
                sql = (f"UPDATE {self.table} AS t SET done = 1 FROM (VALUES {pairs}) AS v (id, token) "
                       "WHERE t.id = v.id AND t.token = v.token")
            out.append((sql, flat))
        return out

    def close(self) -> None:
        super().close()
        with self._conn_lock:
            if self._shared is not None:
                self._shared.close()
                self._shared = None

    def _write(self, batch: list[tuple[str, tuple[Any, ...]]]) -> None:
        with self._conn_lock:
            if self._shared is None:
                self._shared = self._connect()
            conn = self._shared
            if self.sqlite:
                conn.execute("BEGIN IMMEDIATE")
                for sql, params in self.statements(batch):
                    conn.execute(sql, params)
                conn.execute("COMMIT")
            else:
                with conn.transaction():
                    for sql, params in self.statements(batch):
                        conn.execute(sql, params)


class MainFloor:
    """Claims and completions written by a prefork worker's main process for its children, shared commits.

    ``strategy`` is a task's consumer strategy (``Task.Strategy``): each delivery's claim is queued, and
    the request goes to the pool only after the commit that holds it; its result's callback
    (acknowledgement, ``task_ready``) runs only after the commit holding its completion. One writer thread
    commits: it takes everything queued when it is free, so the writes that arrive while a commit is in
    flight share the next one (no tick), and the event loop never waits on the database. What a commit
    held is handed back to the loop (``hub.call_soon``, which wakes it from another thread).
    """

    def __init__(self, floor: GroupFloor) -> None:
        self.floor = floor
        self.pending: list[tuple[tuple[str, tuple[Any, ...]], Callable[[], Any]]] = []
        self._ready = threading.Condition()
        self._writer: threading.Thread | None = None

    def strategy(self, task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
        """Celery's default strategy, whose requests are claimed and completed through this floor."""
        to_pool = consumer.on_task_request

        def claimed_first(req: Any) -> None:
            token = secrets.token_hex(16)
            succeeded = req.on_success  # the class Celery built for this task; the instance's wins

            def completed_first(result: Any, **more: Any) -> None:
                self.queue(("complete", (req.id, token)), lambda: succeeded(result, **more))

            req.on_success = completed_first
            self.queue(("claim", (req.id, token)), lambda: to_pool(req))

        # The default strategy reads the hand-off to the pool once, when it is built.
        consumer.on_task_request = claimed_first
        try:
            return default(task, app, consumer, **kwargs)
        finally:
            consumer.on_task_request = to_pool

    def queue(self, write: tuple[str, tuple[Any, ...]], then: Callable[[], Any]) -> None:
        """Queue ``write``; ``then`` runs on the event loop once the commit holding it is done."""
        hub = get_event_loop()
        if hub is None:  # no event loop (a pool without one): every write alone
            self.floor._write([write])
            then()
            return
        with self._ready:
            self.pending.append((write, then))
            if self._writer is None:
                self._writer = threading.Thread(target=self._commit_forever, args=(hub,), daemon=True,
                                                name="main-floor-writer")
                self._writer.start()
            self._ready.notify()

    def _commit_forever(self, hub: Any) -> None:
        while True:
            with self._ready:
                while not self.pending:
                    self._ready.wait()
                batch, self.pending = self.pending, []
            self.floor._write([write for write, _ in batch])
            hub.call_soon(self._hand_on, batch)

    @staticmethod
    def _hand_on(batch: list[tuple[tuple[str, tuple[Any, ...]], Callable[[], Any]]]) -> None:
        for _, then in batch:  # in the order they were queued: one callback, as call_soon keeps a set
            then()
