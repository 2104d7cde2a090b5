"""What every database family answers, and the time bounds a store call keeps.

``Dialect`` is the question list with the answers most families share; dialects.py holds
one subclass per family. ``Bounds`` turns the call timeout into the waits of each layer:
the pool, the connection, a round trip, a statement and a lock on the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

import celery_lease.store.failures as failures

from ..errors import LeaseConfigError, LeaseError
from ..vocabulary import StoreFailure

__all__ = ["Bounds", "Dialect", "READ_ONLY", "LOCK_WAIT", "ms", "ping_if_idle", "server_version"]

# Execution options StoreEngine.begin sets on its connection: the transaction only reads; the
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
    that the error names what was slow and the connection stays usable. A write waits for a
    one-writer database's lock (SQLite's) a round trip at most, and never past ``lock_cap`` (its
    busy timeout). Each part is worked out once: every store call reads them.
    """

    call: float
    lock_cap: float = math.inf
    pool: float = dataclasses.field(init=False)
    connect: float = dataclasses.field(init=False)
    round_trip: float = dataclasses.field(init=False)
    server_statement: float = dataclasses.field(init=False)
    server_lock: float = dataclasses.field(init=False)
    lock_wait: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        parts = {"pool": self.call / 4, "connect": self.call / 4, "round_trip": self.call / 2,
                 "server_statement": self.call * 0.4, "server_lock": self.call / 4,
                 "lock_wait": min(self.lock_cap, self.call / 2)}
        for name, value in parts.items():
            object.__setattr__(self, name, value)  # frozen: set once, here


def ms(seconds: float) -> str:
    return str(max(1, int(seconds * 1000)))


class Dialect:
    """The rules of one database family; a store holds one, chosen from its URL."""

    name: ClassVar[str]
    drivers: ClassVar[tuple[str, ...]]  # SQLAlchemy dialect names of this family
    now_sql: ClassVar[str]
    update_returning: ClassVar[bool] = True
    one_statement_writes: ClassVar[bool] = False  # audited write and heartbeat as one statement
    compiled_fast_path: ClassVar[bool] = False  # hot statements compiled once, run on the driver
    # lease_group_commit: completions due at once share one UPDATE ... RETURNING, publish records one
    # transaction (store/group.py).
    group_commit: ClassVar[bool] = True
    single_writer: ClassVar[bool] = False  # one writer at a time for the whole database
    # A write's subquery share-locks the rows it reads (InnoDB): INSERT ... SELECT from jobs holds the job's
    # row, a claim's NOT EXISTS over events the gap where other jobs' events go.
    fence_locks_rows: ClassVar[bool] = False
    local_file: ClassVar[bool] = False  # the store lives on one host's disk
    minimums: ClassVar[Mapping[str, tuple[tuple[int, ...], str]]]  # server -> (version, why)

    def __init__(self, url: sa.URL, *, busy_timeout: float = 30.0, synchronous: str = "FULL",
                 clock_offset: float = 0.0) -> None:
        """``clock_offset``: seconds added to the store's clock, a test seam for a stepped clock
        (0, the default, leaves the SQL exactly as the family writes it)."""
        if not math.isfinite(clock_offset):
            raise ValueError(f"clock_offset must be a finite number of seconds, not {clock_offset!r}")
        self.url = url
        self.busy_timeout = busy_timeout
        self.synchronous = synchronous
        self.clock_offset = float(clock_offset)
        self.server_label = self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} dialect>"

    def bounds(self, call: float) -> Bounds:
        """The bounds of a store call of ``call`` seconds on this database (its busy timeout caps a
        write's wait for the one write lock)."""
        return Bounds(call, self.busy_timeout)

    def speaks(self, driver_dialect: str) -> bool:
        """Whether a SQLAlchemy connection of this dialect name talks to this family."""
        return driver_dialect in self.drivers

    # -- SQL --------------------------------------------------------------------
    def now(self) -> ColumnElement[float]:
        """The current time on the store, in epoch seconds, as a SQL expression.

        A clock offset is written into the text as a constant (no parameter), so that statements
        compiled once for the driver keep it.
        """
        if not self.clock_offset:
            return sa.literal_column(self.now_sql, type_=sa.Double())
        return sa.literal_column(f"({self.now_sql} + ({self.clock_offset!r}))", type_=sa.Double())

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

    def hold_rows(self, query: sa.Select, of: sa.Table) -> sa.Select:
        """``query`` holding its rows of ``of`` until the transaction ends (waiting for them)."""
        return query.with_for_update()

    def in_id_order(self, table: sa.Table, ids: Collection[str],
                    *where: ColumnElement[bool]) -> ColumnElement[bool]:
        """``table``'s rows whose id is one of ``ids`` (and that meet ``where``), for a write over many of
        them: where the plan decides the order its rows are locked in, they are locked in id order first."""
        return sa.and_(table.c.id.in_(ids), *where)

    def autocommit_settings(self, bounds: Bounds, async_commit: bool = False) -> list[ColumnElement[bool]]:
        """Conditions that set a one-statement write's own transaction settings (none here)."""
        return []

    def key_collation(self) -> str | None:
        """The collation of the store's id and key columns, for their DDL (asked once the store has
        connected, which tells MySQL from MariaDB); None where the database compares strings byte for byte."""
        return None

    # -- engines and transactions -------------------------------------------------------
    def create_engine(self, bounds: Bounds, pool_size: int, options: Mapping[str, Any]) -> Engine:
        """An engine whose every connection, checkout and round trip is bounded by ``bounds``."""
        kwargs: dict[str, Any] = {"connect_args": self.connect_args(bounds)}
        if "poolclass" not in options:
            kwargs.update(pool_size=pool_size, max_overflow=0, pool_timeout=bounds.pool)
        try:
            engine = sa.create_engine(self.url, **{**kwargs, **options})
        except (TypeError, sa.exc.ArgumentError) as exc:  # an option this driver or pool does not take
            if not options:
                raise
            raise LeaseConfigError("lease_store_engine_options", sorted(options), f"SQLAlchemy refused them: "
                                   f"{exc}", "Remove or correct the option it names") from exc
        sa.event.listen(engine, "connect", self._on_connect(bounds))
        self._listen(engine, bounds)
        return engine

    def connect_args(self, bounds: Bounds) -> dict[str, Any]:
        return {}

    def _listen(self, engine: Engine, bounds: Bounds) -> None:
        sa.event.listen(engine, "checkout", ping_if_idle)

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

    def begin_write(self, raw: Any, bounds: Bounds) -> None:
        """Open a short write transaction on a pooled driver connection, as begin() would."""
        cursor = raw.cursor()
        try:
            cursor.execute("BEGIN")
        finally:
            cursor.close()

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

    def failure_kind(self, exc: Exception) -> StoreFailure | None:
        """The StoreFailure of a driver error this family knows (any but ``pool``); None otherwise."""
        return None


def ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
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
        if getattr(dbapi_conn, "timed_out", False):
            # The server gave the ping no answer within a round trip's bound: a new connection
            # to it would spend the rest of the call's bound on the same silence. The call fails
            # now, naming it, and the pool drops this connection.
            raise
        raise sa.exc.DisconnectionError(str(exc)) from exc


def server_version(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("-")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)
