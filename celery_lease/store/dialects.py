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
import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from ..errors import LeaseConfigError, LeaseError
from ..masking import mask_secrets
from . import bounded, failures

__all__ = ["Bounds", "Dialect", "SQLite", "PostgreSQL", "MySQL", "for_url", "SUPPORTED"]

# Execution options StoreBase.begin sets on its connection: the transaction only reads; the
# seconds a long one (a reaper batch, an operator's command) may wait for a lock.
READ_ONLY = "lease_read_only"
LOCK_WAIT = "lease_lock_wait"
IDLE_PING_AFTER = 2.0  # seconds a pooled connection may idle before it is pinged on checkout


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How long the parts of one store call may take, all derived from the call bound (seconds).

    Waiting for a pooled connection and opening one get a quarter each, and each round trip
    half: a call that meets all three still returns within the bound. The server gives up on
    a lock wait at a quarter and on a statement at four tenths, before the client does, so
    that the error names what was slow and the connection stays usable.
    """

    call: float

    @property
    def pool(self) -> float:
        return self.call / 4

    @property
    def connect(self) -> float:
        return self.call / 4

    @property
    def round_trip(self) -> float:
        return self.call / 2

    @property
    def server_statement(self) -> float:
        return self.call * 0.4

    @property
    def server_lock(self) -> float:
        return self.call / 4


def _ms(seconds: float) -> str:
    return str(max(1, int(seconds * 1000)))


class Dialect:
    """The rules of one database family; a store holds one, chosen from its URL."""

    name: ClassVar[str]
    drivers: ClassVar[tuple[str, ...]]  # SQLAlchemy dialect names of this family
    now_sql: ClassVar[str]
    update_returning: ClassVar[bool] = True
    one_statement_writes: ClassVar[bool] = False  # audited write and heartbeat as one statement
    compiled_fast_path: ClassVar[bool] = False  # hot statements compiled once, run on the driver
    single_writer: ClassVar[bool] = False  # one writer at a time for the whole database
    fence_locks_rows: ClassVar[bool] = False  # INSERT ... SELECT from jobs share-locks the row
    local_file: ClassVar[bool] = False  # the store lives on one host's disk
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]]  # server -> (version, why)

    def __init__(self, url: sa.URL, *, busy_timeout: float = 30.0, synchronous: str = "FULL") -> None:
        self.url = url
        self.busy_timeout = busy_timeout
        self.synchronous = synchronous
        self.server_label = self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} dialect>"

    def busy_wait(self, bounds: Bounds) -> float:
        """How long a write waits for the database's one write lock (single_writer)."""
        return min(self.busy_timeout, bounds.round_trip)

    def speaks(self, driver_dialect: str) -> bool:
        """Whether a SQLAlchemy connection of this dialect name talks to this family."""
        return driver_dialect in self.drivers

    # -- SQL --------------------------------------------------------------------
    def now(self) -> ColumnElement[float]:
        """The current time on the store, in epoch seconds, as a SQL expression."""
        return sa.literal_column(self.now_sql, type_=sa.Double())

    def upsert(self, table: sa.Table, values: Mapping[str, Any], update: tuple[str, ...]) -> Any:
        """INSERT ``values``, or on a primary-key conflict set the ``update`` columns to the new values."""
        raise NotImplementedError

    def insert_ignore(self, table: sa.Table) -> Any:
        """An INSERT that skips a row whose key exists, without an error that aborts the transaction.

        Its row count says whether it inserted (SQLAlchemy keeps an INSERT's count only on request).
        """
        raise NotImplementedError

    def lock_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        """``query`` holding its rows of ``of`` and skipping rows another transaction holds."""
        return query.with_for_update(skip_locked=True)

    def autocommit_settings(self, bounds: Bounds, async_commit: bool = False) -> list[ColumnElement[bool]]:
        """Conditions that set a one-statement write's own transaction settings (none here)."""
        return []

    # -- engines and transactions -------------------------------------------------------
    def create_engine(self, bounds: Bounds, pool_size: int, options: Mapping[str, Any]) -> Engine:
        """An engine whose every connection, checkout and round trip is bounded by ``bounds``."""
        kwargs: dict[str, Any] = {"connect_args": self.connect_args(bounds)}
        if "poolclass" not in options:
            kwargs.update(pool_size=pool_size, max_overflow=0, pool_timeout=bounds.pool)
        engine = sa.create_engine(self.url, **{**kwargs, **options})
        sa.event.listen(engine, "connect", self._on_connect(bounds))
        self._listen(engine, bounds)
        return engine

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        return {}

    def _listen(self, engine: Engine, bounds: Bounds) -> None:
        sa.event.listen(engine, "checkout", _ping_if_idle)

    def _on_connect(self, bounds: Bounds) -> Any:
        def on_connect(dbapi_conn: Any, _record: Any) -> None:
            # An error here closes the connection: the pool never hands it out.
            self.check_server(*self.server(dbapi_conn))
            self.setup(dbapi_conn, bounds)

        return on_connect

    def server(self, dbapi_conn: Any) -> tuple[str, tuple[int, ...]]:
        """(server name, version) of a new connection."""
        raise NotImplementedError

    def check_server(self, label: str, version: tuple[int, ...]) -> None:
        """Refuse a server older than the features the store relies on, in one line."""
        self.server_label = label
        minimum, why = self.minimums[label]
        if tuple(version) < minimum:
            have, need = ".".join(map(str, version)), ".".join(map(str, minimum))
            raise LeaseConfigError("lease_store_url", self.url.render_as_string(hide_password=True),
                                   f"{label} {have} is older than {label} {need}, the oldest the lease "
                                   f"store supports ({why})")

    def setup(self, dbapi_conn: Any, bounds: Bounds) -> None:
        """Session settings of a new connection."""

    @contextlib.contextmanager
    def transaction(self, conn: Connection, bounds: Bounds, long: bool) -> Iterator[None]:
        """Set up one transaction of ``begin()`` (``long``: a reaper, migration or operator's)."""
        yield

    # -- errors -----------------------------------------------------------------
    def classify(self, exc: Exception, where: str, bounds: Bounds) -> LeaseError:
        """The LeaseError a driver or pool error means (see store/failures.py)."""
        return failures.classify(exc, where, bounds, self.failure_kind(exc))

    def retryable(self, exc: BaseException | None) -> bool:
        """Whether the server rolled the transaction back to break a deadlock: run it again."""
        return False

    def failure_kind(self, exc: Exception) -> str | None:
        """``missing``, ``conflict``, ``constraint``, ``permission``, ``syntax``, ``data``,
        ``timeout`` or ``unreachable`` for a driver error this family knows; None otherwise."""
        return None


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


