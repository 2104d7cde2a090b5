"""The operator's moves on single jobs (requeue, redrive, discard, forget an effect key): each one
conditional write audited in its transaction; when a move is allowed is ops/recovery.py's rule."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..vocabulary import Event
from .attempts import previous_attempt
from .base import StoreEngine, where_given
from .rows import FAILED, PENDING, RUNNING, Job, fenced_status, status_sql

__all__ = ["RecoveryStatements", "REVOKED_PREFIX"]

REVOKED_PREFIX = "revoked ("  # JobStatements.cancel's last_error


class RecoveryStatements:
    """Manual recovery, with the store's long bound: an operator waits, no lease does."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def requeue_candidates(self, force: bool, limit: int) -> list[Job]:
        """Running jobs the reaper would take (expired past grace, owner gone or past the hard
        grace), oldest lease first; with ``force`` every running job whose lease has expired."""
        j = self.db.t.jobs
        cond = (sa.and_(j.c.status == status_sql(RUNNING), j.c.lease_expires_at < self.db.now_sql) if force
                else self.db._claimable_expired(scan=True))
        q = sa.select(*self.db._job_columns()).where(cond).order_by(j.c.lease_expires_at, j.c.id).limit(limit)
        with self.db.begin(long=True, read=True) as c:
            return [Job.from_row(r) for r in c.execute(q)]

    def is_claimable_expired(self, job_id: str) -> bool:
        """Whether the reaper would take this job's lease now (_claimable_expired)."""
        j = self.db.t.jobs
        q = sa.select(j.c.id).where(j.c.id == job_id, self.db._claimable_expired())
        with self.db.begin(long=True, read=True) as c:
            return c.execute(q).first() is not None

    def manual_requeue(self, job: Job, operator: str, force: bool = False,
                       reason: str = "manual requeue", *, expired: bool = False) -> bool:
        """running (CAS on the token; unless ``force`` only if expired and abandoned; with ``expired`` only
        while its lease is expired, which its owner's renewal since the plan undoes) or, with ``force``,
        pending (CAS on updated_at) -> pending, available now; audited manual_requeue."""
        j = self.db.t.jobs
        values: dict[str, Any] = dict(status=PENDING, available_at=self.db.now_sql,
                                      updated_at=self.db.now_sql, lock_token=None, locked_by=None,
                                      lease_expires_at=None, dispatch_count=j.c.dispatch_count + 1)
        if job.status == RUNNING and job.lock_token:
            where = [j.c.id == job.id, fenced_status(j.c.status, RUNNING), j.c.lock_token == job.lock_token]
            if not force:
                where.append(self.db._claimable_expired())
            elif expired:
                where.append(j.c.lease_expires_at < self.db.now_sql)
            values["expired_count"] = j.c.expired_count + 1
        elif job.status == PENDING and force:
            where = [j.c.id == job.id, fenced_status(j.c.status, PENDING), j.c.updated_at == job.updated_at]
        else:
            return False
        with self.db.begin(long=True) as c:
            previous = previous_attempt(self.db, c, *where)
            if previous is None or c.execute(sa.update(j).where(*where).values(**values)).rowcount != 1:
                return False
            self.db._event(c, job.id, Event.MANUAL_REQUEUE, reason, operator, job.lock_token, detail={
                "previous_status": job.status, "forced": force, **previous,
            })
        return True

    def dead_letters(self, task: str | None = None, limit: int = 50,
                     include_revoked: bool = True) -> list[Job]:
        """Failed jobs, oldest failure first."""
        j = self.db.t.jobs
        q = (sa.select(*self.db._job_columns()).where(j.c.status == status_sql(FAILED))
             .order_by(j.c.updated_at, j.c.id).limit(limit))
        q = where_given(q, (j.c.task_name, task))
        if not include_revoked:
            q = q.where(sa.or_(j.c.last_error.is_(None), ~j.c.last_error.startswith(REVOKED_PREFIX)))
        with self.db.begin(long=True, read=True) as c:
            return [Job.from_row(r) for r in c.execute(q)]

    def redrive(self, job: Job, operator: str) -> bool:
        """failed -> pending with fresh attempts (CAS on status and failed_at); audited
        dlq_redriven. The idempotency key stays with the job."""
        j = self.db.t.jobs
        same_failure = j.c.failed_at.is_(None) if job.failed_at is None else j.c.failed_at == job.failed_at
        with self.db.begin(long=True) as c:
            failed = fenced_status(j.c.status, FAILED)
            res = c.execute(sa.update(j).where(j.c.id == job.id, failed, same_failure).values(
                status=PENDING, available_at=self.db.now_sql, updated_at=self.db.now_sql, failed_at=None,
                attempt_count=0, expired_count=0, lock_token=None, locked_by=None, lease_expires_at=None,
                dispatch_count=j.c.dispatch_count + 1,
            ))
            if res.rowcount != 1:
                return False
            error = (job.last_error or "")[:200] or None
            self.db._event(c, job.id, Event.DLQ_REDRIVEN, error, operator, detail={
                "previous_attempts": job.attempt_count, "previous_expirations": job.expired_count,
                "queue": job.queue_name,
            })
        return True

    def discard_dead_letter(self, job: Job, operator: str) -> bool:
        """Delete a failed job's row (CAS on status and failed_at); audited dlq_discarded with its last
        error. Its events stay; its idempotency key keeps answering with this job until it is pruned."""
        j = self.db.t.jobs
        same_failure = j.c.failed_at.is_(None) if job.failed_at is None else j.c.failed_at == job.failed_at
        with self.db.begin(long=True) as c:
            failed = fenced_status(j.c.status, FAILED)
            res = c.execute(sa.delete(j).where(j.c.id == job.id, failed, same_failure))
            if res.rowcount != 1:
                return False
            error = (job.last_error or "")[:200] or None
            self.db._event(c, job.id, Event.DLQ_DISCARDED, error, operator, detail={
                "task": job.task_name, "queue": job.queue_name, "attempts": job.attempt_count,
                "idempotency_key": job.idempotency_key,
            })
        return True

    def forget_effect(self, key: str, reason: str = "released by an operator", *,
                      recorded: tuple[str, float] | None = None, live: bool = True) -> bool:
        """Delete an effect key (an operator's decision), audited. ``recorded``: only the record the
        operator was shown (its job and time); ``live`` False: not while its job holds a live lease (its
        worker may be inside the effect block), decided by the DELETE itself."""
        e, j = self.db.t.effects, self.db.t.jobs
        with self.db.begin() as c:
            job_id = c.execute(sa.select(e.c.job_id).where(e.c.key == key)).scalar()
            if job_id is None:
                return False
            where = [e.c.key == key, e.c.job_id == job_id]
            if recorded is not None:
                where += [e.c.job_id == recorded[0], e.c.at == recorded[1]]
            if not live:
                where.append(~sa.exists().where(j.c.id == job_id, fenced_status(j.c.status, RUNNING),
                                                ~self.db._claimable_expired()))
            res = c.execute(sa.delete(e).where(*where))
            if res.rowcount == 1:
                self.db._event(c, job_id, Event.EFFECT_FORGOTTEN, reason, detail={"key": key})
            return res.rowcount == 1
