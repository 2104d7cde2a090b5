"""Every difference between the store's databases, decided once per store from its URL.

One class per database family answers each "which database?" question: the clock,
inserts that upsert or skip an existing key, RETURNING, row locks, the one-statement
audited write, how an engine is built and bounded, the server versions it needs, and
what a driver error means. Nothing outside this module asks which database it is.

Workers' clocks may disagree by seconds; the database's does not disagree with itself,
so every lease computation uses the database's time, as float epoch seconds
(sub-second precision everywhere, and lease arithmetic is plain addition).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

import celery_lease.store.bounded as bounded

from ..config import LONG_CALL_TIMEOUT
from ..errors import LeaseConfigError
from ..masking import mask_secrets
from ..vocabulary import StoreFailure
from .dialect import LOCK_WAIT, READ_ONLY, Bounds, Dialect, ms, server_version

__all__ = ["Bounds", "Dialect", "SQLite", "PostgreSQL", "MySQL", "for_url", "SUPPORTED", "READ_ONLY",
           "LOCK_WAIT"]


class _OnConflict(Dialect):
    """The ON CONFLICT forms SQLite and PostgreSQL share; ``_insert`` is the family's INSERT."""

    def _insert(self, table: sa.Table) -> Any:
        raise NotImplementedError

    def upsert(self, table: sa.Table, values: Mapping[str, Any], update: tuple[str, ...]) -> Any:
        stmt = self._insert(table).values(**values)
        return stmt.on_conflict_do_update(index_elements=list(table.primary_key.columns),
                                          set_={c: stmt.excluded[c] for c in update})

    def insert_ignore(self, table: sa.Table) -> Any:
        return self._insert(table).on_conflict_do_nothing().execution_options(preserve_rowcount=True)


class SQLite(_OnConflict):
    """A SQLite file on one host: WAL, BEGIN IMMEDIATE, and a busy timeout inside the bound."""

    name, drivers = "sqlite", ("sqlite",)
    # julianday('now') carries milliseconds; the offset is the Julian day of 1970-01-01T00:00Z.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    single_writer = True
    local_file = True
    # Claim, completion and the publish record run on the driver (AuditedWrites._execute_positional).
    compiled_fast_path = True
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]] = {
        "SQLite": ((3, 35), "UPDATE ... RETURNING")}

    def _insert(self, table: sa.Table) -> Any:
        from sqlalchemy.dialects.sqlite import insert

        return insert(table)

    def lock_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        return query  # BEGIN IMMEDIATE already serialises writers

    def hold_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        return query  # the write transaction holds the whole database

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        if self.url.query.get("mode") == "memory":
            # Pooled connections move between threads, as SQLAlchemy lets a file's do.
            return {"timeout": bounds.lock_wait, "check_same_thread": False}
        return {"timeout": bounds.lock_wait}

    def create_engine(self, bounds: Bounds, pool_size: int, options: Mapping[str, Any]) -> Engine:
        if self.url.query.get("mode") == "memory" and "poolclass" not in options:
            # SQLAlchemy gives an in-memory database one connection per thread; a shared-cache one
            # (Django's in-memory test database) is pooled and bounded like a file.
            options = {"poolclass": sa.pool.QueuePool, "pool_size": pool_size, "max_overflow": 0,
                       "pool_timeout": bounds.pool, **options}
        return super().create_engine(bounds, pool_size, options)

    def _listen(self, engine: Engine, bounds: Bounds) -> None:
        short = bounds.lock_wait

        def begin(conn: Connection) -> None:
            # A writer takes the write lock up front: two deferred transactions that both read
            # and then write would deadlock on the upgrade. A reader begins deferred: in WAL
            # mode it reads the last commit and never waits for a writer, even a frozen one.
            options = conn.get_execution_options()
            if options.get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
                return
            self._begin_immediate(conn.connection.info, options.get(LOCK_WAIT, short), short,
                                  conn.exec_driver_sql)

        sa.event.listen(engine, "begin", begin)

    @staticmethod
    def _begin_immediate(info: dict[str, Any], wait: float, short: float, execute: Any) -> None:
        # The busy timeout belongs to the connection (setup() sets the short one): a long
        # transaction sets its own before BEGIN and the next short one sets it back.
        if info.get(LOCK_WAIT, short) != wait:
            execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
            info[LOCK_WAIT] = wait
        execute("BEGIN IMMEDIATE")

    def begin_write(self, raw: Any, bounds: Bounds) -> None:
        short = bounds.lock_wait
        cursor = raw.cursor()
        try:
            self._begin_immediate(raw.info, short, short, cursor.execute)
        finally:
            cursor.close()

    def server(self, dbapi_conn: Any) -> tuple[str, tuple[int, ...]]:
        cur = dbapi_conn.cursor()
        try:
            return "SQLite", server_version(cur.execute("SELECT sqlite_version()").fetchone()[0])
        finally:
            cur.close()

    def setup(self, dbapi_conn: Any, bounds: Bounds) -> None:
        # pysqlite's own transaction handling begins DEFERRED transactions that
        # deadlock when two readers upgrade to writers; _listen's hook begins them.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(bounds.lock_wait * 1000)}")
        # A validated choice of two words (config.py), not input: pragmas take no parameters.
        cur.execute(f"PRAGMA synchronous={self.synchronous}")
        cur.close()

    def failure_kind(self, exc: Exception) -> StoreFailure | None:
        text = str(getattr(exc, "orig", exc)).lower()
        if "no such table" in text or "no such column" in text or "has no column named" in text:
            return StoreFailure.MISSING
        if "unique constraint failed" in text:
            return StoreFailure.CONFLICT
        if "constraint failed" in text:
            return StoreFailure.CONSTRAINT
        if "readonly" in text or "read-only" in text:
            return StoreFailure.PERMISSION
        if "syntax error" in text:
            return StoreFailure.SYNTAX
        if "database is locked" in text or "database is busy" in text:
            return StoreFailure.TIMEOUT
        return None


