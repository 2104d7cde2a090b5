"""The store's plumbing: engine per process, transactions, rows and events."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .. import clock
from ..config import RECOVERY
from ..errors import LeaseConfigError, StoreCorrupt, StoreUnavailable
from ..vocabulary import ClaimOutcome, Event, Status
from . import schema

__all__ = ["StoreBase", "Claim", "Job"]

log = logging.getLogger(__name__)

PENDING, RUNNING, COMPLETED, FAILED = Status.PENDING, Status.RUNNING, Status.COMPLETED, Status.FAILED
# SQLite reports a missing table as an OperationalError, not a ProgrammingError.
_MISSING_SCHEMA = "no such table"
IDLE_PING_AFTER = 2.0  # seconds a pooled connection may idle before it is pinged on checkout


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
    last_error: str | None
    created_at: float
    updated_at: float
    completed_at: float | None = None
    failed_at: float | None = None
    lease_duration: float | None = None
    grace_period: float | None = None
    payload: str | None = None
    # The task's recovery policy as recorded (None: recorded before revision 0002; app settings).
    on_expired: str | None = None
    max_expirations: int | None = None
    backoff_base: float | None = None
    backoff_max: float | None = None
    backoff_jitter: bool | None = None
    dead_letter_queue: str | None = None
    dispatch_timeout: float | None = None

    def recovery(self) -> dict[str, Any]:
        """The recovery options the row carries (those recorded), by option name."""
        return {name: getattr(self, name) for name in RECOVERY if getattr(self, name) is not None}

    @classmethod
    def from_row(cls, row: Any) -> Job:
        data = getattr(row, "_mapping", row)
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
    """What a claim found: ``claimed`` (the job is ours), ``busy``, ``done`` or ``early``.

    ``early``: the job is pending but not available for ``wait`` more seconds.
    """

    outcome: ClaimOutcome
    job: Job | None
    wait: float = 0.0

    @property
    def claimed(self) -> bool:
        return self.outcome == ClaimOutcome.CLAIMED


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


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Check a pooled connection that sat idle before handing it out.

    A ping on every checkout (pool_pre_ping) costs a round trip per transition; a
    connection in steady use is known good, and one that died since is replaced here.
    """
    now = time.monotonic()
    last, record.info["checked_out_at"] = record.info.get("checked_out_at"), now
    if last is not None and now - last < IDLE_PING_AFTER:
        return
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("SELECT 1")
        cursor.close()
        # End the ping's implicit transaction: the connection must be handed out idle.
        dbapi_conn.rollback()
    except Exception as exc:  # noqa: BLE001 - any failure means this connection is gone
        raise sa.exc.DisconnectionError(str(exc)) from exc