def _version(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("-")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


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
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]] = {
        "SQLite": ((3, 35), "UPDATE ... RETURNING")}

    def _insert(self, table: sa.Table) -> Any:
        from sqlalchemy.dialects.sqlite import insert

        return insert(table)

    def lock_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        return query  # BEGIN IMMEDIATE already serialises writers

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        return {"timeout": self.busy_wait(bounds)}

    def _listen(self, engine: Engine, bounds: Bounds) -> None:
        short = self.busy_wait(bounds)

        def begin(conn: Connection) -> None:
            # A writer takes the write lock up front: two deferred transactions that both read
            # and then write would deadlock on the upgrade. A reader begins deferred: in WAL
            # mode it reads the last commit and never waits for a writer, even a frozen one.
            options = conn.get_execution_options()
            if options.get(READ_ONLY):
                conn.exec_driver_sql("BEGIN")
                return
            # The busy timeout belongs to the connection (setup() sets the short one): a long
            # transaction sets its own before BEGIN and the next short one sets it back.
            wait, info = options.get(LOCK_WAIT, short), conn.connection.info
            if info.get(LOCK_WAIT, short) != wait:
                conn.exec_driver_sql(f"PRAGMA busy_timeout={int(wait * 1000)}")
                info[LOCK_WAIT] = wait
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        sa.event.listen(engine, "begin", begin)

    def server(self, dbapi_conn: Any) -> tuple[str, tuple[int, ...]]:
        cur = dbapi_conn.cursor()
        try:
            return "SQLite", _version(cur.execute("SELECT sqlite_version()").fetchone()[0])
        finally:
            cur.close()

    def setup(self, dbapi_conn: Any, bounds: Bounds) -> None:
        # pysqlite's own transaction handling begins DEFERRED transactions that
        # deadlock when two readers upgrade to writers; _listen's hook begins them.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(self.busy_wait(bounds) * 1000)}")
        # A validated choice of two words (config.py), not input: pragmas take no parameters.
        cur.execute(f"PRAGMA synchronous={self.synchronous}")
        cur.close()

    def failure_kind(self, exc: Exception) -> str | None:
        text = str(getattr(exc, "orig", exc)).lower()
        if "no such table" in text or "no such column" in text or "has no column named" in text:
            return "missing"
        if "unique constraint failed" in text:
            return "conflict"
        if "constraint failed" in text:
            return "constraint"
        if "readonly" in text or "read-only" in text:
            return "permission"
        if "syntax error" in text:
            return "syntax"
        if "database is locked" in text or "database is busy" in text:
            return "timeout"
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

    def autocommit_settings(self, bounds: Bounds, async_commit: bool = False) -> list[ColumnElement[bool]]:
        # A write in autocommit is its own transaction, so a transaction-local setting made in
        # its WHERE covers it alone (and survives PgBouncer's transaction pooling). lock_timeout
        # is read when a lock wait begins, after the WHERE ran: it bounds the row-lock wait, the
        # one wait such a write has. statement_timeout is not set here: PostgreSQL arms it when
        # a statement starts, so set inside one it would not apply; the client's bound covers it.
        settings: list[ColumnElement[bool]] = [
            sa.func.set_config("lock_timeout", _ms(bounds.server_lock), True).is_not(None)]
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
        # for it with the long bound too.
        with bounded.waiting(conn, bounds.round_trip if long else None):
            conn.execute(sa.select(
                sa.func.set_config("statement_timeout", _ms(bounds.server_statement), True),
                sa.func.set_config("lock_timeout", _ms(bounds.server_lock), True)))
            yield

    def retryable(self, exc: BaseException | None) -> bool:
        state = getattr(getattr(exc, "orig", None), "sqlstate", None)
        return state in ("40P01", "40001")  # deadlock_detected, serialization_failure

    def failure_kind(self, exc: Exception) -> str | None:
        state = getattr(getattr(exc, "orig", None), "sqlstate", None) or getattr(
            getattr(exc, "orig", None), "pgcode", None)
        if not state:
            return None
        if state in ("42P01", "42703"):  # undefined_table, undefined_column
            return "missing"
        if state == "23505":
            return "conflict"
        if state.startswith("23"):
            return "constraint"
        if state == "42501":
            return "permission"
        if state.startswith("42"):
            return "syntax"
        if state.startswith("22"):
            return "data"
        if state in ("57014", "55P03"):  # query_canceled (statement_timeout), lock_not_available
            return "timeout"
        if state.startswith(("08", "57P")):
            return "unreachable"
        return None


class MySQL(Dialect):
    """MySQL or MariaDB (``is_mariadb``, told by the server): UTC sessions and socket timeouts."""

    name, drivers = "mysql", ("mysql", "mariadb")
    # SYSDATE(6), not NOW(6): a long statement must not freeze time. UNIX_TIMESTAMP reads it in
    # the session time zone, which every store connection sets to UTC (see setup()).
    now_sql = "CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)"
    fence_locks_rows = True
    update_returning = False
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]] = {
        "MySQL": ((8, 0), "SELECT ... FOR UPDATE SKIP LOCKED"),
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
        return ("MariaDB" if self.is_mariadb else "MySQL"), _version(info)

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

    def failure_kind(self, exc: Exception) -> str | None:
        args = getattr(getattr(exc, "orig", None), "args", ())
        code = args[0] if args and isinstance(args[0], int) else None
        for kind, codes in (("missing", self._MISSING), ("permission", self._PERMISSION),
                            ("constraint", self._CONSTRAINT), ("data", self._DATA),
                            ("timeout", self._TIMEOUT), ("unreachable", self._UNREACHABLE)):
            if code in codes:
                return kind
        if code == 1062:
            return "conflict"
        if code == 1064:
            return "syntax"
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
