"""The store's plumbing: engine per process, transactions, rows and events."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .. import clock, schema
from ..errors import LeaseConfigError, StoreCorrupt, StoreUnavailable

__all__ = ["StoreBase", "Claim", "Job"]

log = logging.getLogger(__name__)

PENDING, RUNNING, COMPLETED, FAILED = schema.STATUSES


@dataclasses.dataclass(frozen=True)
class Job:
    """A snapshot of one jobs row."""

    id: str
    task_name: str
    queue_name: str | None
    status: str
    attempt_count: int
    expired_count: int
    dispatch_count: int
    max_attempts: int
    available_at: float
    lease_expires_at: float | None
    last_heartbeat_at: float | None
    started_at: float | None
    locked_by: str | None
    lock_token: str | None
    idempotency_key: str | None
    checkpoint: str | None
    payload: str | None
    last_error: str | None
    created_at: float
    updated_at: float
    completed_at: float | None = None
    failed_at: float | None = None
    lease_duration: float | None = None
    grace_period: float | None = None

    @classmethod
    def from_row(cls, row: Any) -> Job:
        data = row._mapping
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def checkpoint_state(self) -> Any:
        if self.checkpoint is None:
            return None
        try:
            return json.loads(self.checkpoint)
        except ValueError as exc:
            raise StoreCorrupt(f"job {self.id}: checkpoint is not JSON ({exc})", job_id=self.id) from exc


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a claim found: ``claimed`` (the job is ours), ``busy`` or ``done``."""

    outcome: str
    job: Job | None

    @property
    def claimed(self) -> bool:
        return self.outcome == "claimed"


def _connect_sqlite(busy_timeout: float) -> Callable[..., None]:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        # pysqlite's own transaction handling begins DEFERRED transactions that
        # deadlock when two readers upgrade to writers; we issue BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    return on_connect


class StoreBase:
    """Engine, tables, transactions and the audit log; statements live in the mixins."""

    def __init__(self, url: str, prefix: str = "celery_lease_", busy_timeout: float = 30.0) -> None:
        self.url = url
        self.t = schema.tables(prefix)
        self._busy_timeout = busy_timeout
        self._engine: Engine | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._migrate_lock = threading.Lock()
        self._migrated = False
        try:
            self.dialect = sa.engine.make_url(url).get_dialect().name
        except Exception as exc:  # noqa: BLE001 - any URL/driver problem is a config error
            raise LeaseConfigError("lease_store_url", url, f"is not a usable SQLAlchemy URL ({exc})") from exc
        if self.dialect not in clock.SUPPORTED_DIALECTS:
            raise LeaseConfigError(
                "lease_store_url", url, f"dialect {self.dialect!r} is not supported",
                f"Use one of {', '.join(clock.SUPPORTED_DIALECTS)}.",
            )
        self.now_sql = clock.now(self.dialect)

    # -- plumbing ---------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine of this process (a forked child builds its own)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)
                    self._engine = self._create_engine()
                    self._pid = os.getpid()
        assert self._engine is not None
        return self._engine

    def _create_engine(self) -> Engine:
        if self.dialect == "sqlite":
            engine = sa.create_engine(self.url, connect_args={"timeout": self._busy_timeout})
            sa.event.listen(engine, "connect", _connect_sqlite(self._busy_timeout))
            sa.event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
            return engine
        return sa.create_engine(self.url, pool_pre_ping=True, pool_size=5, max_overflow=10)

    @contextlib.contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction; driver errors become StoreUnavailable."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            raise StoreUnavailable(
                f"lease store {self.safe_url} unreachable: {exc.orig or exc}; "
                "check lease_store_url and that the database is running"
            ) from exc
        except sa.exc.ProgrammingError as exc:
            raise StoreUnavailable(
                f"lease store {self.safe_url} rejected a statement ({exc.orig}); "
                "run `celery -A proj lease migrate`"
            ) from exc

    @property
    def safe_url(self) -> str:
        return sa.engine.make_url(self.url).render_as_string(hide_password=True)

    def migrate(self) -> list[str]:
        """Create what is missing (idempotent, never destructive)."""
        try:
            created = schema.migrate(self.engine, self.t)
        except (sa.exc.ProgrammingError, sa.exc.IntegrityError, sa.exc.OperationalError) as exc:
            # Two processes creating the same table race; the loser retries once
            # and finds everything there.
            log.debug("migrate raced (%s); retrying", exc)
            try:
                created = schema.migrate(self.engine, self.t)
            except sa.exc.DBAPIError as again:
                raise StoreUnavailable(f"cannot migrate lease store {self.safe_url}: {again.orig}") from again
        self._migrated = True
        return created

    def ensure_migrated(self) -> None:
        # Threads of one process migrate one at a time: MySQL's DDL is not transactional,
        # so concurrent migrations of a fresh store collide on half-created indexes.
        if not self._migrated:
            with self._migrate_lock:
                if not self._migrated:
                    self.migrate()

    def now(self) -> float:
        """The store's clock, in epoch seconds."""
        with self.begin() as c:
            return float(c.execute(sa.select(self.now_sql)).scalar_one())

    def _event(self, c: Connection, job_id: str | None, event: str, reason: str | None = None,
               worker: str | None = None, token: str | None = None, detail: Any = None) -> None:
        c.execute(sa.insert(self.t.events).values(
            job_id=job_id, event=event, reason=reason, worker=worker,
            token=token[:8] if token else None, at=self.now_sql,
            detail=None if detail is None else json.dumps(detail, default=str),
        ))

    def event(self, job_id: str | None, event: str, reason: str | None = None, worker: str | None = None,
              token: str | None = None, detail: Any = None) -> None:
        """Write one audit event on its own."""
        with self.begin() as c:
            self._event(c, job_id, event, reason, worker, token, detail)

    def get(self, job_id: str) -> Job | None:
        with self.begin() as c:
            row = c.execute(sa.select(self.t.jobs).where(self.t.jobs.c.id == job_id)).first()
        return None if row is None else Job.from_row(row)

