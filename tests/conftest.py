"""Fixtures for real services: skip locally with a reason that names the service, fail in CI.

Set ``CELERY_LEASE_REQUIRE_SERVICES=1`` (``.ci/run`` does) to turn every skip for a
missing service into a failure. Service URLs come from the environment:

    CELERY_LEASE_TEST_POSTGRES   postgresql+psycopg://postgres@127.0.0.1:5432/test
    CELERY_LEASE_TEST_MYSQL      mysql+pymysql://root@127.0.0.1:3306/test
    CELERY_LEASE_TEST_REDIS      redis://127.0.0.1:6379/0
    CELERY_LEASE_TEST_AMQP       amqp://guest:guest@127.0.0.1:5672//

SQS is moto's server (``moto[server]``, a library of the test extra): ``sqs_url`` starts one
of its own on a free local port for the session.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.helpers import poll

DEFAULT_URLS = {
    "postgres": ("CELERY_LEASE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mysql": ("CELERY_LEASE_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test"),
    "redis": ("CELERY_LEASE_TEST_REDIS", "redis://127.0.0.1:6379/0"),
    "amqp": ("CELERY_LEASE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//"),
}
CONNECT_TIMEOUT = 3  # seconds
# CELERY_LEASE_TEST_STORES narrows the store-parametrized tests (tox's py311-<store> envs).
STORES = os.environ.get("CELERY_LEASE_TEST_STORES", "sqlite,postgres,mysql").split(",")
# The operator scenes (CLI, metrics, web page, exporter) run on the embedded store and PostgreSQL,
# as far as CELERY_LEASE_TEST_STORES names them; on SQLite when it names neither.
SCENE_STORES = [kind for kind in ("sqlite", "postgres") if kind in STORES] or ["sqlite"]


def service_url(name: str) -> str:
    env, default = DEFAULT_URLS[name]
    return os.environ.get(env, default)


def _safe(url: str) -> str:
    """The URL without its password, for skip and failure messages."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)


def _probe(url: str) -> None:
    """Connect to the service behind ``url`` once, with a short timeout; raise on failure."""
    scheme = urlsplit(url).scheme
    if scheme.startswith("redis"):
        import redis

        client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
        )
        try:
            client.ping()
        finally:
            client.close()
    elif scheme.startswith(("amqp", "pyamqp")):
        import kombu

        with kombu.Connection(url, connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=CONNECT_TIMEOUT)
    else:
        import sqlalchemy as sa

        engine = sa.create_engine(
            url, connect_args={"connect_timeout": CONNECT_TIMEOUT}, poolclass=sa.NullPool
        )
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        finally:
            engine.dispose()


def require_service(name: str, url: str) -> str:
    """Return ``url`` if the service answers; otherwise skip (locally) or fail (in CI)."""
    try:
        _probe(url)
    except Exception as exc:  # noqa: BLE001 - any connection problem means "not reachable"
        detail = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{name} not reachable at {_safe(url)}: {type(exc).__name__}: {detail}"
        if os.environ.get("CELERY_LEASE_REQUIRE_SERVICES"):
            pytest.fail(f"{reason} (CELERY_LEASE_REQUIRE_SERVICES is set)", pytrace=False)
        pytest.skip(reason)
    return url


# -- one fixture per real service ------------------------------------------------
@pytest.fixture(scope="session")
def postgres_url() -> str:
    return require_service("PostgreSQL", service_url("postgres"))


@pytest.fixture(scope="session")
def mysql_url() -> str:
    return require_service("MySQL/MariaDB", service_url("mysql"))


@pytest.fixture(scope="session")
def redis_url() -> str:
    return require_service("Redis", service_url("redis"))


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return require_service("RabbitMQ", service_url("amqp"))


# -- the real-worker environments (their modules import this one, hence the late imports) ---
@pytest.fixture
def renv(redis_url, postgres_url):
    """A reaper test's app, store and queue (tests/reaper_env.py), torn down after the test."""
    from tests.reaper_env import ReaperEnv

    env = ReaperEnv(redis_url, postgres_url)
    yield env
    env.close()


@pytest.fixture
def oenv(redis_url, postgres_url):
    """An owner test's app, store and queue (tests/owner_env.py), torn down after the test."""
    from tests.owner_env import OwnerEnv

    env = OwnerEnv(redis_url, postgres_url)
    yield env
    env.close()


