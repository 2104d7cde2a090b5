"""celery_lease.store.dialects: the store's clock, bounds, server gate and error meaning per database."""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import pytest
import sqlalchemy as sa

from celery_lease.errors import (
    LeaseConfigError,
    StoreConflict,
    StoreNotMigrated,
    StoreRejected,
    StoreUnavailable,
)
from celery_lease.store import ClaimTerms, Store, dialect, dialects
from celery_lease.vocabulary import StoreFailure
from tests.conftest import unique_prefix
from tests.helpers import wait_for
from tests.tcp_proxy import TcpProxy

SLACK = 1.5  # seconds a bounded call may overrun its bound on a busy two-core machine


def claim(store: Store, job_id: str, token: str) -> bool:
    return store.jobs.claim(job_id, "w:1", token,
                            ClaimTerms(duration=30.0, grace=0.0,
                                       max_attempts=3, max_expirations=3, takeover=False),
                            task_name="t.task", queue="q", payload=lambda: None).claimed


# -- the clock ------------------------------------------------------------------------
def test_store_now_is_close_to_this_machines_clock(store):
    # The services run on this machine, so the two clocks agree closely.
    before = time.time()
    now = store.now()
    after = time.time()
    assert before - 1.0 <= now <= after + 1.0


def test_two_reads_of_the_store_clock_differ_by_less_than_a_second(store):
    first = store.now()
    second = store.now()
    assert 0 <= second - first < 1.0


def test_store_clock_has_sub_second_precision(store):
    # One read could land on a whole second by chance; five cannot all do so.
    reads = [store.now() for _ in range(5)]
    assert any(r != int(r) for r in reads), reads


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_a_clock_offset_moves_every_clock_read_of_the_store_and_nothing_else(store, offset):
    # The test seam of a stepped clock: the store's now, and the leases its claims write (on
    # PostgreSQL and SQLite through the statements compiled once for the driver).
    twin = Store(store.url, store.prefix, clock_offset=offset)
    try:
        assert abs(twin.now() - store.now() - offset) < 1.0
        assert claim(twin, "j-offset", secrets.token_hex(16))
        job = store.get("j-offset")
        assert abs(job.lease_expires_at - (store.now() + offset + 30.0)) < 1.0
    finally:
        twin.engine.dispose()


def test_no_clock_offset_leaves_the_clock_sql_as_the_family_writes_it(store):
    assert str(store.now_sql) == store.dialect.now_sql
    with pytest.raises(ValueError, match="finite"):
        dialects.for_url(store.url, clock_offset=float("nan"))


def test_store_clock_advances_inside_one_transaction(store):
    # A long transaction must not freeze time (PostgreSQL's now() would).
    with store.begin() as conn:
        first = conn.execute(sa.select(store.now_sql)).scalar_one()
        wait_for(
            lambda: conn.execute(sa.select(store.now_sql)).scalar_one() > first,
            timeout=2.0, interval=0.01, message="store clock did not advance inside a transaction",
        )


@pytest.mark.parametrize("family", dialects.SUPPORTED, ids=lambda f: f.name)
def test_every_supported_family_has_a_clock_expression(family):
    expression = family(sa.make_url(f"{family.drivers[0]}://")).now()
    assert isinstance(expression.type, sa.Double)


def test_store_on_an_unsupported_dialect_is_a_config_error():
    with pytest.raises(LeaseConfigError) as info:
        Store("oracle://scott:tiger@127.0.0.1/orcl")
    assert info.value.setting == "lease_store_url"
    assert "oracle" in str(info.value)


@pytest.mark.parametrize(("url", "family"), [("sqlite:///x.db", dialects.SQLite),
                                             ("postgresql+psycopg://h/db", dialects.PostgreSQL),
                                             ("mysql+pymysql://h/db", dialects.MySQL),
                                             ("mariadb+pymysql://h/db", dialects.MySQL)])
def test_the_dialect_is_chosen_once_from_the_url(url, family):
    assert type(dialects.for_url(url)) is family


