"""The store's plumbing: engine per process, transactions, the schema's revision and events."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

import celery_lease.config as config
import celery_lease.store.dialects as dialects
import celery_lease.store.schema as schema

from ..context import BODY
from ..errors import StoreRejected, StoreUnavailable
from ..masking import mask_secrets
from ..vocabulary import Event, StoreFailure
from .rows import RUNNING, Job, fenced_status, status_sql, storable

__all__ = ["StoreEngine", "where_given", "uninterrupted"]

log = logging.getLogger(__name__)

STALE_REASON = "lock token no longer matches"  # the reason of every write a fence refused

_StoreT = TypeVar("_StoreT", bound="StoreEngine")


def where_given(query: sa.Select, *filters: tuple[Any, Any]) -> sa.Select:
    """``query`` narrowed to ``column == value`` for each (column, value) whose value is given (not None)."""
    for column, value in filters:
        if value is not None:
            query = query.where(column == value)
    return query


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Store code a lost lease's interruption waits for: it lands, if due, when the code ends, so no
    lock or pooled connection is left astray (the body's lease shields itself; the store needs
    nothing of the worker)."""
    lease = BODY.get()
    if lease is None:
        yield
        return
    with lease.shielded():
        yield


def _default(setting: str, value: Any) -> Any:
    return config.BY_NAME[setting].default if value is None else value


