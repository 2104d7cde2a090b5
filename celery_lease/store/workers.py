"""The worker registry: which worker processes are alive."""

from __future__ import annotations

from typing import Any

from .base import StoreBase

__all__ = ["WorkerStatements"]


class WorkerStatements(StoreBase):
    """One row per worker process, refreshed by its heartbeat; the reaper reads liveness here."""

    def _seen(self, worker_id: str, hostname: str, pid: int) -> Any:
        """Register a worker process, or refresh its last_seen_at: one upsert."""
        values = dict(worker_id=worker_id, hostname=hostname, pid=pid, started_at=self.now_sql,
                      last_seen_at=self.now_sql)
        return self.dialect.upsert(self.t.workers, values, update=("last_seen_at",))

    def touch_worker(self, worker_id: str, hostname: str, pid: int) -> None:
        """Register a worker process, or refresh its last_seen_at."""
        with self.begin() as c:
            c.execute(self._seen(worker_id, hostname, pid))
