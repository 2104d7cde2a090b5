"""Writes due at the same moment in one process share one commit (lease_group_commit): first claims,
completions, and the records of publishes made from many threads at once (a web server's).

A leader/follower group commit, with no tick: the first write that finds none in progress writes
everything queued in one transaction; writes arriving meanwhile wait for that commit, or lead the
next one. A lone write waits for nobody and takes the single-row path (JobStatements.complete,
PublishStatements.record), statement for statement.

A batch of completions is one UPDATE fenced row by row by each job's own token and running status,
RETURNING the ids it completed; a row it did not complete (its token moved on, its row vanished) is
then written alone, so that it is rejected and audited as it would have been. A batch the store does
not take raises the same exception in each of its callers; one the store refuses, or gives up on
waiting for one locked row (_alone_again), hands each row back to the single-row path, so that only a
row refused or locked alone fails (a kept result too large for its column fails its own job's write).

A batch of claims takes, in one commit, the rows due for a first claim (pending, never started),
each under its own token and terms, as the single claim would: on PostgreSQL one UPDATE over the
arrays of their values, on SQLite the single claim's statement for each in one transaction. Any
other claim (a duplicate delivery, a finished job, an abandoned lease to take over, a job the
store does not know) goes alone through JobStatements.claim, which decides it as before.

A batch of publish records is one commit (PublishStatements.record_many). One id the store already
holds rolls it back, and each record is then written alone, as it would have been (a finished job
reopened, a conflict answered); a record with an idempotency key is always written alone.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from ..config import RECOVERY
from ..context import BODY
from ..errors import StoreRejected, StoreUnavailable
from ..vocabulary import ClaimOutcome, Event, StoreFailure
from .audited import AuditedWrites, _arrays, _Audited, _unnested
from .base import StoreEngine, uninterrupted
from .handovers import never_handed_over
from .jobs import JobStatements
from .publishes import PublishStatements
from .rows import COMPLETED, PENDING, RUNNING, Claim, ClaimTerms, Job, NewJob, fenced_status
from .workers import WorkerStatements

__all__ = ["Completion", "FirstClaim", "Group", "GroupedJobStatements", "GroupedPublishStatements", "Record"]

#: The values of a first claim that claim_many() sends as arrays, one element per claim.
_CLAIM_ARRAYS = ("job_id", "worker", "token", "duration", "grace", *(f"r_{name}" for name in RECOVERY))

T = TypeVar("T")
R = TypeVar("R")


class _Item(Generic[T, R]):
    __slots__ = ("answer", "done", "error", "lead", "value")

    def __init__(self, value: T) -> None:
        self.value = value
        self.done = threading.Event()
        self.lead = False
        self.answer: R | None = None
        self.error: BaseException | None = None


class Group(Generic[T, R]):
    """Leader/follower group commit of ``write``, which takes a batch and answers each of its items.

    ``write(batch)`` returns one answer per item, in order; what it raises is raised in the
    thread of every caller of that batch. ``batches`` counts the batches written."""

    def __init__(self, write: Callable[[list[T]], Sequence[R]]) -> None:
        self._write = write
        self._reset()
        _GROUPS.add(self)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._queue: list[_Item[T, R]] = []
        self._writing = False
        self.batches = 0

    def submit(self, value: T) -> R:
        """Queue ``value``, and return its answer once the commit holding it is over."""
        item: _Item[T, R] = _Item(value)
        with self._mutex:
            self._queue.append(item)
            if not self._writing:
                self._writing = item.lead = True
        try:
            if not item.lead:
                item.done.wait()  # its batch written, or the lead handed on: it is in the next batch
            if item.lead:
                self._lead()
        except BaseException:
            # Stopped while waiting or before its batch was taken (a gevent time limit or kill lands
            # in a wait, where the shield cannot hold it off): the item leaves, and a lead handed to it
            # passes on, or every later write of this kind would wait for a leader that never comes.
            self._leave(item)
            raise
        if item.error is not None:
            raise item.error
        return item.answer  # type: ignore[return-value]  # set with done, never None when R is not

    def _leave(self, item: _Item[T, R]) -> None:
        """``item``'s caller is gone: out of the queue, and its lead, if it never took its batch, on."""
        with self._mutex:
            queued = item in self._queue
            if queued:
                self._queue.remove(item)
        if queued and item.lead:
            self._hand_on()

    def _lead(self) -> None:
        batch: list[_Item[T, R]] = []
        try:
            with self._mutex:
                batch, self._queue = self._queue, []
            # Written for every caller in the batch, not under the leader's lease: a loss of that lease its
            # shield deferred must not fail the neighbours' writes (it lands when the leader's call ends).
            outside = BODY.set(None)
            try:
                answers = self._write([i.value for i in batch])
            finally:
                BODY.reset(outside)
            self.batches += 1
            for i, answer in zip(batch, answers, strict=True):
                i.answer = answer
        except Exception as exc:  # noqa: BLE001 - raised again in the thread of every caller of the batch
            for i in batch:
                i.error = exc
        except BaseException:
            # The leader was stopped (an interrupt): the others do not know if the batch committed.
            for i in batch:
                i.error = StoreUnavailable("the write of a shared commit was interrupted")
            raise
        finally:
            for i in batch:
                i.done.set()
            self._hand_on()

    def _hand_on(self) -> None:
        with self._mutex:
            if self._queue:  # the oldest waiter leads the next batch, which holds its own write
                self._queue[0].lead = True
                self._queue[0].done.set()
            else:
                self._writing = False