class PostgreSQL(_OnConflict):
    """PostgreSQL: one-statement audited writes, a compiled hot path, per-transaction timeouts."""

    name, drivers = "postgresql", ("postgresql",)
    # clock_timestamp(), not now(): a long transaction must not freeze time.
    now_sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
    one_statement_writes = True
    compiled_fast_path = True
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]] = {
        "PostgreSQL": ((12,), "the oldest release its maintainers supported when this was written")}

    def _insert(self, table: sa.Table) -> Any:
        from sqlalchemy.dialects.postgresql import insert

        return insert(table)

    def lock_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        return query.with_for_update(skip_locked=True, of=of)

    def hold_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        return query.with_for_update(of=of)

    def in_id_order(self, table: sa.Table, ids: Collection[str],
                    *where: ColumnElement[bool]) -> ColumnElement[bool]:
        # A plan over a few ids locks rows in key order, one over many (a bitmap heap scan) in heap
        # order: a completion batch and the heartbeat over the same running rows could each wait for
        # the other. Both lock in id order first.
        # The outer statement keeps ``where`` too: what it writes is checked where it writes it.
        locked = sa.select(table.c.id).where(table.c.id.in_(ids), *where).order_by(table.c.id)
        return sa.and_(table.c.id.in_(locked.with_for_update().scalar_subquery()), *where)

    def autocommit_settings(self, bounds: Bounds, async_commit: bool = False) -> list[ColumnElement[bool]]:
        # A write in autocommit is its own transaction, so a transaction-local setting made in
        # its WHERE covers it alone (and survives PgBouncer's transaction pooling). lock_timeout
        # is read when a lock wait begins, after the WHERE ran: it bounds the row-lock wait, the
        # one wait such a write has. statement_timeout is not set here: PostgreSQL arms it when
        # a statement starts, so set inside one it would not apply; the client's bound covers it.
        settings: list[ColumnElement[bool]] = [
            sa.func.set_config("lock_timeout", ms(bounds.server_lock), True).is_not(None)]
        if async_commit:
            # If a server crash undoes an asynchronously committed claim, nothing built on it
            # survives: its owner's later writes are fenced, synchronous, and come after it in the WAL.
            settings.append(sa.func.set_config("synchronous_commit", "off", True).is_not(None))
        return settings

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        # libpq: connect_timeout in whole seconds (at least 2); keepalives find a dead peer of an
        # idle socket; tcp_user_timeout drops a connection whose sent data goes unacknowledged.
        idle = max(1, int(bounds.round_trip / 4))
        args = {"connect_timeout": max(2, math.ceil(bounds.connect)), "keepalives": 1,
                "keepalives_idle": idle, "keepalives_interval": max(1, idle // 2), "keepalives_count": 3,
                "tcp_user_timeout": int(bounds.round_trip * 1000)}
        return {k: v for k, v in args.items() if k not in self.url.query}

    def _listen(self, engine: Engine, bounds: Bounds) -> None:
        super()._listen(engine, bounds)
        if engine.dialect.driver == "psycopg":
            # A frozen peer acknowledges what it is sent and answers keepalives: only a deadline
            # on the client's own wait ends a statement that will never be answered.
            bounded.install(engine, bounds.round_trip)

    def server(self, dbapi_conn: Any) -> tuple[str, tuple[int, ...]]:
        info = getattr(dbapi_conn, "info", None)
        number = getattr(info, "server_version", None) or dbapi_conn.server_version
        return "PostgreSQL", (number // 10000, number % 10000)

    @contextlib.contextmanager
    def transaction(self, conn: Connection, bounds: Bounds, long: bool) -> Iterator[None]:
        # SET LOCAL, as set_config(..., true): per transaction, so a pooled server connection
        # (PgBouncer in transaction mode) never carries one client's limits to another. The
        # settings go out with the transaction's BEGIN, its first round trip: a long one waits
        # for it with the long bound too. A worker's transaction whose client goes silent (frozen,
        # cut off: its kernel still answers keepalives) would hold its row locks until the server
        # noticed, so that nobody could write the job or lock it holds: the server ends it once idle
        # for the whole call bound, when its client has given up anyway. The reaper's long
        # transactions publish while open and keep the server's default. A read holds no row lock:
        # a reader merely descheduled on a loaded host between its SELECT and its COMMIT for longer
        # than the call bound keeps the answer it has, and only a frozen one is ended, after the
        # long bound (its table locks would hold up a migration, and every call queued behind it).
        settings = [sa.func.set_config("statement_timeout", ms(bounds.server_statement), True),
                    sa.func.set_config("lock_timeout", ms(bounds.server_lock), True)]
        if not long:
            reading = conn.get_execution_options().get(READ_ONLY)
            idle = max(LONG_CALL_TIMEOUT, bounds.call) if reading else bounds.call
            settings.append(sa.func.set_config("idle_in_transaction_session_timeout", ms(idle), True))
        with bounded.waiting(conn, bounds.round_trip if long else None):
            conn.execute(sa.select(*settings))
            yield

    def retryable(self, exc: BaseException | None) -> bool:
        state = getattr(getattr(exc, "orig", None), "sqlstate", None)
        return state in ("40P01", "40001")  # deadlock_detected, serialization_failure

    def failure_kind(self, exc: Exception) -> StoreFailure | None:
        state = getattr(getattr(exc, "orig", None), "sqlstate", None) or getattr(
            getattr(exc, "orig", None), "pgcode", None)
        if not state:
            return None
        if state in ("42P01", "42703"):  # undefined_table, undefined_column
            return StoreFailure.MISSING
        if state == "23505":
            return StoreFailure.CONFLICT
        if state.startswith("23"):
            return StoreFailure.CONSTRAINT
        if state == "42501":
            return StoreFailure.PERMISSION
        if state.startswith("42"):
            return StoreFailure.SYNTAX
        if state.startswith("22"):
            return StoreFailure.DATA
        if state in ("57014", "55P03"):  # query_canceled (statement_timeout), lock_not_available
            return StoreFailure.TIMEOUT
        if state.startswith(("08", "57P")):
            return StoreFailure.UNREACHABLE
        return None


class MySQL(Dialect):
    """MySQL or MariaDB (``is_mariadb``, told by the server): UTC sessions and socket timeouts."""

    name, drivers = "mysql", ("mysql", "mariadb")
    # SYSDATE(6), not NOW(6): a long statement must not freeze time. UNIX_TIMESTAMP reads it in
    # the session time zone, which every store connection sets to UTC (see setup()).
    now_sql = "CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)"
    fence_locks_rows = True
    update_returning = False
    # No UPDATE ... RETURNING: a shared completion could not tell which of its rows it wrote, so
    # each completion, and (one decision for the setting) each publish record, is written alone,
    # whatever lease_group_commit says.
    group_commit = False
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]] = {
        "MySQL": ((8, 0, 17), "SELECT ... FOR UPDATE SKIP LOCKED, the utf8mb4_0900_bin collation"),
        "MariaDB": ((10, 6), "SELECT ... FOR UPDATE SKIP LOCKED")}
    _MISSING = frozenset({1146, 1054})  # no such table, unknown column
    _PERMISSION = frozenset({1044, 1045, 1142, 1143, 1227})
    _CONSTRAINT = frozenset({1048, 1364, 1451, 1452})
    _DATA = frozenset({1264, 1265, 1292, 1366, 1406})
    _TIMEOUT = frozenset({1205, 3024, 1969})  # lock wait, max_execution_time, max_statement_time
    _UNREACHABLE = frozenset({2003, 2006, 2013, 2055})

    def __init__(self, url: sa.URL, **settings: Any) -> None:
        super().__init__(url, **settings)
        self.is_mariadb = url.get_backend_name() == "mariadb"
        self.server_label = "MariaDB" if self.is_mariadb else "MySQL"

    def retryable(self, exc: BaseException | None) -> bool:
        # 1213: InnoDB broke a deadlock (gap locks of INSERT IGNORE + UPDATE racing on one key).
        args: tuple[Any, ...] = tuple(getattr(getattr(exc, "orig", None), "args", ()))
        return bool(args) and args[0] == 1213

    def upsert(self, table: sa.Table, values: Mapping[str, Any], update: tuple[str, ...]) -> Any:
        from sqlalchemy.dialects.mysql import insert

        stmt = insert(table).values(**values)
        return stmt.on_duplicate_key_update(**{c: stmt.inserted[c] for c in update})

    def insert_ignore(self, table: sa.Table) -> Any:
        # IGNORE also turns truncation into a warning; callers bound key lengths first.
        return sa.insert(table).prefix_with("IGNORE").execution_options(preserve_rowcount=True)

    def key_collation(self) -> str | None:
        # Binary and NO PAD: ids and keys that differ by case, accents or trailing spaces stay apart. Both
        # servers' minimums have theirs.
        return "utf8mb4_nopad_bin" if self.is_mariadb else "utf8mb4_0900_bin"

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        # Whole seconds, which both PyMySQL and mysqlclient accept. The read and write timeouts
        # bound each round trip on the client's socket.
        trip = max(1, math.ceil(bounds.round_trip))
        args = {"connect_timeout": max(1, math.ceil(bounds.connect)), "read_timeout": trip,
                "write_timeout": trip}
        return {k: v for k, v in args.items() if k not in self.url.query}

    def server(self, dbapi_conn: Any) -> tuple[str, tuple[int, ...]]:
        info = dbapi_conn.get_server_info()
        info = info.decode() if isinstance(info, bytes) else info
        self.is_mariadb = "mariadb" in info.lower()
        # MariaDB's handshake prefixes its version with 5.5.5- for old clients' sake.
        info = info.removeprefix("5.5.5-") if self.is_mariadb else info
        return ("MariaDB" if self.is_mariadb else "MySQL"), server_version(info)

    def setup(self, dbapi_conn: Any, bounds: Bounds) -> None:
        # UNIX_TIMESTAMP(SYSDATE(6)) converts the session's local time back to epoch seconds: in
        # a zone with daylight saving the hour repeated at fall-back maps to one epoch, and the
        # store clock would step back an hour. UTC has no such hour.
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SET time_zone = '+00:00', innodb_lock_wait_timeout = %s",
                        (max(1, math.ceil(bounds.server_lock)),))
        finally:
            cur.close()

    @contextlib.contextmanager
    def transaction(self, conn: Connection, bounds: Bounds, long: bool) -> Iterator[None]:
        if not long:
            yield
            return
        driver: Any = conn.connection.driver_connection  # PyMySQL's, or another driver's
        saved = getattr(driver, "_read_timeout", None), getattr(driver, "_write_timeout", None)
        if saved != (None, None):  # PyMySQL reads its socket timeouts before every round trip
            driver._read_timeout = driver._write_timeout = bounds.round_trip
        try:
            yield
        finally:
            if saved != (None, None):
                driver._read_timeout, driver._write_timeout = saved

    def failure_kind(self, exc: Exception) -> StoreFailure | None:
        args = getattr(getattr(exc, "orig", None), "args", ())
        code = args[0] if args and isinstance(args[0], int) else None
        by_code = ((StoreFailure.MISSING, self._MISSING), (StoreFailure.PERMISSION, self._PERMISSION),
                   (StoreFailure.CONSTRAINT, self._CONSTRAINT), (StoreFailure.DATA, self._DATA),
                   (StoreFailure.TIMEOUT, self._TIMEOUT), (StoreFailure.UNREACHABLE, self._UNREACHABLE))
        for kind, codes in by_code:
            if code in codes:
                return kind
        if code == 1062:
            return StoreFailure.CONFLICT
        if code == 1064:
            return StoreFailure.SYNTAX
        return None


SUPPORTED = (SQLite, PostgreSQL, MySQL)


def for_url(url: str, **settings: Any) -> Dialect:
    """The dialect of a store URL; LeaseConfigError for an unusable or unsupported one."""
    try:
        parsed = sa.engine.make_url(url)
        name = parsed.get_dialect().name
    except Exception as exc:  # noqa: BLE001 - any URL/driver problem is a config error
        # "from None": SQLAlchemy's own message may quote the URL with its password.
        raise LeaseConfigError("lease_store_url", url,
                               f"is not a usable SQLAlchemy URL ({mask_secrets(str(exc))})") from None
    for family in SUPPORTED:
        if name in family.drivers:
            return family(parsed, **settings)
    names = ", ".join(n for family in SUPPORTED for n in family.drivers)
    raise LeaseConfigError("lease_store_url", parsed.render_as_string(hide_password=True),
                           f"dialect {name!r} is not supported",
                           f"Use one of {names}.")
