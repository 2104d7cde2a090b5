"""The worker registry: which worker processes are alive."""

from __future__ import annotations

from typing import Any

from .base import StoreEngine

__all__ = ["WorkerStatements"]


class WorkerStatements:
    """One row per worker process, refreshed by its heartbeat; the reaper reads liveness here."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db
        #: The worker's (pool, concurrency), set at worker start and kept across the fork.
        self.worker_pool: tuple[str, int] | None = None

    def _seen(self, worker_id: str, hostname: str, pid: int) -> Any:
        """Register a worker process, or refresh its last_seen_at: one upsert."""
        values = dict(worker_id=worker_id, hostname=hostname, pid=pid, started_at=self.db.now_sql,
                      last_seen_at=self.db.now_sql)
        if self.worker_pool is not None:
            values.update(pool=self.worker_pool[0][:32], concurrency=self.worker_pool[1])
        return self.db.dialect.upsert(self.db.t.workers, values, update=("last_seen_at",))

    def touch_worker(self, worker_id: str, hostname: str, pid: int) -> None:
        with self.db.begin() as c:
            c.execute(self._seen(worker_id, hostname, pid))