# kombu's SQS transport takes its endpoint from the broker URL's host and port; these
# options make it speak plain HTTP to moto in moto's default region.
SQS_TRANSPORT_OPTIONS = {"region": "us-east-1", "is_secure": False}
SQS_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret",
                   "AWS_DEFAULT_REGION": "us-east-1"}
SQS_START_TIMEOUT = 30  # seconds for moto's server to answer


def _missing(name: str, reason: str) -> None:
    if os.environ.get("CELERY_LEASE_REQUIRE_SERVICES"):
        pytest.fail(f"{name}: {reason} (CELERY_LEASE_REQUIRE_SERVICES is set)", pytrace=False)
    pytest.skip(f"{name}: {reason}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def sqs_url() -> Iterator[str]:
    """``sqs://AKID:secret@127.0.0.1:P``: moto's SQS server, started here and stopped at the end.

    Use it with ``SQS_TRANSPORT_OPTIONS``. Dummy ``AWS_*`` credentials are set in this process's
    environment (and so in the workers it spawns) for the session.
    """
    wanted = ("moto.server", "boto3", "pycurl")
    absent = [name for name in wanted if importlib.util.find_spec(name.split(".")[0]) is None]
    if absent:
        _missing("SQS (moto's server)", f"{', '.join(absent)} not installed: pip install -e '.[test]'")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    saved = {key: os.environ.get(key) for key in SQS_CREDENTIALS}
    os.environ.update(SQS_CREDENTIALS)
    try:
        def state() -> str | None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return "up"
            except OSError:
                return "exited" if proc.poll() is not None else None

        if poll(state, SQS_START_TIMEOUT, 0.1) != "up":
            _missing("SQS (moto's server)", f"did not answer on 127.0.0.1:{port} "
                     f"within {SQS_START_TIMEOUT}s (exit code {proc.poll()})")
        yield f"sqs://AKID:secret@127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'lease.sqlite3'}"



# -- lease stores -------------------------------------------------------------------
def unique_prefix() -> str:
    """A table prefix no other test uses: 't' + 8 hex characters + '_'."""
    return f"t{uuid.uuid4().hex[:8]}_"


@pytest.fixture(params=STORES, ids=STORES)
def store_url(request) -> str:
    """The URL of each lease store kind: SQLite file, PostgreSQL, MySQL/MariaDB."""
    return request.getfixturevalue(f"{request.param}_url")


# Migrated schemas on a database server, by URL: creating one costs a few hundred DDL
# milliseconds, so a test that leaves its schema at the newest revision hands it, emptied,
# to the next test (SQLite files are per test and stay per test).
_SCHEMAS: dict[str, list[str]] = {}


@pytest.fixture(autouse=True)
def _stop_runtimes_after_each_test() -> Iterator[None]:
    """Stop this process's lease runtimes after each test; the next use makes a new one.

    A worker embedded in the test process (Celery's ``start_worker``) ends with a cold stop,
    which sends no ``worker_shutdown``: its app's runtime would keep its heartbeat and
    deadline threads beating in this process for the rest of the run, and dozens of them
    slowed later modules threefold.
    """
    yield
    from celery_lease.worker import runtime

    with runtime.PROCESS.lock:
        stopped = [rt for _, rt in runtime.PROCESS.runtimes.values()]
        runtime.PROCESS.runtimes.clear()
    for rt in stopped:
        rt.stop(timeout=2.0)


@pytest.fixture(scope="session", autouse=True)
def _drop_pooled_schemas() -> Iterator[None]:
    yield
    from celery_lease.store import Store

    for url, prefixes in _SCHEMAS.items():
        for prefix in prefixes:
            store = Store(url, prefix=prefix)
            try:
                store.drop_schema()
            finally:
                store.engine.dispose()


def _reusable(store) -> bool:
    """Empty the store's rows and say whether its schema is still the newest revision's."""
    from celery_lease.store import migrations

    try:
        with store.begin(long=True) as c:
            if migrations.current(c, store.prefix) != migrations.head():
                return False
            for table in reversed(store.t.metadata.sorted_tables):
                c.execute(table.delete())
    except Exception:  # noqa: BLE001 - a schema a test broke is dropped instead
        return False
    return True


@pytest.fixture
def store_factory(store_url) -> Iterator[Callable[..., object]]:
    """Build Stores on ``store_url`` with unique prefixes; drop their tables afterwards.

    A plain migrated store on a server reuses an emptied schema a previous test left at the
    newest revision (see ``_SCHEMAS``).
    """
    from celery_lease.store import Store

    made: list[tuple[Store, bool]] = []
    pool = _SCHEMAS.setdefault(store_url, []) if not store_url.startswith("sqlite") else None

    def make(prefix: str | None = None, migrate: bool = True, reuse: bool = True) -> Store:
        """``reuse=False`` for a test that alters the schema behind the version table's back."""
        if prefix is None and migrate and reuse and pool:
            store = Store(store_url, prefix=pool.pop())
            made.append((store, True))
            return store
        store = Store(store_url, prefix=prefix or unique_prefix())
        made.append((store, reuse))
        if migrate:
            store.migrate()
        return store

    yield make
    for store, reuse in made:
        try:
            if pool is not None and reuse and _reusable(store):
                pool.append(store.prefix)
            else:
                store.drop_schema()
        finally:
            store.engine.dispose()


def migrated_store(app):
    """The app's lease store with its schema created, as a worker start or `lease migrate` would.

    Publishing never creates tables, so a test that publishes before any worker starts
    creates them first, like a deployment that runs `celery lease migrate`.
    """
    from celery_lease.store import for_app

    store = for_app(app, check=False)
    store.migrate()
    return store


def drop_app_store(app) -> None:
    """Drop the app's lease store tables (any revision) and close its engine."""
    from celery_lease.store import for_app

    store = for_app(app, check=False)
    try:
        store.drop_schema()
    finally:
        store.engine.dispose()


def drop_store_tables(engine, prefix: str) -> None:
    """Drop every table under ``prefix`` (any revision's, and the version table)."""
    import sqlalchemy as sa

    metadata = sa.MetaData()
    metadata.reflect(engine, only=lambda name, _: name.startswith(prefix))
    metadata.drop_all(engine)


@pytest.fixture
def store(store_factory):
    """A migrated Store with tables of its own on each store kind (sqlite, postgres, mysql)."""
    return store_factory()


@contextlib.contextmanager
def flushed_redis(redis_url: str, db: int) -> Iterator[tuple[str, object]]:
    """A Redis URL on database ``db`` and a client, the database flushed before and after."""
    import redis

    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}"))
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url, client
    finally:
        client.flushdb()
        client.close()