# -- MySQL/MariaDB sessions in UTC ------------------------------------------------------------
@pytest.fixture
def mysql_store(mysql_url):
    store = Store(mysql_url, unique_prefix(), pool_size=3)
    yield store
    store.engine.dispose()


def test_every_mysql_store_connection_runs_in_utc(mysql_store):
    # Three connections at once, so the pool opens three.
    with mysql_store.begin() as a, mysql_store.begin() as b, mysql_store.begin() as c:
        zones = [conn.execute(sa.text("SELECT @@session.time_zone")).scalar_one() for conn in (a, b, c)]
    assert zones == ["+00:00"] * 3


def test_mysql_store_clock_reads_an_ambiguous_local_hour_as_python_does(mysql_store):
    # 2024-11-03 01:30 happened twice in New York (EDT, then EST). UNIX_TIMESTAMP reads a wall
    # time in the session's zone; in the store's UTC session it means one instant only.
    wall = datetime.datetime(2024, 11, 3, 1, 30)
    expected = wall.replace(tzinfo=datetime.timezone.utc).timestamp()
    with mysql_store.begin() as c:
        named = c.execute(sa.text("SELECT COUNT(*) FROM mysql.time_zone_name "
                                  "WHERE Name = 'America/New_York'")).scalar_one()
        seen = float(c.execute(sa.text("SELECT UNIX_TIMESTAMP(:wall)"), {"wall": wall}).scalar_one())
        clock = float(c.execute(sa.select(mysql_store.now_sql)).scalar_one())
        # Another session zone reads the same wall time as another instant: the store's must not.
        c.execute(sa.text("SET time_zone = 'America/New_York'" if named else "SET time_zone = '-05:00'"))
        elsewhere = float(c.execute(sa.text("SELECT UNIX_TIMESTAMP(:wall)"), {"wall": wall}).scalar_one())
        c.execute(sa.text("SET time_zone = '+00:00'"))
    assert seen == expected
    assert elsewhere != expected
    assert abs(clock - time.time()) < 1.0


# -- server versions ---------------------------------------------------------------------------
OLD = {"sqlite": ("SQLite", (3, 34, 1)), "postgresql": ("PostgreSQL", (11, 22)),
       "mysql": ("MariaDB", (10, 5, 27))}


@pytest.mark.parametrize(("family", "label", "version", "minimum"), [
    (dialects.MySQL, "MariaDB", (10, 5, 27), "10.6"), (dialects.MySQL, "MySQL", (8, 0, 16), "8.0.17"),
    (dialects.PostgreSQL, "PostgreSQL", (11, 22), "12"), (dialects.SQLite, "SQLite", (3, 34, 1), "3.35")])
def test_a_server_below_the_minimum_is_refused_in_one_line_naming_it(family, label, version, minimum):
    dialect = family(sa.make_url(f"{family.drivers[0]}://user:secret@host/db"))
    with pytest.raises(LeaseConfigError) as info:
        dialect.check_server(label, version)
    message = str(info.value)
    assert "\n" not in message and "secret" not in message
    assert f"{label} {'.'.join(map(str, version))}" in message and f"{label} {minimum}" in message


def test_a_store_on_an_old_server_refuses_its_first_connection(store_factory):
    store = store_factory(migrate=False)
    label, version = OLD[store.dialect.name]
    store.dialect.server = lambda _conn: (label, version)
    try:
        with pytest.raises(LeaseConfigError, match=f"{label} {'.'.join(map(str, version))} is older"):
            store.now()
    finally:
        del store.dialect.server  # the fixture drops the tables through a real gate


def test_this_machines_servers_pass_the_gate_and_say_what_they_are(store):
    store.now()
    assert store.dialect.server_label in store.dialect.minimums
    if store.dialect.name == "mysql":
        assert store.dialect.is_mariadb == (store.dialect.server_label == "MariaDB")