#: Every Group of this process, reset in a forked child (the parent's queue and writer are not its own),
#: before any of the child's threads can submit.
_GROUPS: weakref.WeakSet[Group[Any, Any]] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for group in list(_GROUPS):
        group._reset()


os.register_at_fork(after_in_child=_reset_after_fork)


def _alone_again(exc: StoreRejected | StoreUnavailable, db: StoreEngine) -> bool:
    """Whether each item of a batch that raised ``exc`` is written alone: the store refused the batch, or
    gave up on it on a row lock or statement bound (an error it answered: the batch's one statement or
    transaction rolled back, so that nothing is written twice or lost). A row another transaction holds (a
    reaper batch, an operator's requeue) then fails its own caller only, as with the setting off. Each
    caller writes alone in its own thread within its own call bound, after the server's bound on the batch
    (a lock wait: a quarter of the call bound); a lease counts from before its call, so a late answer costs
    lease time, never a second owner. Not a lost connection or the client's deadline (UNREACHABLE: a commit
    may have landed), nor SQLite's lock (the whole file, which each would wait for again)."""
    if isinstance(exc, StoreRejected):
        return True
    return getattr(exc, "kind", None) == StoreFailure.TIMEOUT and not db.dialect.single_writer


def _answers(batch: Sequence[Any], alone: Callable[[Any], R], many: Callable[[list[Any]], Mapping[str, Any]],
             answer: Callable[[Any], R], db: StoreEngine) -> list[R | None]:
    """A batch's answers: a lone item written ``alone``; else each job's first item answered from what
    ``many`` wrote of it (by job id), and None for the rest (a job twice in one batch, a row ``many``
    did not write), or for all when the batch failed as _alone_again() says: they are written alone."""
    if len(batch) == 1:
        return [alone(batch[0])]
    firsts: dict[str, Any] = {}
    for item in batch:
        firsts.setdefault(item.job_id, item)
    try:
        written = many(list(firsts.values()))
    except (StoreRejected, StoreUnavailable) as exc:
        if not _alone_again(exc, db):
            raise
        return [None] * len(batch)
    return [answer(written[i.job_id]) if firsts[i.job_id] is i and i.job_id in written else None
            for i in batch]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One caller's completion: its job, its token, its worker and the result it keeps (encoded)."""

    job_id: str
    token: str
    worker: str | None
    result: str | None


@dataclasses.dataclass(frozen=True)
class FirstClaim:
    """One caller's claim, as JobStatements.claim takes it."""

    job_id: str
    worker: str
    token: str
    terms: ClaimTerms
    task_name: str
    queue: str | None
    payload: Callable[[], str | None]