class StoreEngine:
    """Engine, tables, transactions and the audit log; the statement groups built on it hold the rest."""

    def __init__(self, url: str, prefix: str = "celery_lease_", busy_timeout: float | None = None, *,
                 call_timeout: float | None = None, pool_size: int | None = None,
                 sqlite_synchronous: str | None = None,
                 engine_options: Mapping[str, Any] | None = None, hard_grace: float | None = None,
                 stale_after: float | Callable[[], float] | None = None,
                 clock_tolerance: float | None = None,
                 claim_async_commit: bool | None = None, publish_async_commit: bool | None = None,
                 audit_every_transition: bool | None = None, group_commit: bool | None = None,
                 clock_offset: float = 0.0, fault_injector: str | None = None) -> None:
        """A store on ``url``; ``call_timeout`` bounds every call (seconds, see dialects.Bounds).

        The app-wide lease settings its statements apply default to config.py's; ``from_config``
        takes them from the app. ``fault_injector`` (lease_fault_injector) gets each engine built.
        """
        self.url = url
        self.hard_grace: float = _default("lease_reaper_hard_grace", hard_grace)
        # Derived from the lease settings unless set (config.worker_stale_after), and it may grow
        # as tasks register: a callable is asked each time.
        self._stale_after = stale_after if stale_after is not None else config.cfg_stale_after(
            config.load({}))
        self.clock_tolerance: float = _default("lease_clock_tolerance", clock_tolerance)
        self.claim_async_commit: bool = _default("lease_claim_async_commit", claim_async_commit)
        self.publish_async_commit: bool = _default("lease_publish_async_commit", publish_async_commit)
        # False: a first claim and its owner's completion write the job's row only, no event.
        self.audit_every_transition: bool = _default("lease_audit_every_transition", audit_every_transition)
        # True: completions due at once in this process share one commit (store/group.py).
        self.group_commit: bool = _default("lease_group_commit", group_commit)
        self.prefix = prefix
        self.t = schema.tables(prefix)
        self.revision: str | None = None  # the schema revision, once a check found it usable
        self.dialect = dialects.for_url(
            url, busy_timeout=_default("lease_sqlite_busy_timeout", busy_timeout),
            synchronous=_default("lease_sqlite_synchronous", sqlite_synchronous), clock_offset=clock_offset)
        default_call = config.CALL_TIMEOUT_SHARE * config.BY_NAME["lease_duration"].default
        self.bounds = self.dialect.bounds(call_timeout if call_timeout is not None else default_call)
        self.long_bounds = self.dialect.bounds(max(config.LONG_CALL_TIMEOUT, self.bounds.call))
        self.pool_size = pool_size or config.DEFAULT_POOL_SIZE
        self.engine_options = dict(_default("lease_store_engine_options", engine_options))
        self.fault_injector = fault_injector
        self._engine: Engine | None = None
        self._pid = -1
        self._writer: threading.RLock | None = None  # per process, see _writer_turn
        self._lock = threading.Lock()
        self._schema_lock = threading.Lock()
        self._built: dict[str, Any] = {}  # audited._Audited by key: statements built once per store
        self.now_sql = self.dialect.now()

    @property
    def stale_after(self) -> float:
        """Seconds of registry silence after which a worker process counts as gone."""
        value = self._stale_after
        return float(value() if callable(value) else value)

    @stale_after.setter
    def stale_after(self, value: float | Callable[[], float]) -> None:
        self._stale_after = value

    @classmethod
    def from_config(cls: type[_StoreT], cfg: config.AppConfig, *, call_timeout: float | None = None,
                    pool_size: int | None = None,
                    stale_after: float | Callable[[], float] | None = None,
                    url: str | None = None) -> _StoreT:
        """The store an app's settings describe; the call bound defaults to a share of the shortest lease.

        ``url``: the store's URL when it is not lease_store_url (lease_database's, store.for_app).
        """
        if call_timeout is None:
            call_timeout = config.CALL_TIMEOUT_SHARE * config.shortest_lease(cfg)
        return cls(url or cfg.store_url, cfg.table_prefix, cfg.sqlite_busy_timeout, call_timeout=call_timeout,
                   pool_size=pool_size, sqlite_synchronous=cfg.sqlite_synchronous,
                   engine_options=cfg.store_engine_options, hard_grace=cfg.reaper_hard_grace,
                   stale_after=stale_after if stale_after is not None else config.cfg_stale_after(cfg),
                   clock_tolerance=cfg.clock_tolerance,
                   claim_async_commit=cfg.claim_async_commit,
                   publish_async_commit=cfg.publish_async_commit,
                   audit_every_transition=cfg.audit_every_transition, group_commit=cfg.group_commit,
                   fault_injector=cfg.fault_injector)

    # -- plumbing ---------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine of this process (a forked child builds its own)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)
                    self._engine = self.dialect.create_engine(self.bounds, self.pool_size,
                                                              self.engine_options)
                    if self.fault_injector is not None:
                        pkgutil.resolve_name(self.fault_injector).engine_built(self._engine, self)
                    # A fork copies a lock as it was: one a parent thread held stays held.
                    self._writer = threading.RLock() if self.dialect.single_writer else None
                    self._pid = os.getpid()
        assert self._engine is not None
        return self._engine

    def dispose(self) -> None:
        """Close this process's pooled connections (a store left for another; a test database dropped)."""
        with self._lock:
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
            self._engine, self._pid = None, -1

    @contextlib.contextmanager
    def _driver_errors(self) -> Iterator[None]:
        """Turn driver and pool errors into the LeaseError they mean (store/failures.py).

        Every store call passes here first: a body's lost lease interrupts it only once the
        call has given back its connection and the writer lock (uninterrupted()).
        """
        with uninterrupted():
            try:
                yield
            except (sa.exc.DBAPIError, sa.exc.TimeoutError) as exc:
                raise self.dialect.classify(exc, self.safe_url, self.bounds) from exc
            except UnicodeEncodeError as exc:  # raised by the driver as it binds, before any DBAPIError
                raise StoreRejected(f"lease store {self.safe_url} cannot take text that is not valid Unicode "
                                    f"({exc}): a lone surrogate, as os.fsdecode leaves for undecodable "
                                    "bytes; pass ids and keys through str.encode(errors='replace')",
                                    kind=StoreFailure.DATA) from exc

    @contextlib.contextmanager
    def begin(self, *, long: bool = False, read: bool = False) -> Iterator[Connection]:
        """A transaction; driver errors become StoreUnavailable (or a subclass naming the refusal).

        ``long``: the reaper's batches and operators' reads, which may take minutes, get the
        longer bound instead of the call bound a lease can afford. ``read``: the transaction
        only reads, so on a one-writer database it neither queues for nor takes the write lock
        (a reader sees the last commit while a writer works, or while a frozen one holds it).
        """
        bounds = self.long_bounds if long else self.bounds
        with (self._driver_errors(), self._writer_turn(bounds, read), self.engine.connect() as conn):
            if read:
                conn.execution_options(**{dialects.READ_ONLY: True})
            elif long:
                conn.execution_options(**{dialects.LOCK_WAIT: bounds.lock_wait})
            with conn.begin(), self.dialect.transaction(conn, bounds, long):
                yield conn

    @contextlib.contextmanager
    def _writer_turn(self, bounds: dialects.Bounds, read: bool) -> Iterator[None]:
        """On a one-writer database, this process's threads take their turns at a lock.

        SQLite's own wait for its write lock polls, sleeping 1, 2, 5, 10... ms between tries:
        threads of one process that queue here instead are handed the turn the moment it is
        free. Other processes still meet at SQLite's lock, so a write that waited here and
        then meets one there waits twice, each within SQLite's own bound: a late answer costs
        time, never a second owner (a lease counts from when its renewal was sent).
        """
        self.engine  # noqa: B018 (builds this process's engine and lock after a fork)
        writer = self._writer
        if writer is None or read:
            yield
            return
        wait = bounds.lock_wait
        if not writer.acquire(timeout=wait):
            raise StoreUnavailable(f"lease store {self.safe_url} unreachable: another thread of this "
                                   f"process held the database's one writer for {wait:g}s; check for "
                                   "a long transaction (a reaper batch, an operator's command)",
                                   kind=StoreFailure.TIMEOUT)
        try:
            yield
        finally:
            writer.release()

    def _job_columns(self) -> list[sa.Column]:
        """The jobs columns a Job is read from: all but the kept result, which only the rare
        path after a crash reads."""
        jobs = self.t.jobs
        return [c for c in jobs.c if c is not jobs.c.result]

    @property
    def safe_url(self) -> str:
        return mask_secrets(sa.engine.make_url(self.url).render_as_string(hide_password=True))

    def migrate(self, to: str = "head", *, downgrade: bool = True) -> list[str]:
        """Bring the schema to revision ``to`` (create, recognise, upgrade, or with ``downgrade`` downgrade);
        what was done."""
        import celery_lease.store.migrating as migrating

        with self._schema_lock:
            return migrating.migrate(self, to, downgrade=downgrade)

    def drop_schema(self) -> list[str]:
        """Drop this store's own tables (not others that share its prefix), the version table too; the tables
        dropped."""
        import celery_lease.store.migrating as migrating

        with self._schema_lock:
            return migrating.drop(self)

    def schema_state(self) -> tuple[str | None, bool]:
        """(revision, has tables) as the store reports them now; changes nothing."""
        import celery_lease.store.migrating as migrating

        return migrating.describe(self)

    def ensure_schema(self, create: bool = False) -> str:
        """Check once per process that the schema is usable; ``create`` makes an empty store.

        Raises SchemaMismatch naming both revisions when this code cannot run against it.
        """
        if self.revision is None:
            import celery_lease.store.migrating as migrating

            # Threads of one process check one at a time: MySQL's DDL is not transactional,
            # so concurrent creations of an empty store collide on half-made tables.
            with self._schema_lock:
                if self.revision is None:
                    migrating.ensure(self, create)
        assert self.revision is not None
        return self.revision

    def now(self) -> float:
        """The store's clock, in epoch seconds."""
        with self.begin(read=True) as c:
            return float(c.execute(sa.select(self.now_sql)).scalar_one())

    def _job_labels(self, job_id: Any) -> dict[str, Any]:
        """The job's queue and task for an event row, by its primary key in the same statement
        (NULL once the job is gone); nothing for an event of no job."""
        if job_id is None:
            return {}
        j = self.t.jobs
        return {name: sa.select(j.c[name]).where(j.c.id == job_id).scalar_subquery()
                for name in ("queue_name", "task_name")}

    def _event(self, c: Connection, job_id: str | None, event: Event, reason: str | None = None,
               worker: str | None = None, token: str | None = None, detail: Any = None) -> None:
        c.execute(sa.insert(self.t.events).values(
            job_id=job_id, event=event, reason=reason and storable(reason), worker=worker,
            token=token[:8] if token else None, at=self.now_sql,
            detail=None if detail is None else json.dumps(detail, default=str),
            **self._job_labels(job_id),
        ))

    def event(self, job_id: str | None, event: Event, reason: str | None = None, worker: str | None = None,
              token: str | None = None, detail: Any = None) -> None:
        """Write one audit event on its own."""
        with self.begin() as c:
            self._event(c, job_id, event, reason, worker, token, detail)

    def _owner_alive(self, clock: sa.ColumnElement[float]) -> sa.Exists:
        """The lease's owner was seen within lease_worker_stale_after (by ``clock``)."""
        j, w = self.t.jobs, self.t.workers
        return sa.exists().where(w.c.worker_id == j.c.locked_by, w.c.last_seen_at >= clock - self.stale_after)

    def _claimable_expired(self, now: sa.ColumnElement[float] | None = None, *,
                           scan: bool = False) -> sa.ColumnElement[bool]:
        """A running lease past its grace whose owner is gone, or past lease_reaper_hard_grace.

        ``now`` replaces the store's clock (the reaper's ``run_once(now=...)`` seam); ``scan``:
        the condition selects the rows (the running index), not a row found by its id.
        """
        j = self.t.jobs
        clock = self.now_sql if now is None else now
        return sa.and_(
            j.c.status == status_sql(RUNNING) if scan else fenced_status(j.c.status, RUNNING),
            j.c.lease_expires_at + sa.func.coalesce(j.c.grace_period, 0.0) < clock,
            sa.or_(~self._owner_alive(clock), j.c.lease_expires_at + self.hard_grace < clock),
        )

    def _fenced(self, job_id: str, token: str) -> sa.ColumnElement[bool]:
        """The owner's fence: the job's row still carries ``token`` and is running."""
        j = self.t.jobs
        return sa.and_(j.c.id == job_id, j.c.lock_token == token, fenced_status(j.c.status, RUNNING))

    def _stale(self, c: Connection | None, job_id: str, event: Event, worker: str | None,
               token: str | None, detail: Any = None) -> None:
        """Audit an owner's write that the fence refused (on ``c``, or in a transaction of its own)."""
        if c is None:
            self.event(job_id, event, STALE_REASON, worker, token, detail)
        else:
            self._event(c, job_id, event, STALE_REASON, worker, token, detail)

    def _delete_lock(self, resource: str, token: str) -> bool:
        """Delete a lock row while ``token`` holds it; False when it expired and moved on."""
        k = self.t.locks
        with self.begin() as c:
            return c.execute(sa.delete(k).where(k.c.resource == resource, k.c.token == token)).rowcount == 1

    def get(self, job_id: str) -> Job | None:
        with self.begin(read=True) as c:
            row = c.execute(sa.select(*self._job_columns()).where(self.t.jobs.c.id == job_id)).first()
        return None if row is None else Job.from_row(row)