class StoreBase:
    """Engine, tables, transactions and the audit log; statements live in the mixins."""

    def __init__(self, url: str, prefix: str = "celery_lease_", busy_timeout: float = 30.0) -> None:
        self.url = url
        self.prefix = prefix
        self.t = schema.tables(prefix)
        self.revision: str | None = None  # the schema revision, once a check found it usable
        self._busy_timeout = busy_timeout
        self._engine: Engine | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._schema_lock = threading.Lock()
        self._built: dict[str, tuple[Any, ...]] = {}
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
        engine = sa.create_engine(self.url, pool_size=5, max_overflow=10)
        sa.event.listen(engine, "checkout", _ping_if_idle)
        return engine

    @contextlib.contextmanager
    def _driver_errors(self) -> Iterator[None]:
        """Turn the driver's connection and statement errors into StoreUnavailable."""
        try:
            yield
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            if _MISSING_SCHEMA in str(exc.orig):
                raise self._unmigrated(exc) from exc
            raise StoreUnavailable(
                f"lease store {self.safe_url} unreachable: {exc.orig or exc}; "
                "check lease_store_url and that the database is running"
            ) from exc
        except sa.exc.ProgrammingError as exc:
            raise self._unmigrated(exc) from exc

    def _unmigrated(self, exc: sa.exc.DBAPIError) -> StoreUnavailable:
        return StoreUnavailable(
            f"lease store {self.safe_url} rejected a statement ({exc.orig}); "
            "run `celery -A proj lease migrate`"
        )

    @contextlib.contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction; driver errors become StoreUnavailable."""
        with self._driver_errors(), self.engine.begin() as conn:
            yield conn

    def _audited_update(self, stmt: sa.Update | Callable[[], sa.Update], job_id: str, event: Event,
                        reason: str | None = None, worker: str | None = None, token: str | None = None,
                        detail: Any = None, *, key: str | None = None, params: dict[str, Any] | None = None,
                        full_row: bool = True) -> Job | bool | None:
        """A one-row UPDATE and its audit event as one atomic write.

        Returns the new row (``full_row``), True, or None when the UPDATE matched nothing.
        On PostgreSQL this is a single statement in autocommit (the UPDATE and the event
        INSERT in data-modifying CTEs): one round trip instead of four. Elsewhere it is an
        UPDATE, an INSERT and a commit in one transaction. With ``key`` the statements are
        built once (from a callable using bind parameters ``params``) and reused: on the
        hot path, building them costs more CPU than running them; on PostgreSQL they are
        also compiled once and run on the driver connection.
        """
        built = self._built.get(key) if key else None
        if built is None:
            built = self._build_audited(stmt() if callable(stmt) else stmt, event, full_row, bool(key))
            if key:
                self._built[key] = built
        bind = {**(params or {}), "ev_job": job_id, "ev_reason": reason, "ev_worker": worker,
                "ev_token": token[:8] if token else None,
                "ev_detail": None if detail is None else json.dumps(detail, default=str)}
        if self.dialect == "postgresql" and key:
            values = self._execute_compiled(built[1], bind)
            row = None if values is None else dict(zip(built[2], values, strict=True))
        elif self.dialect == "postgresql":
            with self._driver_errors(), self.engine.connect() as conn:
                row = conn.execution_options(isolation_level="AUTOCOMMIT").execute(built[0], bind).first()
        else:
            update, audit = built
            with self.begin() as c:
                if c.dialect.update_returning:
                    row = c.execute(update, bind).first()
                elif c.execute(update, bind).rowcount == 1:
                    row = c.execute(sa.select(*self._row_columns(full_row))
                                    .where(self.t.jobs.c.id == job_id)).first()
                else:
                    row = None
                if row is not None:
                    c.execute(audit, bind)
        if row is None:
            return None
        return Job.from_row(row) if full_row else True

    def _row_columns(self, full_row: bool) -> list[sa.Column]:
        # A claim needs the lease and progress columns; the stored message stays in the store.
        jobs = self.t.jobs
        return [c for c in jobs.c if c is not jobs.c.payload] if full_row else [jobs.c.id]

    def _build_audited(self, stmt: sa.Update, event: Event, full_row: bool, reused: bool) -> tuple[Any, ...]:
        columns = self._row_columns(full_row)
        values = dict(
            event=sa.literal(str(event), sa.String()), reason=sa.bindparam("ev_reason", type_=sa.Text()),
            worker=sa.bindparam("ev_worker", type_=sa.String()),
            token=sa.bindparam("ev_token", type_=sa.String()), at=self.now_sql,
            detail=sa.bindparam("ev_detail", type_=sa.Text()),
        )
        if self.dialect != "postgresql":
            update = stmt.returning(*columns) if self.engine.dialect.update_returning else stmt
            job = sa.bindparam("ev_job", type_=sa.String())
            audit = sa.insert(self.t.events).values(job_id=job, **values)
            return update, audit
        changed = stmt.returning(*columns).cte("changed")
        audit = sa.insert(self.t.events).from_select(
            ["job_id", *values], sa.select(changed.c.id, *values.values())
        ).cte("audit")
        statement = sa.select(changed).add_cte(audit)
        if not reused:
            return (statement,)
        compiled = statement.compile(dialect=self.engine.dialect)
        static = compiled.construct_params(_check=False)  # the literals SQLAlchemy made parameters
        return statement, (compiled.string, static), [c.name for c in columns]

    def _execute_compiled(self, compiled: tuple[str, dict[str, Any]], bind: dict[str, Any]) -> Any:
        """Run a statement compiled once on a pooled driver connection, in autocommit.

        The hot transitions (claim, complete) skip SQLAlchemy's execution layer: on a
        worker that sleeps between tasks its cold path costs as much CPU as the round
        trip. Driver errors are wrapped as SQLAlchemy's so that they map as elsewhere.
        """
        sql, static = compiled
        dbapi = self.engine.dialect.loaded_dbapi
        with self._driver_errors():
            try:
                raw = self.engine.raw_connection()
                try:
                    driver = raw.driver_connection
                    driver.autocommit = True
                    try:
                        with raw.cursor() as cursor:
                            cursor.execute(sql, {**static, **bind})
                            return cursor.fetchone()
                    finally:
                        if not driver.closed:
                            driver.autocommit = False
                finally:
                    # A dead connection fails its reset here and the pool discards it.
                    raw.close()
            except dbapi.Error as exc:
                raise sa.exc.DBAPIError.instance(sql, None, exc, dbapi.Error, hide_parameters=True,
                                                 dialect=self.engine.dialect) from exc

    @property
    def safe_url(self) -> str:
        return sa.engine.make_url(self.url).render_as_string(hide_password=True)

    def migrate(self, to: str = "head") -> list[str]:
        """Bring the schema to revision ``to`` (create, recognise, upgrade or downgrade); what was done."""
        from . import migrating

        with self._schema_lock:
            return migrating.migrate(self, to)

    def schema_state(self) -> tuple[str | None, bool]:
        """(revision, has tables) as the store reports them now; changes nothing."""
        from . import migrating

        return migrating.describe(self)

    def ensure_schema(self, create: bool = False) -> str:
        """Check once per process that the schema is usable; ``create`` makes an empty store.

        Raises SchemaMismatch naming both revisions when this code cannot run against it.
        """
        if self.revision is None:
            from . import migrating

            # Threads of one process check one at a time: MySQL's DDL is not transactional,
            # so concurrent creations of an empty store collide on half-made tables.
            with self._schema_lock:
                if self.revision is None:
                    migrating.ensure(self, create)
        assert self.revision is not None
        return self.revision

    def now(self) -> float:
        """The store's clock, in epoch seconds."""
        with self.begin() as c:
            return float(c.execute(sa.select(self.now_sql)).scalar_one())

    def _event(self, c: Connection, job_id: str | None, event: Event, reason: str | None = None,
               worker: str | None = None, token: str | None = None, detail: Any = None) -> None:
        c.execute(sa.insert(self.t.events).values(
            job_id=job_id, event=event, reason=reason, worker=worker,
            token=token[:8] if token else None, at=self.now_sql,
            detail=None if detail is None else json.dumps(detail, default=str),
        ))

    def event(self, job_id: str | None, event: Event, reason: str | None = None, worker: str | None = None,
              token: str | None = None, detail: Any = None) -> None:
        """Write one audit event on its own."""
        with self.begin() as c:
            self._event(c, job_id, event, reason, worker, token, detail)

    def get(self, job_id: str) -> Job | None:
        with self.begin() as c:
            row = c.execute(sa.select(self.t.jobs).where(self.t.jobs.c.id == job_id)).first()
        return None if row is None else Job.from_row(row)

