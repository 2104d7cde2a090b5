"""The one read a worker's consumer makes of a delivery before Celery announces it.

``glance`` finds the job by its primary key and answers only what tells a sure duplicate
from a delivery the task must see: the status, the owner, whether its lease is live on the
store's clock and whether a completed job kept its result. strategy.py decides with it.
"""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa

from ..vocabulary import Status
from .base import RESULT_REVISION, StoreBase

__all__ = ["Glance", "GlanceStatements"]


@dataclasses.dataclass(frozen=True)
class Glance:
    """What one read of a job's row says: status, owner, a live lease, a kept result."""

    status: Status
    locked_by: str | None
    lease_live: bool
    result_kept: bool


class GlanceStatements(StoreBase):
    """The consumer's read of a delivery's job (one primary-key lookup, no lock, no write)."""

    def _glance_statement(self, kept: bool) -> sa.Select:
        j = self.t.jobs
        result = j.c.result.is_not(None) if kept else sa.false()
        return (sa.select(j.c.status, j.c.locked_by,
                          sa.func.coalesce(j.c.lease_expires_at > self.now_sql, sa.false()).label("live"),
                          result.label("kept"))
                .where(j.c.id == sa.bindparam("job_id")))

    def glance(self, job_id: str) -> Glance | None:
        """The job's status, owner, live lease and kept result; None when the store has no row."""
        kept = self.at_least(RESULT_REVISION)
        with self.begin(read=True) as c:
            row = c.execute(self._glance_statement(kept), {"job_id": job_id}).first()
        if row is None:
            return None
        return Glance(Status(row.status), row.locked_by, bool(row.live), bool(row.kept))
