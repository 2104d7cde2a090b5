"""The shop's own tables: invoices and reports, in the lease store's database.

Sharing the database lets ``self.lease.effect(key, connection=conn)`` write the effect key
in the same transaction as the invoice: both commit, or neither. Each table also has a
unique business key, the guard a careful app keeps whatever its task queue does.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import sqlalchemy as sa

from .settings import TABLE_PREFIX, lease_store_url

__all__ = ["engine", "invoices", "reports", "issued", "migrate"]

BUSY_TIMEOUT = 30.0  # seconds a SQLite writer waits for the file lock

metadata = sa.MetaData()
invoices = sa.Table(
    f"{TABLE_PREFIX}invoices", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.String(64), nullable=False, unique=True),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("job_id", sa.String(255), nullable=False),
)
reports = sa.Table(
    f"{TABLE_PREFIX}reports", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("report_id", sa.String(64), nullable=False, unique=True),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("job_id", sa.String(255), nullable=False),
)

_engines: dict[int, sa.Engine] = {}
_lock = threading.Lock()


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Same discipline as the lease store: WAL, a busy timeout, and BEGIN IMMEDIATE so two
    # readers never deadlock upgrading to writers.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
    cur.close()


def engine() -> sa.Engine:
    """This process's engine for the shop's database (a forked worker builds its own)."""
    pid = os.getpid()
    if pid not in _engines:
        with _lock:
            if pid not in _engines:
                url = sa.engine.make_url(lease_store_url)
                if url.get_backend_name() == "sqlite":
                    made = sa.create_engine(url, connect_args={"timeout": BUSY_TIMEOUT})
                    sa.event.listen(made, "connect", _sqlite_on_connect)
                    sa.event.listen(made, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
                else:
                    made = sa.create_engine(url, pool_pre_ping=True)
                _engines[pid] = made
    return _engines[pid]


def migrate() -> None:
    """Create the shop's tables if they are missing (two workers starting together may race)."""
    try:
        metadata.create_all(engine())
    except (sa.exc.ProgrammingError, sa.exc.IntegrityError, sa.exc.OperationalError):
        metadata.create_all(engine())  # the other process created them; this pass finds them


def issued() -> dict[str, int]:
    """Rows per table: how many invoices and reports the shop holds."""
    with engine().connect() as conn:
        return {
            "invoices": conn.execute(sa.select(sa.func.count()).select_from(invoices)).scalar_one(),
            "reports": conn.execute(sa.select(sa.func.count()).select_from(reports)).scalar_one(),
        }