# -- SQLite durability -------------------------------------------------------------------------
@pytest.mark.parametrize(("setting", "pragma"), [(None, 2), ("FULL", 2), ("NORMAL", 1)])
def test_sqlite_store_connections_use_the_configured_synchronous_level(sqlite_url, setting, pragma):
    store = Store(sqlite_url, unique_prefix(), sqlite_synchronous=setting, pool_size=2)
    try:
        # Two pooled connections at once (raw: two BEGIN IMMEDIATE would wait on each other).
        a, b = store.engine.raw_connection(), store.engine.raw_connection()
        levels = [conn.cursor().execute("PRAGMA synchronous").fetchone()[0] for conn in (a, b)]
        a.close()
        b.close()
    finally:
        store.engine.dispose()
    assert levels == [pragma, pragma]  # 2 is FULL, 1 is NORMAL


# -- what an error means ---------------------------------------------------------------------
def test_a_missing_table_asks_for_a_migration(store_factory):
    store = store_factory(migrate=False)
    with pytest.raises(StoreNotMigrated, match="lease migrate"):
        store.get("nothing")


def test_a_missing_column_asks_for_a_migration(store_factory):
    # The dropped column leaves the version table at the newest revision: never reuse it.
    store = store_factory(reuse=False)
    with store.begin() as c:
        c.execute(sa.text(f"ALTER TABLE {store.t.events.name} DROP COLUMN detail"))
    with pytest.raises(StoreNotMigrated, match="lease migrate"):
        store.event("j1", "published", detail={"x": 1})


def test_a_syntax_error_says_so_and_does_not_ask_for_a_migration(store):
    with pytest.raises(StoreRejected) as info, store.begin() as c:
        c.execute(sa.text("SELEC 1"))
    assert info.value.kind == "syntax" and "migrate" not in str(info.value)
    assert not isinstance(info.value, StoreUnavailable)  # a refusal is not an outage: never retried


def test_a_duplicate_key_is_a_conflict_and_a_missing_value_a_constraint(store):
    store.publishes.record("j1", "t.task", "q", "{}", 3)
    with pytest.raises(StoreConflict) as dup, store.begin() as c:
        c.execute(sa.insert(store.t.workers).values(worker_id="w", hostname="h", pid=1, started_at=1.0,
                                                    last_seen_at=1.0))
        c.execute(sa.insert(store.t.workers).values(worker_id="w", hostname="h", pid=1, started_at=1.0,
                                                    last_seen_at=1.0))
    assert dup.value.kind == "conflict"
    with pytest.raises(StoreRejected) as missing, store.begin() as c:
        c.execute(sa.insert(store.t.workers).values(worker_id="v", hostname=None, pid=1, started_at=1.0,
                                                    last_seen_at=1.0))
    assert missing.value.kind == "constraint" and "migrate" not in str(missing.value)


def test_a_bad_value_is_a_data_error_on_postgresql(postgres_url):
    store = Store(postgres_url, unique_prefix())
    try:
        with pytest.raises(StoreRejected) as info, store.begin() as c:
            c.execute(sa.text("SELECT CAST('abc' AS DOUBLE PRECISION)"))
    finally:
        store.engine.dispose()
    assert info.value.kind == "data"


class _Orig(Exception):
    """A driver error as the driver would carry it (pure unit test of the classification)."""

    def __init__(self, *args, sqlstate=None):
        super().__init__(*args)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("url", "orig"), [
    ("postgresql+psycopg://h/db", _Orig("permission denied for table jobs", sqlstate="42501")),
    ("mysql+pymysql://h/db", _Orig(1142, "UPDATE command denied to user")),
    ("sqlite:///x.db", _Orig("attempt to write a readonly database")),
])
def test_a_permission_error_says_what_to_grant(url, orig):
    dialect = dialects.for_url(url)
    error = dialect.classify(sa.exc.ProgrammingError("UPDATE", {}, orig), "db", dialects.Bounds(10.0))
    assert isinstance(error, StoreRejected) and error.kind == "permission"
    assert "GRANT" in str(error).upper() and "migrate" not in str(error)


