"""A deadline on every wait of a psycopg connection for the server's answer.

libpq has no read timeout, and neither keepalives, ``tcp_user_timeout`` nor a server-side timeout end a wait
on a hung server or a black-holed path. A wait past the deadline closes the connection (its protocol state is
unknown), so the pool drops it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

__all__ = ["install", "waiting"]

_classes: dict[type[Any], type[Any]] = {}


def _bounded(base: type[Any]) -> type[Any]:
    """A subclass of psycopg's Connection whose waits end after ``call_timeout`` seconds."""
    if base not in _classes:
        import psycopg

        timeout_error = getattr(psycopg.errors, "_WaitTimeout", psycopg.errors.OperationalError)

        class BoundedConnection(base):
            call_timeout: float | None = None
            timed_out = False  # a wait ran out: the connection is closed, its server silent

            def wait(self, gen: Any, interval: Any = None, timeout: float | None = None) -> Any:
                args = () if interval is None else (interval,)
                if timeout is not None or self.call_timeout is None:
                    return super().wait(gen, *args, timeout=timeout)
                try:
                    return super().wait(gen, *args, timeout=self.call_timeout)
                except timeout_error:
                    self.timed_out = True
                    self.pgconn.finish()
                    raise psycopg.OperationalError(
                        f"no answer from the server within {self.call_timeout:g}s; connection closed"
                    ) from None

        _classes[base] = BoundedConnection
    return _classes[base]


def install(engine: Engine, seconds: float) -> None:
    """Make every psycopg connection of ``engine`` wait at most ``seconds`` per round trip."""

    def connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        conn = _bounded(dialect.loaded_dbapi.Connection).connect(*cargs, **cparams)
        conn.call_timeout = seconds
        return conn

    sa.event.listen(engine, "do_connect", connect)


@contextlib.contextmanager
def waiting(conn: Connection, seconds: float | None) -> Iterator[None]:
    """Let the waits of ``conn``'s driver connection last ``seconds`` (None: leave them) for a while."""
    driver: Any = conn.connection.driver_connection  # psycopg's, or another driver's
    saved = getattr(driver, "call_timeout", None)
    if seconds is None or saved is None:
        yield
        return
    driver.call_timeout = seconds
    try:
        yield
    finally:
        driver.call_timeout = saved