class GroupedJobStatements(JobStatements):
    """JobStatements whose claims, and completions, due at once share one commit (lease_group_commit).

    ``complete`` answers as the single-row one does: True once the completion is committed,
    False (audited ``stale_completion_rejected``) when the token no longer matches. ``claim`` too:
    a batch takes the pending rows due for a first claim, each under its own token, and every other
    claim (a duplicate, a finished job, an abandoned lease, a job not yet recorded) is decided alone."""

    def __init__(self, db: StoreEngine, audited: AuditedWrites, workers: WorkerStatements) -> None:
        super().__init__(db, audited, workers)
        self.group: Group[Completion, bool | None] = Group(self._write_batch)
        self.claims: Group[FirstClaim, Claim | None] = Group(self._claim_batch)

    def claim(self, job_id: str, worker: str, token: str, terms: ClaimTerms, task_name: str,
              queue: str | None, payload: Callable[[], str | None]) -> Claim:
        # Shielded as complete() is; the lease counts from before this call, wait for the batch included.
        with uninterrupted():
            claim = self.claims.submit(FirstClaim(job_id, worker, token, terms, task_name, queue, payload))
        if claim is None:
            return super().claim(job_id, worker, token, terms, task_name, queue, payload)
        return claim

    def _claim_batch(self, batch: list[FirstClaim]) -> list[Claim | None]:
        """Each claim's answer: a lone one decided alone, a batch's first claims taken, None for the rest."""
        return _answers(
            batch, lambda c: JobStatements.claim(self, c.job_id, c.worker, c.token, c.terms, c.task_name,
                                                 c.queue, c.payload),
            self.claim_many, lambda job: Claim(ClaimOutcome.CLAIMED, job), self.db)

    def claim_many(self, rows: Sequence[FirstClaim]) -> dict[str, Job]:
        """pending -> running for each first claim under its own token and terms, in one commit: the rows
        taken, by id. Each row is written as ``claim`` writes it (PostgreSQL: one autocommit UPDATE over
        the arrays of the claims' values; SQLite: the single claim's statement for each, in one transaction).
        With lease_audit_every_transition none is taken here: each is claimed alone, its event with it."""
        if self.db.audit_every_transition or not self.db.dialect.compiled_fast_path:
            return {}
        # In id order: two processes' batches over the same rows lock them in one order (PostgreSQL).
        rows = sorted(rows, key=lambda r: r.job_id)
        params = [self._first_claim_params(r.job_id, r.worker, r.token, r.terms) for r in rows]
        if not self.db.dialect.one_statement_writes:
            stmt, key = self._first_claim()
            writes = [(r.job_id, p) for r, p in zip(rows, params, strict=True)]
            jobs = self.audited._unaudited_rows(stmt, key, writes)
            return {job.id: job for job in jobs or () if job is not None}
        bind = {**_arrays(params, _CLAIM_ARRAYS), "early": self.db.clock_tolerance}
        found = self.audited._execute_compiled_rows(self._claim_many_statement(), bind)
        return {row["id"]: Job.from_row(row) for row in found}

    def _claim_many_statement(self) -> _Audited:
        """claim_many()'s PostgreSQL statement, built once per store: the single claim's UPDATE, each
        row's values from the rows the parameters' arrays unnest to."""
        async_commit = self.db.claim_async_commit
        cache_key = "claim_many" + ("_async" if async_commit else "")
        built = self.db._built.get(cache_key)
        if built is not None:
            return built
        j = self.db.t.jobs
        types = {"job_id": sa.String(), "worker": sa.String(), "token": sa.String(), "duration": sa.Double(),
                 "grace": sa.Double(), **{f"r_{name}": j.c[name].type for name in RECOVERY}}
        assert set(types) == set(_CLAIM_ARRAYS)
        v = _unnested(types, "v")
        early: sa.BindParameter[float] = sa.bindparam("early", type_=sa.Double())
        columns = self.audited._row_columns(True)
        stmt = sa.update(j).where(
            j.c.id == v.c.job_id, fenced_status(j.c.status, PENDING), j.c.started_at.is_(None),
            j.c.available_at <= self.db.now_sql + early, never_handed_over(self.db),
            *self.db.dialect.autocommit_settings(self.db.bounds, async_commit),
        ).values(**self._lease_values(v.c.worker, v.c.token, v.c.duration, v.c.grace),
                 **{name: sa.func.coalesce(v.c[f"r_{name}"], j.c[name]) for name in RECOVERY},
                 ).returning(*columns)
        compiled = stmt.compile(dialect=self.db.engine.dialect)
        built = _Audited(compiled=(compiled.string, compiled.construct_params(_check=False)),
                         columns=[c.name for c in columns])
        self.db._built[cache_key] = built
        return built

    def complete(self, job_id: str, token: str, worker: str | None = None, result: str | None = None) -> bool:
        # Shielded: a lost lease's interruption must not leave a batch without its leader.
        with uninterrupted():
            done = self.group.submit(Completion(job_id, token, worker, result))
        if done is None:  # not completed by the batch: written alone, rejected and audited as alone
            return super().complete(job_id, token, worker, result)
        return done

    def _write_batch(self, batch: list[Completion]) -> list[bool | None]:
        """Each completion's answer: True or False written alone, True completed by the batch, else None."""
        return _answers(
            batch, lambda c: JobStatements.complete(self, c.job_id, c.token, c.worker, c.result),
            lambda rows: dict.fromkeys(self.complete_many(rows), True), lambda done: done, self.db)

    def complete_many(self, rows: Sequence[Completion]) -> set[str]:
        """running -> completed for each row under its own token, in one UPDATE and one commit:
        the ids it completed. Each row gets what ``complete`` writes (its kept result, and its
        ``completed`` event with lease_audit_every_transition, in the same transaction)."""
        j = self.db.t.jobs
        kept = [(j.c.id == r.job_id, sa.bindparam(None, r.result, type_=sa.Text()))
                for r in rows if r.result is not None]
        values: dict[str, object] = dict(status=COMPLETED, completed_at=self.db.now_sql, lock_token=None,
                                         lease_expires_at=None, updated_at=self.db.now_sql)
        if kept:
            values["result"] = sa.case(*kept, else_=j.c.result)
        fenced = sa.tuple_(j.c.id, j.c.lock_token).in_([(r.job_id, r.token) for r in rows])
        stmt = sa.update(j).where(self.db.dialect.in_id_order(
            j, [r.job_id for r in rows], fenced, fenced_status(j.c.status, RUNNING),
        )).values(**values).returning(j.c.id)
        if self.db.dialect.one_statement_writes and not self.db.audit_every_transition:
            # PostgreSQL: one statement in autocommit, its own transaction (one round trip, as the
            # single-row completion), its settings made in its WHERE.
            stmt = stmt.where(*self.db.dialect.autocommit_settings(self.db.bounds))
            with self.db._driver_errors(), self.db.engine.connect() as conn:
                return set(conn.execution_options(isolation_level="AUTOCOMMIT").execute(stmt).scalars())
        with self.db.begin() as c:
            done = set(c.execute(stmt).scalars())
            if done and self.db.audit_every_transition:
                job = sa.bindparam("ev_job", type_=sa.String())
                c.execute(sa.insert(self.db.t.events).values(
                    job_id=job, event=sa.literal(str(Event.COMPLETED), sa.String()), reason=None,
                    worker=sa.bindparam("ev_worker", type_=sa.String()),
                    token=sa.bindparam("ev_token", type_=sa.String()), at=self.db.now_sql, detail=None,
                    **self.db._job_labels(job),
                ), [{"ev_job": r.job_id, "ev_worker": r.worker, "ev_token": r.token[:8]}
                    for r in rows if r.job_id in done])
        return done


