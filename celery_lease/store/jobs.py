"""Statements of a job's life after its publish: claim, renew and the fenced owner writes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..config import RECOVERY
from ..errors import StoreConflict, StoreUnavailable
from ..vocabulary import ClaimOutcome, Event, LossReason
from .attempts import attempt_detail, previous_attempt, reclaim_pending
from .audited import AuditedWrites
from .base import StoreEngine
from .handovers import never_handed_over, replaced_by_step, replaced_copy, was_handed_over
from .reaping import ReaperStatements
from .rows import COMPLETED, FAILED, PENDING, RUNNING, Claim, ClaimTerms, Job, fenced_status, storable
from .workers import WorkerStatements

__all__ = ["JobStatements"]


def _not_ours(job: Job) -> Claim:
    """The claim of a finished job (done) or of one leased by another owner (busy)."""
    return Claim(ClaimOutcome.DONE if job.status in (COMPLETED, FAILED) else ClaimOutcome.BUSY, job)


class _Replaced:
    """_insert_first_seen's answer for a copy of a replaced run's message: the step carrying the job."""

    def __init__(self, step: str) -> None:
        self.step = step


class JobStatements:
    """Transitions of one job between pending, running, completed and failed."""

    def __init__(self, db: StoreEngine, audited: AuditedWrites, workers: WorkerStatements) -> None:
        self.db = db
        self.audited = audited
        self.workers = workers

    def _lease_values(self, worker: Any, token: Any, duration: Any, grace: Any,
                      count: bool = True) -> dict[str, Any]:
        """The columns of a new lease, from values or bind parameters (``count``: one more attempt)."""
        counted = {"attempt_count": self.db.t.jobs.c.attempt_count + 1} if count else {}
        return dict(
            status=RUNNING, locked_by=worker, lock_token=token, lease_duration=duration,
            grace_period=grace, started_at=self.db.now_sql, last_heartbeat_at=self.db.now_sql,
            lease_expires_at=self.db.now_sql + duration, updated_at=self.db.now_sql, **counted,
        )

    def _claim_pending_statement(self, async_commit: bool) -> sa.Update:
        """pending -> running, as a statement of bind parameters (built once per store)."""
        j = self.db.t.jobs
        duration: sa.BindParameter[float] = sa.bindparam("duration", type_=sa.Double())
        early: sa.BindParameter[float] = sa.bindparam("early", type_=sa.Double())
        # A first claim only (no attempt before, no hand-over): a re-claim records the attempt it follows.
        conditions = [j.c.id == sa.bindparam("job_id"), fenced_status(j.c.status, PENDING),
                      j.c.started_at.is_(None), j.c.available_at <= self.db.now_sql + early,
                      *([] if self.db.dialect.fence_locks_rows else [never_handed_over(self.db)]),
                      *self.db.dialect.autocommit_settings(self.db.bounds, async_commit)]
        grace: sa.BindParameter[float] = sa.bindparam("grace", type_=sa.Double())
        # The running code's recovery policy replaces the recorded one; NULL keeps it.
        recovery = {name: sa.func.coalesce(sa.bindparam(f"r_{name}", type_=j.c[name].type), j.c[name])
                    for name in RECOVERY}
        return sa.update(j).where(*conditions).values(
            **self._lease_values(sa.bindparam("worker"), sa.bindparam("token"), duration, grace), **recovery)

    def _complete_running(self, keep: bool = False) -> sa.Update:
        """running -> completed under the token (``keep``: with the result), of bind parameters."""
        j = self.db.t.jobs
        kept = {"result": sa.bindparam("result", type_=sa.Text())} if keep else {}
        return sa.update(j).where(
            j.c.id == sa.bindparam("job_id"), j.c.lock_token == sa.bindparam("token"),
            fenced_status(j.c.status, RUNNING),
            *self.db.dialect.autocommit_settings(self.db.bounds),
        ).values(status=COMPLETED, completed_at=self.db.now_sql, lease_expires_at=None, lock_token=None,
                 updated_at=self.db.now_sql, **kept)

    def claim(self, job_id: str, worker: str, token: str, terms: ClaimTerms, task_name: str,
              queue: str | None, payload: Callable[[], str | None]) -> Claim:
        """Take the job's lease: a pending job available within lease_clock_tolerance (the clocks differ),
        an abandoned running one (``terms.takeover``), or a job the store does not know, created as ours."""
        for _ in range(3):
            claimed = self._claim_pending(job_id, worker, token, terms)
            if claimed is not None:
                return Claim(ClaimOutcome.CLAIMED, claimed)
            with self.db.begin() as c:
                current = self._job(c, job_id)
                if current is not None and replaced_copy(self.db, c, current, terms):
                    # The row carries the replacement now: this run would replace the job a second time.
                    waiting = current if current.status == PENDING else None  # its message can go again
                    return Claim(ClaimOutcome.REPLACED, None, step=waiting)
                if current is not None and current.status == RUNNING and terms.takeover:
                    taken = self._take_over(c, current, worker, token, terms)
                    if taken is not None:
                        return Claim(ClaimOutcome.CLAIMED, taken)
                if current is not None and current.status == PENDING:
                    wait = current.available_at - float(c.execute(sa.select(self.db.now_sql)).scalar_one())
                    if wait > self.db.clock_tolerance:
                        return Claim(ClaimOutcome.EARLY, current, wait)
                    lease = self._lease_values(worker, token, terms.duration, terms.grace)
                    if reclaim_pending(self.db, c, job_id, worker, token, lease, terms.recovery,
                                       started=current.started_at is not None):
                        return Claim(ClaimOutcome.CLAIMED, self._job(c, job_id))
                    continue  # requeued between our two statements: claim it on the next pass
                if current is not None and not (current.status == RUNNING and terms.takeover):
                    return _not_ours(current)
            if current is not None:
                # The takeover lost. On PostgreSQL it may have waited on a reaper that was
                # requeueing this very job: read again, and claim it if it is pending now.
                current = self.db.get(job_id) or current
                if current.status == PENDING:
                    continue
                return _not_ours(current)
            created = self._insert_first_seen(job_id, worker, token, terms, task_name, queue, payload)
            if isinstance(created, _Replaced):
                return Claim(ClaimOutcome.REPLACED, None, step=self.db.get(created.step))
            if isinstance(created, Job):
                return Claim(ClaimOutcome.CLAIMED, created)
        raise StoreUnavailable(f"job {job_id}: claim kept racing with concurrent inserts", job_id=job_id)

    def _claim_pending(self, job_id: str, worker: str, token: str, terms: ClaimTerms) -> Job | None:
        """A first claim, pending -> running as ours: the new row or None (the row records the event)."""
        if self.db.dialect.fence_locks_rows and was_handed_over(self.db, job_id):
            return None
        stmt, key = self._first_claim()
        return self.audited._audited_row(
            stmt, job_id, Event.CLAIMED if self.db.audit_every_transition else None, worker=worker,
            token=token, key=key, params=self._first_claim_params(job_id, worker, token, terms))

    def _first_claim(self) -> tuple[Callable[[], sa.Update], str]:
        """The first claim's statement (built once per store, under the key returned)."""
        async_commit = self.db.claim_async_commit
        key = "claim_async" if async_commit else "claim"
        return (lambda: self._claim_pending_statement(async_commit)), key

    def _first_claim_params(self, job_id: str, worker: str, token: str, terms: ClaimTerms) -> dict[str, Any]:
        return {"job_id": job_id, "worker": worker, "token": token, "duration": terms.duration,
                "grace": terms.grace, "early": self.db.clock_tolerance,
                **{f"r_{name}": (terms.recovery or {}).get(name) for name in RECOVERY}}

    def _take_over(self, c: Connection, current: Job, worker: str, token: str,
                   terms: ClaimTerms) -> Job | None:
        """An abandoned running lease -> ours (CAS on the token seen), audited ``lease_taken_over``."""
        j = self.db.t.jobs
        if self._held(c, current, terms):
            return None
        res = c.execute(sa.update(j).where(
            j.c.id == current.id, j.c.lock_token == current.lock_token, self.db._claimable_expired(),
            j.c.attempt_count < j.c.max_attempts, j.c.expired_count < terms.max_expirations,
        ).values(expired_count=j.c.expired_count + 1,
                 **self._lease_values(worker, token, terms.duration, terms.grace)))
        if res.rowcount != 1:
            return None
        self.db._event(c, current.id, Event.LEASE_TAKEN_OVER, reason="lease expired past grace",
                       worker=worker, token=token,
                       detail=attempt_detail(current.locked_by, current.lock_token, current.started_at))
        return self._job(c, current.id)

    def _held(self, c: Connection, current: Job, terms: ClaimTerms) -> bool:
        """Whether the reaper's hold still covers the lease's owner (the store was away or its clock stepped,
        so every lease looks expired): until it had its lease and a heartbeat to renew, it may still run."""
        return ReaperStatements(self.db).holds(c, current.lease_duration or terms.duration, terms.heartbeat)

    def reclaim(self, job_id: str, lost_token: str, worker: str, token: str, terms: ClaimTerms) -> Job | None:
        """A running lease of ``worker``'s own claim whose answer it never got (committed after the call
        bound) -> a new token for it; the attempt that claim counted is this one."""
        j = self.db.t.jobs
        lease = self._lease_values(worker, token, terms.duration, terms.grace, count=False)
        where = [j.c.id == job_id, j.c.lock_token == lost_token, j.c.locked_by == worker,
                 fenced_status(j.c.status, RUNNING)]
        with self.db.begin() as c:
            previous = previous_attempt(self.db, c, *where)
            if previous is None or c.execute(sa.update(j).where(*where).values(**lease)).rowcount != 1:
                return None
            self.db._event(c, job_id, Event.CLAIM_TAKEN_BACK, reason="own claim whose answer was lost",
                           worker=worker, token=token, detail=previous)
            return self._job(c, job_id)

    def _insert_first_seen(self, job_id: str, worker: str, token: str, terms: ClaimTerms, task_name: str,
                           queue: str | None, payload: Callable[[], str | None]) -> Job | _Replaced | None:
        """A job published without celery_lease -> a running row of ours; None when another insert won.
        ``_Replaced`` when this is a copy of a replaced run's message whose chain carrier is not recorded yet:
        run, it would replace the job a second time."""
        j = self.db.t.jobs
        lease = self._lease_values(worker, token, terms.duration, terms.grace, count=False)
        try:
            with self.db.begin() as c:
                step = replaced_by_step(self.db, c, job_id, terms.nesting)
                if step is not None:
                    return _Replaced(step)
                c.execute(sa.insert(j).values(
                    id=job_id, task_name=task_name, queue_name=queue, payload=payload(),
                    max_attempts=terms.max_attempts, expired_count=0, dispatch_count=0,
                    available_at=self.db.now_sql, created_at=self.db.now_sql, attempt_count=0,
                    **(terms.recovery or {}), **lease,
                ).values(attempt_count=1))
                self.db._event(c, job_id, Event.CLAIMED, reason="first seen by a worker",
                               worker=worker, token=token)
                return self._job(c, job_id)
        except StoreConflict:
            return None

    def _job(self, c: Connection, job_id: str) -> Job | None:
        row = c.execute(sa.select(*self.db._job_columns()).where(self.db.t.jobs.c.id == job_id)).first()
        return None if row is None else Job.from_row(row)

    def _owner_write(self, job_id: str, token: str, worker: str | None, event: Event, stale: Event,
                     values: Mapping[str, Any], reason: str | None = None, detail: Any = None) -> bool:
        """One fenced write audited as ``event``; a stale token changes nothing, audited as ``stale``."""
        stmt = (sa.update(self.db.t.jobs).where(self.db._fenced(job_id, token),
                                                *self.db.dialect.autocommit_settings(self.db.bounds))
                .values(updated_at=self.db.now_sql, **values))
        if self.audited._audited_write(stmt, job_id, event, reason, worker, token, detail):
            return True
        self.db._stale(None, job_id, stale, worker, token, detail)
        return False

    def complete(self, job_id: str, token: str, worker: str | None = None, result: str | None = None) -> bool:
        """running -> completed, keeping ``result`` in the same statement; False (audited) when stale."""
        params: dict[str, Any] = {"job_id": job_id, "token": token}
        keep = result is not None
        if keep:
            params["result"] = result
        if self.audited._audited_write(lambda: self._complete_running(keep), job_id,
                                       Event.COMPLETED if self.db.audit_every_transition else None,
                                       worker=worker, token=token, params=params,
                                       key="complete_kept" if keep else "complete"):
            return True
        self.db._stale(None, job_id, Event.STALE_COMPLETION_REJECTED, worker, token)
        return False

    def wrote(self, job_id: str, token: str, event: Event) -> bool:
        """Whether a write under ``token`` audited as ``event`` landed (its answer may have been lost)."""
        e = self.db.t.events
        with self.db.begin(read=True) as c:
            return c.execute(sa.select(e.c.id).where(e.c.job_id == job_id, e.c.event == event.value,
                                                     e.c.token == token[:8]).limit(1)).first() is not None

    def kept_result(self, job_id: str) -> str | None:
        """The encoded result a completed job kept (None: not completed, or nothing kept)."""
        j = self.db.t.jobs
        with self.db.begin(read=True) as c:
            return c.execute(sa.select(j.c.result)
                             .where(j.c.id == job_id, fenced_status(j.c.status, COMPLETED))).scalar()

    def fail(self, job_id: str, token: str, error: str, worker: str | None = None) -> bool:
        """running -> failed (dead letter) after a final task failure."""
        return self._owner_write(job_id, token, worker, Event.FAILED, Event.STALE_FAILURE_REJECTED, dict(
            status=FAILED, failed_at=self.db.now_sql, lease_expires_at=None, lock_token=None,
            last_error=storable(error)[:4000],
        ), reason=error[:200])

    def fail_unsent_retry(self, job_id: str, token: str, attempt: int, error: str,
                          worker: str | None = None) -> bool:
        """pending -> failed: the retry ``token`` scheduled, whose message the broker refused. Fenced on the
        row still being that retry: pending at ``attempt`` and no claim, requeue or publish audited since (a
        claim given back leaves it pending at that attempt too: only the claim's event tells them apart)."""
        j, e = self.db.t.jobs, self.db.t.events
        retry = Event.RETRY_SCHEDULED.value
        ours = sa.select(sa.func.max(e.c.id)).where(e.c.job_id == job_id, e.c.event == retry,
                                                    e.c.token == token[:8]).scalar_subquery()
        moved = sa.exists().where(e.c.job_id == job_id, e.c.id > ours, e.c.event.in_(
            [Event.CLAIMED.value, Event.MANUAL_REQUEUE.value, Event.PUBLISHED.value]))
        row = [j.c.id == job_id, fenced_status(j.c.status, PENDING), j.c.attempt_count == attempt]
        with self.db.begin() as c:
            # The row is held first, so the events read next include every move committed before it.
            held = previous_attempt(self.db, c, *row) is not None
            if held and c.execute(sa.update(j).where(*row, ours.is_not(None), ~moved).values(
                    status=FAILED, failed_at=self.db.now_sql, updated_at=self.db.now_sql,
                    last_error=storable(error)[:4000])).rowcount == 1:
                self.db._event(c, job_id, Event.FAILED, error[:200], worker, token)
                return True
            self.db._stale(c, job_id, Event.STALE_FAILURE_REJECTED, worker, token)
            return False

    def retry_later(self, job_id: str, token: str, delay: float, payload: str | None,
                    error: str | None, worker: str | None = None) -> bool:
        """running -> pending at now + delay: a Celery retry; its message is already sent."""
        values: dict[str, Any] = dict(status=PENDING, available_at=self.db.now_sql + delay,
                                      lease_expires_at=None, lock_token=None, locked_by=None)
        if payload is not None:
            values["payload"] = payload
        if error is not None:
            values["last_error"] = storable(error)[:4000]
        return self._owner_write(job_id, token, worker, Event.RETRY_SCHEDULED, Event.STALE_RETRY_REJECTED,
                                 values, reason=(error or "")[:200])

    def release(self, job_id: str, token: str, worker: str | None = None,
                reason: Event = Event.RELEASED_ON_SHUTDOWN) -> bool:
        """running -> pending, available now, giving the attempt back."""
        j = self.db.t.jobs
        return self._owner_write(job_id, token, worker, reason, Event.STALE_RELEASE_REJECTED, dict(
            status=PENDING, available_at=self.db.now_sql, lease_expires_at=None, lock_token=None,
            locked_by=None, attempt_count=sa.case((j.c.attempt_count > 0, j.c.attempt_count - 1), else_=0),
        ))

    def cancel(self, job_id: str, reason: str = "revoked", owner: str | None = None,
               task_name: str | None = None, queue: str | None = None) -> bool:
        """pending -> failed because Celery revoked the task; no re-run follows.
        Only with ``owner`` (terminate=True) is a running job cancelled: a revoked delivery may be a late
        duplicate of a live run. With ``task_name`` a vanished row is recorded again, failed."""
        j = self.db.t.jobs
        unfinished = fenced_status(j.c.status, PENDING)
        if owner is not None:
            running = fenced_status(j.c.status, RUNNING)
            unfinished = sa.or_(unfinished, sa.and_(running, j.c.locked_by == owner))
        error = storable(f"revoked ({reason})")
        with self.db.begin() as c:
            res = c.execute(sa.update(j).where(j.c.id == job_id, unfinished).values(
                status=FAILED, failed_at=self.db.now_sql, updated_at=self.db.now_sql, lease_expires_at=None,
                lock_token=None, last_error=error,
            ))
            done = res.rowcount == 1
            if not done and task_name is not None and c.execute(
                    sa.select(j.c.id).where(j.c.id == job_id)).first() is None:
                c.execute(sa.insert(j).values(
                    id=job_id, task_name=task_name, queue_name=queue, status=FAILED, attempt_count=0,
                    expired_count=0, dispatch_count=0, max_attempts=0, available_at=self.db.now_sql,
                    failed_at=self.db.now_sql, created_at=self.db.now_sql, updated_at=self.db.now_sql,
                    last_error=error))
                reason, done = f"{reason}; its row had vanished and was recorded again", True
            if done:
                self.db._event(c, job_id, Event.REVOKED, reason, owner)
            return done

    def checkpoint(self, job_id: str, token: str, state: Any, worker: str | None = None) -> bool:
        """Store JSON progress on the job row under the token."""
        return self._owner_write(job_id, token, worker, Event.CHECKPOINT, Event.STALE_CHECKPOINT_REJECTED,
                                 dict(checkpoint=json.dumps(state)))

    def _still_held(self, leases: Mapping[str, str]) -> sa.ColumnElement[bool]:
        # By id too: there is no index on the token, and a heartbeat must not scan the table.
        j = self.db.t.jobs
        return self.db.dialect.in_id_order(j, set(leases.values()), j.c.lock_token.in_(list(leases)),
                                           fenced_status(j.c.status, RUNNING))

    def _renewal(self, leases: Mapping[str, str], extend: Mapping[str, float] | None,
                 *where: sa.ColumnElement[bool]) -> sa.Update:
        j = self.db.t.jobs
        duration: sa.ColumnElement[Any] = j.c.lease_duration
        if extend:
            duration = sa.case(*((j.c.lock_token == tok, sa.literal(sec)) for tok, sec in extend.items()),
                               else_=j.c.lease_duration)
        stmt = (sa.update(j).where(self._still_held(leases), *where)
                .values(lease_expires_at=self.db.now_sql + duration, last_heartbeat_at=self.db.now_sql))
        return stmt.values(lease_duration=duration) if extend else stmt

    def _renew_in(self, c: Connection, leases: Mapping[str, str],
                  extend: Mapping[str, float] | None) -> set[str]:
        stmt = self._renewal(leases, extend)
        if self.db.dialect.update_returning:
            return set(c.execute(stmt.returning(self.db.t.jobs.c.id)).scalars())
        c.execute(stmt)
        return set(c.execute(sa.select(self.db.t.jobs.c.id).where(self._still_held(leases))).scalars())

    def renew(self, leases: Mapping[str, str], worker: str,
              extend: Mapping[str, float] | None = None) -> set[str]:
        """Renew every lease (token -> job id) in one statement: the renewed job ids (the rest are lost)."""
        if not leases:
            return set()
        with self.db.begin() as c:
            return self._renew_in(c, leases, extend)

    def beat(self, worker: str, hostname: str, pid: int, leases: Mapping[str, str],
             extend: Mapping[str, float] | None = None) -> set[str]:
        """One heartbeat: refresh the worker's registry row and renew its leases; the renewed job ids.
        On PostgreSQL one statement (the upsert in a CTE), elsewhere one transaction."""
        seen = self.workers._seen(worker, hostname, pid)
        if self.db.dialect.one_statement_writes and leases:
            settings = self.db.dialect.autocommit_settings(self.db.bounds)
            renewed = self._renewal(leases, extend, *settings).returning(self.db.t.jobs.c.id).cte("renewed")
            stmt = sa.select(renewed.c.id).add_cte(seen.cte("seen"))
            with self.db._driver_errors(), self.db.engine.connect() as conn:
                return set(conn.execution_options(isolation_level="AUTOCOMMIT").execute(stmt).scalars())
        with self.db.begin() as c:
            c.execute(seen)
            return self._renew_in(c, leases, extend) if leases else set()

    def describe_loss(self, job_id: str, token: str, worker: str | None = None) -> tuple[str, str | None]:
        """Why a lease was not renewed (vanished, taken over, requeued, finished); audited."""
        reason: str
        with self.db.begin() as c:
            job = self._job(c, job_id)
            if job is None:
                reason, owner = LossReason.VANISHED, None
            elif job.status == RUNNING:
                reason, owner = LossReason.TAKEN_OVER, job.locked_by
            else:
                reason, owner = f"now {job.status}", job.locked_by
            self.db._event(c, job_id, Event.LEASE_LOST, reason, worker, token,
                           {"owner": owner} if owner else None)
        return reason, owner
