"""The store's clock: every lease computation uses the database's time.

Workers' clocks may disagree by seconds; the database's does not disagree with
itself. Times are stored as float seconds since the epoch (sub-second precision on
every dialect, and lease arithmetic is plain addition).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement

__all__ = ["now", "SUPPORTED_DIALECTS"]

SUPPORTED_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb")

# SQLite's julianday('now') carries milliseconds; the offset is the Julian day of
# 1970-01-01T00:00Z.
_EXPRESSIONS = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    # clock_timestamp(), not now(): a long transaction must not freeze time.
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "mysql": "CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)",
    "mariadb": "CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)",
}


def now(dialect: Dialect | str) -> ColumnElement[float]:
    """The current time on the store, in epoch seconds, as a SQL expression."""
    name = dialect if isinstance(dialect, str) else dialect.name
    try:
        text = _EXPRESSIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported lease store dialect {name!r}; use one of {SUPPORTED_DIALECTS}"
        ) from None
    return sa.literal_column(text, type_=sa.Double())