@pytest.mark.parametrize(("url", "orig", "kind"), [
    ("postgresql+psycopg://h/db", _Orig("duplicate key", sqlstate="23505"), StoreFailure.CONFLICT),
    ("postgresql+psycopg://h/db", _Orig("server closed the connection", sqlstate="08006"),
     StoreFailure.UNREACHABLE),
    ("mysql+pymysql://h/db", _Orig(1064, "You have an error in your SQL syntax"), StoreFailure.SYNTAX),
    ("sqlite:///x.db", _Orig("no such table: jobs"), StoreFailure.MISSING),
    ("sqlite:///x.db", _Orig("disk I/O error"), StoreFailure.UNREACHABLE),  # unknown: SQLAlchemy's class
])
def test_every_store_error_names_its_kind_with_a_store_failure_member(url, orig, kind):
    dialect = dialects.for_url(url)
    error = dialect.classify(sa.exc.OperationalError("SELECT", {}, orig), "db", dialects.Bounds(10.0))
    assert error.kind is kind


# -- bounded calls ---------------------------------------------------------------------------
def test_a_call_waiting_for_a_pooled_connection_raises_store_unavailable_within_the_pool_timeout(store_url):
    store = Store(store_url, unique_prefix(), call_timeout=2.0, pool_size=1)
    store.migrate()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.engine.connect():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(10)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no pooled connection") as info:
            store.now()
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join(10)
        store.t.metadata.drop_all(store.engine)
        store.engine.dispose()
    assert not isinstance(info.value.__cause__, StoreUnavailable)
    assert isinstance(info.value.__cause__, sa.exc.TimeoutError)
    assert store.bounds.pool <= elapsed < store.bounds.pool + SLACK


def test_a_write_blocked_by_a_held_row_lock_ends_within_the_bound(store_url):
    store = Store(store_url, unique_prefix(), call_timeout=2.0)
    store.migrate()
    other = sa.create_engine(store_url, poolclass=sa.NullPool)
    try:
        store.publishes.record("locked", "t.task", "q", "{}", 3)
        token = secrets.token_hex(16)
        assert claim(store, "locked", token)
        with other.connect() as blocker:
            j = store.t.jobs
            if store.dialect.single_writer:
                blocker.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                blocker.execute(sa.select(j.c.id).where(j.c.id == "locked").with_for_update())
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.jobs.complete("locked", token)
            elapsed = time.monotonic() - started
            blocker.rollback()
        assert elapsed < store.bounds.call + SLACK
        assert store.jobs.complete("locked", token) is True
    finally:
        other.dispose()
        store.t.metadata.drop_all(store.engine)
        store.engine.dispose()


def test_a_worker_transaction_whose_client_went_silent_gives_up_its_row_locks_within_the_call_bound(
        postgres_url):
    store = Store(postgres_url, unique_prefix(), call_timeout=1.0)
    store.migrate()
    other = Store(postgres_url, store.prefix)
    store.publishes.record("held", "t.task", "q", "{}", 3)
    locked, silent, ended = threading.Event(), threading.Event(), []

    def frozen_client() -> None:
        # A transaction that took the job's row lock, then whose client stops sending anything.
        try:
            with store.begin() as c:
                j = store.t.jobs
                c.execute(sa.update(j).where(j.c.id == "held").values(attempt_count=j.c.attempt_count))
                locked.set()
                silent.wait(30)
        except StoreUnavailable as exc:
            ended.append(exc)

    holder = threading.Thread(target=frozen_client)
    holder.start()
    try:
        assert locked.wait(10)
        # Another worker's claim of the same row gets through once the server ended the silent one.
        wait_for(lambda: _claims(other, "held"), timeout=15,
                 message="the silent transaction kept its row lock")
    finally:
        silent.set()
        holder.join(10)
        other.engine.dispose()
        store.drop_schema()
        store.engine.dispose()
    assert ended, "the silent transaction committed after its session should have been ended"