@dataclasses.dataclass(frozen=True)
class Record:
    """One caller's publish record without a key: its job, and whether its id may reopen a finished job."""

    job: NewJob
    reopen: bool


class GroupedPublishStatements(PublishStatements):
    """PublishStatements whose records due at once share one commit (lease_group_commit).

    ``record`` answers as the single-row one does: (created, the job id holding the key).
    """

    def __init__(self, db: StoreEngine, audited: AuditedWrites) -> None:
        super().__init__(db, audited)
        self.group: Group[Record, tuple[bool, str] | None] = Group(self._write_batch)

    def record(self, job_id: str, task_name: str, queue: str | None, payload: str | None,
               max_attempts: int, idempotency_key: str | None = None,
               delay: float = 0.0, recovery: Mapping[str, Any] | None = None,
               reopen: bool = False) -> tuple[bool, str]:
        if idempotency_key is not None:
            return super().record(job_id, task_name, queue, payload, max_attempts, idempotency_key, delay,
                                  recovery, reopen)
        job = NewJob(job_id, task_name, queue, payload, max_attempts, delay, recovery)
        # Shielded: a lost lease's interruption must not leave a batch without its leader.
        with uninterrupted():
            answer = self.group.submit(Record(job, reopen))
        if answer is None:  # not written by the batch: written alone, answered as alone
            return super().record(job_id, task_name, queue, payload, max_attempts, None, delay, recovery,
                                  reopen)
        return answer

    def _write_batch(self, batch: list[Record]) -> list[tuple[bool, str] | None]:
        """Each record's answer: the single-row answer when alone, (True, id) recorded by the batch,
        None not recorded by it (its caller writes it alone)."""
        if len(batch) == 1:
            job = batch[0].job
            return [super().record(job.id, job.task_name, job.queue, job.payload, job.max_attempts, None,
                                   job.delay, job.recovery, batch[0].reopen)]
        firsts: dict[str, Record] = {}
        for r in batch:
            firsts.setdefault(r.job.id, r)  # an id twice in one batch: the second is written alone
        try:
            self.record_many([r.job for r in firsts.values()])
        except (StoreRejected, StoreUnavailable) as exc:
            if not _alone_again(exc, self.db):
                raise
            return [None] * len(batch)  # each again alone: a known id reopened or answered as alone
        return [(True, r.job.id) if firsts[r.job.id] is r else None for r in batch]
