"""The worker registry: which worker processes are alive."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import mysql, postgresql, sqlite

from .base import StoreBase

__all__ = ["WorkerStatements"]

_UPSERT = {"postgresql": postgresql.insert, "sqlite": sqlite.insert, "mysql": mysql.insert,
           "mariadb": mysql.insert}


class WorkerStatements(StoreBase):
    """One row per worker process, refreshed by its heartbeat; the reaper reads liveness here."""

    def _seen(self, worker_id: str, hostname: str, pid: int) -> Any:
        """Register a worker process, or refresh its last_seen_at: one upsert."""
        w = self.t.workers
        insert = _UPSERT[self.dialect](w).values(worker_id=worker_id, hostname=hostname, pid=pid,
                                                 started_at=self.now_sql, last_seen_at=self.now_sql)
        if self.dialect in ("mysql", "mariadb"):
            return insert.on_duplicate_key_update(last_seen_at=insert.inserted.last_seen_at)
        return insert.on_conflict_do_update(index_elements=[w.c.worker_id],
                                            set_={"last_seen_at": insert.excluded.last_seen_at})

    def touch_worker(self, worker_id: str, hostname: str, pid: int) -> None:
        """Register a worker process, or refresh its last_seen_at."""
        with self.begin() as c:
            c.execute(self._seen(worker_id, hostname, pid))