@pytest.mark.parametrize("read", [True, False], ids=["read", "write"])
def test_only_a_writing_transaction_idle_past_the_call_bound_is_ended_by_the_server(postgres_url, read):
    # A process descheduled between its statement and its COMMIT (a loaded host) is idle in its
    # transaction: a read holds no row lock and keeps its answer; a write is ended (it may hold locks).
    owner = Store(postgres_url, unique_prefix())  # DDL within a 1 s bound can fail on a loaded host
    owner.migrate()
    store = Store(postgres_url, owner.prefix, call_timeout=1.0)
    watcher = sa.create_engine(postgres_url)
    try:
        def idle_for(pid: int) -> float | None:
            with watcher.connect() as w:
                return w.execute(sa.text(
                    "SELECT EXTRACT(EPOCH FROM now() - state_change) FROM pg_stat_activity "
                    "WHERE pid = :pid AND state = 'idle in transaction'"), {"pid": pid}).scalar()

        def stalled() -> None:
            with store.begin(read=read) as c:
                pid = c.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                c.execute(sa.select(store.t.jobs.c.id).limit(1)).all()
                # Well past the call bound idle as the server sees it, or the session gone (ended).
                wait_for(lambda: (idle := idle_for(pid)) is None or idle > 2.5 * store.bounds.call,
                         timeout=15, message="the transaction never showed as idle")

        if read:
            stalled()
        else:
            with pytest.raises(StoreUnavailable, match="idle-in-transaction"):
                stalled()
    finally:
        watcher.dispose()
        store.engine.dispose()
        owner.drop_schema()
        owner.engine.dispose()


@pytest.mark.parametrize("call", [1.0, 900.0])
def test_a_reads_idle_bound_on_the_server_is_never_shorter_than_a_writes(postgres_url, call):
    # A lease of an hour gives a call bound past the long bound: a read must not be ended sooner.
    owner = Store(postgres_url, unique_prefix())
    owner.migrate()
    store = Store(postgres_url, owner.prefix, call_timeout=call)
    try:
        def idle_limit(read: bool) -> float:
            with store.begin(read=read) as c:  # pg_settings gives the value in its unit, ms
                return int(c.execute(sa.text("SELECT setting FROM pg_settings "
                                             "WHERE name = 'idle_in_transaction_session_timeout'")
                                     ).scalar_one()) / 1000

        seconds = {read: idle_limit(read) for read in (True, False)}
        assert seconds[False] == pytest.approx(store.bounds.call, rel=0.01)
        assert seconds[True] >= seconds[False] and seconds[True] >= 300.0, seconds
    finally:
        store.engine.dispose()
        owner.drop_schema()
        owner.engine.dispose()


def _claims(store: Store, job_id: str) -> bool:
    try:
        return claim(store, job_id, secrets.token_hex(16))
    except StoreUnavailable:
        return False  # still blocked by the row lock: its own bound ended the wait


def test_postgresql_timeouts_are_set_per_transaction_not_per_session(postgres_url):
    store = Store(postgres_url, unique_prefix(), call_timeout=10.0)
    try:
        with store.begin() as c:
            short = c.execute(sa.text("SELECT current_setting('statement_timeout'), "
                                      "current_setting('lock_timeout')")).one()
        with store.begin(long=True) as c:
            long = c.execute(sa.text("SELECT current_setting('statement_timeout')")).scalar_one()
        with store.engine.connect() as c:  # the same pooled session, outside a store transaction
            session = c.execute(sa.text("SELECT current_setting('statement_timeout')")).scalar_one()
    finally:
        store.engine.dispose()
    assert tuple(short) == ("4s", "2500ms")
    assert long == "2min"  # 0.4 of the long bound (300 s)
    assert session == "0"


def test_a_long_postgresql_transaction_waits_with_the_long_bound_from_its_first_round_trip(postgres_url):
    store = Store(postgres_url, unique_prefix(), call_timeout=2.0)
    waits: list[tuple[str, float]] = []

    def record_wait(conn, _cursor, statement, *_args):
        waits.append((statement, conn.connection.driver_connection.call_timeout))

    sa.event.listen(store.engine, "before_cursor_execute", record_wait)
    try:
        with store.begin(long=True) as c:
            c.execute(sa.text("SELECT 1"))
        with store.begin() as c:
            c.execute(sa.text("SELECT 1"))
    finally:
        store.engine.dispose()
    assert "set_config" in waits[0][0] and "set_config" in waits[2][0]
    # The long transaction's BEGIN and settings wait as long as its statements; a short one's do not.
    assert [bound for _, bound in waits] == [store.long_bounds.round_trip] * 2 + [store.bounds.round_trip] * 2


