"""Statements of ``Task.replace()``: a leased job passes its id to its replacement (the carrier).

Each statement is fenced on the replaced run's token and audited in the same transaction."""

from __future__ import annotations

import sqlalchemy as sa

from ..errors import StoreConflict
from ..vocabulary import Event
from .attempts import previous_attempt
from .base import StoreEngine
from .jobs import JobStatements
from .publishes import PublishStatements, _record_params
from .rows import COMPLETED, PENDING, NewJob

__all__ = ["ReplaceStatements"]


class ReplaceStatements:
    """The three ways a replaced job's lease ends: claimed by its carrier, recorded by it, or over."""

    def __init__(self, db: StoreEngine, jobs: JobStatements, publishes: PublishStatements) -> None:
        self.db = db
        self.jobs = jobs
        self.publishes = publishes

    def hand_over(self, job_id: str, token: str, worker: str | None, payload: str | None,
                  carrier: str, nesting: int = 0) -> bool:
        """running -> pending, available now, with the carrier's message; the attempt is given back.
        With ``payload`` None (a chain's last step carries it later) the row is removed, so the dispatch scan
        never re-sends a step before the steps in front of it ran."""
        j = self.db.t.jobs
        fence = self.db._fenced(job_id, token)
        with self.db.begin() as c:
            previous = previous_attempt(self.db, c, fence) or {}  # the attempt that hands over
            if payload is None:
                res = c.execute(sa.delete(j).where(fence))
                detail = {"carrier": carrier, "row": "recorded again when the carrier is published"}
            else:
                res = c.execute(sa.update(j).where(fence).values(
                    status=PENDING, available_at=self.db.now_sql, payload=payload, lease_expires_at=None,
                    lock_token=None, locked_by=None, updated_at=self.db.now_sql,
                    attempt_count=sa.case((j.c.attempt_count > 0, j.c.attempt_count - 1), else_=0)))
                detail = {"carrier": carrier}
            if res.rowcount != 1:
                self.db._stale(c, job_id, Event.STALE_RELEASE_REJECTED, worker, token)
                return False
            self.db._event(c, job_id, Event.HANDED_OVER, f"replaced by {carrier}", worker, token,
                           {**detail, "nesting": nesting, **previous})
            return True

    def hand_over_to_step(self, job_id: str, token: str, worker: str | None, carrier: str,
                          step: NewJob, nesting: int = 0) -> bool | None:
        """The replaced row removed and the replacement's first step recorded in one transaction, so one
        of them is always in the store; False when the lease moved on, None when the step's id is taken."""
        j, e = self.db.t.jobs, self.db.t.events
        row, event = self.publishes._record_values(Event.PUBLISHED)
        params = _record_params(step)
        try:
            with self.db.begin() as c:
                previous = previous_attempt(self.db, c, self.db._fenced(job_id, token)) or {}
                res = c.execute(sa.delete(j).where(self.db._fenced(job_id, token)))
                if res.rowcount != 1:
                    self.db._stale(c, job_id, Event.STALE_RELEASE_REJECTED, worker, token)
                    return False
                c.execute(sa.insert(j).values(**row), params)
                c.execute(sa.insert(e).values(job_id=row["id"], **event), params)
                self.db._event(c, job_id, Event.HANDED_OVER, f"replaced by {carrier}", worker, token, {
                    "carrier": carrier, "row": "recorded again when the carrier is published",
                    "first_step": step.id, "nesting": nesting, **previous})
        except StoreConflict:
            return None
        return True

    def replaced(self, job_id: str, token: str, worker: str | None, carrier: str) -> bool:
        """running -> completed: the replacement that carries the id is not leased."""
        return self.jobs._owner_write(
            job_id, token, worker, Event.REPLACED, Event.STALE_COMPLETION_REJECTED, dict(
                status=COMPLETED, completed_at=self.db.now_sql, lease_expires_at=None, lock_token=None,
            ), reason=f"replaced by {carrier} (not leased)", detail={"carrier": carrier})
