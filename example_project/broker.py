"""The demo's embedded broker: kombu's SQLAlchemy transport on a SQLite file.

kombu 5.7's transport passes every transport option to ``create_engine``, so the
``polling_interval`` that kombu's own virtual transport reads cannot be set (create_engine
rejects it); this subclass builds the engine from the URL alone. Several processes
share the file, so it runs in WAL mode with a busy timeout, and without a connection
pool so that no SQLite connection crosses the prefork worker's fork. Two workers
starting together may both create a queue's row; kombu only expects OperationalError
there, so the loser's IntegrityError is caught here and the row read again.

Select it with ``broker_transport = "example_project.broker:Transport"`` and a plain
``sqlite:///path`` broker URL (``sqla+`` URLs always pick kombu's class).
"""

from __future__ import annotations

from typing import Any, ClassVar

import sqlalchemy as sa
from kombu.transport import sqlalchemy as kombu_sqla

__all__ = ["Transport", "BUSY_TIMEOUT"]

BUSY_TIMEOUT = 30.0  # seconds a writer waits for the file lock


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


class Channel(kombu_sqla.Channel):
    """kombu's channel with an engine that accepts kombu's own transport options."""

    _engines: ClassVar[dict[str, Any]] = {}

    def _engine_from_config(self) -> sa.Engine:
        engine = sa.create_engine(self.connection.client.hostname, poolclass=sa.NullPool,
                                  connect_args={"timeout": BUSY_TIMEOUT})
        sa.event.listen(engine, "connect", _on_connect)
        return engine

    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)
        except sa.exc.IntegrityError:
            self.session.rollback()
            return super()._get_or_create(queue)


class Transport(kombu_sqla.Transport):
    """kombu's SQLAlchemy transport, configured for several processes on one SQLite file."""

    Channel = Channel