@contextlib.contextmanager
def prefixed_redis(redis_url: str, db: int) -> Iterator[tuple[str, object, str]]:
    """A Redis URL on database ``db``, a client and a key prefix of one test's own, removed after.

    For tests that run beside others on a shared database (kombu's ``global_keyprefix``).
    """
    import redis

    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}"))
    client, prefix = redis.Redis.from_url(url), f"{unique_prefix()}:"
    try:
        yield url, client, prefix
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()


# -- a server without autovacuum ------------------------------------------------------
VACUUM_EVERY = 250  # tests between two catalog vacuums


def pytest_runtest_teardown(item, nextitem) -> None:
    """Vacuum the PostgreSQL test database's catalogs every VACUUM_EVERY tests when the server
    runs without autovacuum.

    The suite creates and drops thousands of tables; their dead catalog rows slow every
    statement until the sub-second call bounds of the tests fail (.ci/run vacuums between its
    steps for the same reason). Nothing happens on a server that vacuums itself or is absent.
    """
    count = item.session.config.stash.get(_VACUUM_COUNT, 0) + 1
    item.session.config.stash[_VACUUM_COUNT] = count
    if count % VACUUM_EVERY:
        return
    try:
        import psycopg

        url = service_url("postgres").replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
            if conn.execute("SHOW autovacuum").fetchone()[0] == "off":
                conn.execute("VACUUM (ANALYZE) pg_catalog.pg_attribute, pg_catalog.pg_class, "
                             "pg_catalog.pg_depend, pg_catalog.pg_type, pg_catalog.pg_index")
    except Exception:  # noqa: BLE001 - housekeeping only: a missing server is the fixtures' to report
        return


_VACUUM_COUNT = pytest.StashKey[int]()

