"""The worker's reads of its deliveries' jobs: the consumer's glance and the broker's lease check."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sqlalchemy as sa

from ..vocabulary import Status
from .base import StoreEngine
from .rows import RUNNING, fenced_status

__all__ = ["Glance", "DeliveryStatements"]


@dataclasses.dataclass(frozen=True)
class Glance:
    """What one read of a job's row says: status, owner, a live lease, a kept result."""

    status: Status
    locked_by: str | None
    lease_live: bool
    result_kept: bool


class DeliveryStatements:
    """The worker's reads of deliveries' jobs (primary-key lookups, no lock, no write)."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def _glance_statement(self) -> sa.Select:
        j = self.db.t.jobs
        return (sa.select(j.c.status, j.c.locked_by,
                          sa.func.coalesce(j.c.lease_expires_at > self.db.now_sql, sa.false()).label("live"),
                          j.c.result.is_not(None).label("kept"))
                .where(j.c.id == sa.bindparam("job_id")))

    def glance(self, job_id: str) -> Glance | None:
        """The job's status, owner, live lease and kept result; None when the store has no row."""
        with self.db.begin(read=True) as c:
            row = c.execute(self._glance_statement(), {"job_id": job_id}).first()
        if row is None:
            return None
        return Glance(Status(row.status), row.locked_by, bool(row.live), bool(row.kept))

    def leases_alive(self, job_ids: Sequence[str]) -> dict[str, str | None]:
        """Owner of each given job that is running with an unexpired lease (store's clock)."""
        if not job_ids:
            return {}
        j = self.db.t.jobs
        # The lease-call bound, not the operators' one: a round waiting minutes here would let a short
        # broker visibility timeout hand the messages of running jobs out again.
        with self.db.begin(read=True) as c:
            rows = c.execute(sa.select(j.c.id, j.c.locked_by).where(
                j.c.id.in_(list(job_ids)), fenced_status(j.c.status, RUNNING),
                j.c.lease_expires_at > self.db.now_sql,
            )).all()
        return {r[0]: r[1] for r in rows}