def test_a_hung_postgresql_server_fails_each_call_within_its_bound(postgres_url):
    # A frozen proxy: the kernel acknowledges every byte, the server never sees one.
    target = sa.make_url(postgres_url)
    proxy = TcpProxy(target.host or "127.0.0.1", target.port or 5432).start()
    prefix = unique_prefix()
    direct = Store(postgres_url, prefix)
    direct.migrate()
    store = Store(target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
                  prefix, call_timeout=4.0)
    try:
        direct.publishes.record("hung", "t.task", "q", "{}", 3)
        token = secrets.token_hex(16)
        assert claim(store, "hung", token)  # warm: the pool holds a working connection
        proxy.freeze()
        calls = {"now": store.now, "complete": lambda: store.jobs.complete("hung", token),
                 "claim": lambda: claim(store, "other", secrets.token_hex(16))}
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="unreachable"):
                call()
            elapsed = time.monotonic() - started
            assert elapsed < store.bounds.call + SLACK, (name, elapsed)
    finally:
        proxy.cut()
        store.engine.dispose()
        direct.t.metadata.drop_all(direct.engine)
        direct.engine.dispose()


def test_an_idle_connection_whose_check_gets_no_answer_fails_the_call_without_reconnecting(
        postgres_url, monkeypatch):
    # Every checkout checks its connection; the server then hangs behind a frozen proxy.
    monkeypatch.setattr(dialect, "IDLE_PING_AFTER", 0.0)
    target = sa.make_url(postgres_url)
    proxy = TcpProxy(target.host or "127.0.0.1", target.port or 5432).start()
    store = Store(target.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
                  unique_prefix(), call_timeout=4.0)
    try:
        store.now()  # warm: the pool holds a working connection
        opened = proxy.accepted
        proxy.freeze()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer from the server"):
            store.now()
        elapsed = time.monotonic() - started
        # The check waited out one round trip and the call ended there: no new connection tried.
        assert proxy.accepted == opened
        assert elapsed < store.bounds.round_trip + SLACK, elapsed
    finally:
        proxy.cut()
        store.engine.dispose()


class _Driver(Exception):
    def __init__(self, *args, sqlstate=None):
        super().__init__(*args)
        self.sqlstate = sqlstate


class _Wrapped(Exception):
    def __init__(self, orig):
        super().__init__(str(orig))
        self.orig = orig


def test_only_a_deadlock_the_server_broke_is_worth_running_again():
    mysql = dialects.for_url("mysql+pymysql://root@127.0.0.1/test")
    postgres = dialects.for_url("postgresql+psycopg://postgres@127.0.0.1/test")
    sqlite = dialects.for_url("sqlite://")

    assert mysql.retryable(_Wrapped(_Driver(1213, "Deadlock found")))
    assert not mysql.retryable(_Wrapped(_Driver(1205, "Lock wait timeout exceeded")))
    assert postgres.retryable(_Wrapped(_Driver("deadlock detected", sqlstate="40P01")))
    assert not postgres.retryable(_Wrapped(_Driver("lock timeout", sqlstate="55P03")))
    assert not sqlite.retryable(_Wrapped(_Driver("database is locked")))
    assert not mysql.retryable(None)


def test_a_store_calls_bounds_split_its_bound_and_cap_a_write_lock_wait_at_the_busy_timeout():
    bounds = dialects.for_url("sqlite:///x.db", busy_timeout=2.0).bounds(10.0)
    assert (bounds.pool, bounds.connect, bounds.round_trip, bounds.server_statement, bounds.server_lock) == (
        2.5, 2.5, 5.0, 4.0, 2.5)
    assert bounds.lock_wait == 2.0  # the busy timeout, shorter than a round trip
    assert dialects.for_url("sqlite:///x.db", busy_timeout=30.0).bounds(10.0).lock_wait == 5.0
    store = Store("sqlite:///x.db", busy_timeout=1.5, call_timeout=4.0)
    assert (store.bounds.lock_wait, store.long_bounds.lock_wait) == (1.5, 1.5)
