"""Small SQLite files that several worker processes write to: WAL, a busy timeout, autocommit."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

__all__ = ["connect"]

BUSY_TIMEOUT = 30.0  # seconds
_created: set[tuple[Path, str]] = set()


@contextlib.contextmanager
def connect(path: Path, schema: str = "") -> Iterator[sqlite3.Connection]:
    """Open ``path`` in autocommit mode (each statement commits), creating ``schema`` once per process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
        if schema and (path, schema) not in _created:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(schema)
            _created.add((path, schema))
        yield conn
    finally:
        conn.close()
