"""Helpers shared by the tests. Tests wait on something observable, never on a fixed sleep."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = ["client_store", "poll", "wait_for", "with_password"]

T = TypeVar("T")

#: An embedded worker's stop waits for its pending Redis BRPOP to come back empty: one second by
#: kombu's default, this long with ``broker_transport_options={"polling_interval": EMPTY_POLL}``.
EMPTY_POLL = 0.1


def poll(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """Call ``predicate`` every ``interval`` until it returns something truthy or ``timeout`` passes;
    the last value it returned (falsy when the deadline came first: the caller says what that means)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition not met",
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value.

    Raises AssertionError naming ``message``, the timeout and the last value seen
    when the deadline passes first.
    """
    value = poll(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"{message} (waited {timeout:g}s; last value: {value!r})")
    return value


def client_store(app):
    """Give this test process's own calls for ``app`` (its publishes, its reads) the default call bound.

    An app's store calls get a third of its shortest lease, which a test process descheduled on a
    loaded machine can outlast in setup and polling that are no part of what the test proves. The
    worker processes under test build their own store, with the app's bound; do not use this where
    a worker runs in the test's own process.
    """
    from celery_lease import config
    from celery_lease.app_state import app_state
    from celery_lease.store import Store

    default_bound = config.CALL_TIMEOUT_SHARE * config.BY_NAME["lease_duration"].default
    store = Store.from_config(config.app_config(app), call_timeout=default_bound)
    app_state(app).store = store
    return store


def with_password(url: str, password: str = "s3cret") -> tuple[str, str]:
    """``url`` with a password in it, and that password: the one it has, or ``password`` added.

    The test servers trust local connections, so an added password still connects; a page
    or a message that quoted the URL would show it.
    """
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    user = parts.username or "postgres"
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}"
                                            + (f":{parts.port}" if parts.port else ""))), password


@contextlib.contextmanager
def transaction_held(store, work: Callable = lambda conn: None) -> Iterator[None]:
    """Another thread opens a write transaction on ``store``, runs ``work(conn)`` in it and keeps it
    open for the block; it commits once the block ends."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.begin() as conn:
            work(conn)
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10), "the other thread never opened its transaction"
        yield
    finally:
        release.set()
        holder.join(10)


def text_result_column(store) -> None:
    """Migrate a MySQL/MariaDB store, then give its jobs' result column the 64 KB ``TEXT`` the schema had
    before revision 0007 (test-only DDL): a store that cannot keep a large return value."""
    store.migrate()
    with store.begin(long=True) as conn:
        conn.exec_driver_sql(f"ALTER TABLE {store.t.jobs.name} MODIFY result TEXT NULL")
