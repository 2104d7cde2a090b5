"""Statements of a job's publish: its record (one, or a group's batch), reopen and forget."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from ..config import RECOVERY
from ..errors import StoreConflict
from ..vocabulary import Event
from .audited import AuditedWrites, _arrays, _Audited, _Positional, _unnested
from .base import StoreEngine
from .rows import COMPLETED, FAILED, PENDING, NewJob, fenced_status

__all__ = ["RECORD_BATCH", "PublishStatements"]

# Jobs one statement of record_batch() inserts at most.
RECORD_BATCH = 500
KEY_RACE_TRIES = 3  # a keyed record retried after its conflicting holder vanished


class PublishStatements:
    """How a published job enters the store: pending, with its ``published`` event."""

    def __init__(self, db: StoreEngine, audited: AuditedWrites) -> None:
        self.db = db
        self.audited = audited

    def record(self, job_id: str, task_name: str, queue: str | None, payload: str | None,
               max_attempts: int, idempotency_key: str | None = None,
               delay: float = 0.0, recovery: Mapping[str, Any] | None = None,
               reopen: bool = False) -> tuple[bool, str]:
        """Insert a pending job; returns (created, job id holding the key). The key has its own table so it
        outlives a pruned job; with ``reopen`` a finished job of this id and no key runs again."""
        j = self.db.t.jobs
        params = _record_params(NewJob(job_id, task_name, queue, payload, max_attempts, delay, recovery),
                                idempotency_key)
        keyed = idempotency_key is not None
        built = self._record_statements(keyed)
        # A keyed insert may conflict with a holder that is gone by the look-up below (its publish failed
        # and forgot it, or the key was pruned): the key is free again, so the insert is tried again.
        for _ in range(KEY_RACE_TRIES):
            try:
                if built.compiled is not None:
                    self.audited._execute_compiled(built, params)
                elif built.positional is not None:
                    self.audited._execute_positional(built, params)
                else:
                    with self.db.begin() as c:
                        c.execute(built.update, params)
                        if keyed:
                            c.execute(built.statement, params)
                        c.execute(built.audit, params)
                return True, job_id
            except StoreConflict:
                pass
            if reopen and not keyed:
                self.reopen(job_id, task_name, payload, delay)
                return False, job_id
            if idempotency_key is None:
                return False, job_id
            with self.db.begin(read=True) as c:
                other = self._holder(c, idempotency_key)
                own = sa.select(j.c.id).where(j.c.id == job_id)
                reused = other is None and c.execute(own).first() is not None
            if reused:
                # A task id reused under a key it was not recorded with: answered with that job, the caller
                # would get its old result and the key would stay free for another job.
                raise StoreConflict(f"task id {job_id} already names a job recorded without idempotency key "
                                    f"{idempotency_key!r}: publish under a new task id, or without the key "
                                    "to run that job again")
            if other is not None and self._answered(other, job_id, idempotency_key):
                return False, other
            # Else the holder was forgotten meanwhile (its send failed): the key is free again.
        raise StoreConflict(f"job {job_id}: its idempotency key {idempotency_key!r} was taken and freed "
                            f"{KEY_RACE_TRIES} times while it was recorded; publish it again")

    def _answered(self, holder: str, job_id: str, key: str) -> bool:
        """Whether ``holder`` still holds ``key`` for this answer. A holder whose failed send could still be
        forgotten (pending, never claimed or re-sent) is held while the answer is audited: the forget waits,
        finds the answer and keeps the job this caller was told exists. Locking reads only: a MySQL snapshot
        taken first would make the lock fail on a row changed since (MariaDB's snapshot isolation)."""
        j = self.db.t.jobs
        with self.db.begin() as c:
            held = sa.select(j.c.status, j.c.attempt_count, j.c.dispatch_count).where(j.c.id == holder)
            row = c.execute(self.db.dialect.hold_rows(held, j)).first()
            if row is None:
                return self._holder(c, key, hold=True) == holder  # a pruned job's key outlives it
            if row.status == PENDING and not row.attempt_count and not row.dispatch_count:
                self.db._event(c, holder, Event.KEYED_PUBLISH_ANSWERED,
                               f"a publish of task id {job_id} under its key, answered with this job")
            return True

    def _holder(self, c: Any, key: str, hold: bool = False) -> str | None:
        """The job holding ``key``: the key table names it; a job recorded before that table holds it itself.
        ``hold``: read as it is now, under a lock (MySQL's plain reads keep the transaction's snapshot)."""
        j, k = self.db.t.jobs, self.db.t.idempotency_keys
        keyed = sa.select(k.c.job_id).where(k.c.key == key)
        own = sa.select(j.c.id).where(j.c.idempotency_key == key)
        if hold:
            keyed, own = self.db.dialect.hold_rows(keyed, k), self.db.dialect.hold_rows(own, j)
        return c.execute(keyed).scalar() or c.execute(own).scalar()

    def record_batch(self, jobs: Sequence[NewJob]) -> None:
        """Insert a group's pending jobs without keys and their ``published`` events, each batch one
        transaction of two multi-row INSERTs; an id the store knows raises StoreConflict (nothing written)."""
        if not jobs:
            return
        insert_job, insert_event = self._batch_statements()
        for start in range(0, len(jobs), RECORD_BATCH):
            rows = [_record_params(job) for job in jobs[start:start + RECORD_BATCH]]
            with self.db.begin() as c:
                if self.db.publish_async_commit:
                    c.execute(sa.select(*self.db.dialect.autocommit_settings(self.db.bounds, True)))
                c.execute(insert_job, rows)
                c.execute(insert_event, rows)

    def record_many(self, jobs: Sequence[NewJob]) -> None:
        """Insert pending jobs without keys and their ``published`` events in one commit, at a cost
        close to one record's: on PostgreSQL one autocommit statement over arrays, on SQLite one
        record's statements run for every job in one transaction. An id the store knows raises
        StoreConflict (nothing written). Other databases take record_batch()."""
        if not jobs:
            return
        if not self.db.dialect.compiled_fast_path:
            self.record_batch(jobs)
            return
        # In id order: two processes recording the same ids (a frozen group applied twice) wait for each
        # other's unique-index entries in one order, and the second gets the conflict, not a deadlock.
        rows = [_record_params(job) for job in sorted(jobs, key=lambda job: job.id)]
        if not self.db.dialect.one_statement_writes:
            self.audited._execute_positional_many(self._record_statements(False), rows)
            return
        # Each parameter of the single record becomes the array of its values across the batch.
        self.audited._execute_compiled(self._many_statement(), _arrays(rows, list(rows[0])))

    def _many_statement(self) -> _Audited:
        """record_many()'s PostgreSQL statement, built once per store: the single record's CTEs, each
        selecting from the rows the parameters' arrays unnest to."""
        async_commit = self.db.publish_async_commit
        cache_key = "record_many" + ("_async" if async_commit else "")
        built = self.db._built.get(cache_key)
        if built is not None:
            return built
        j, e = self.db.t.jobs, self.db.t.events
        types = self._param_types()
        rows = sa.select(_unnested(types, "v")).cte("v")
        row, event = self._record_values(Event.PUBLISHED, {name: rows.c[name] for name in types})
        inserted = sa.insert(j).from_select(
            list(row), sa.select(*row.values()).select_from(rows).where(
                *self.db.dialect.autocommit_settings(self.db.bounds, async_commit))
        ).returning(j.c.id).cte("inserted")
        audit = sa.insert(e).from_select(
            ["job_id", *event], sa.select(inserted.c.id, *event.values()).select_from(
                inserted.join(rows, rows.c.p_job == inserted.c.id))).cte("audit")
        statement = sa.select(sa.func.count()).select_from(inserted).add_cte(audit)
        compiled = statement.compile(dialect=self.db.engine.dialect)
        built = _Audited(compiled=(compiled.string, compiled.construct_params(_check=False)), columns=["n"])
        self.db._built[cache_key] = built
        return built

    def _batch_statements(self) -> tuple[sa.Insert, sa.Insert]:
        """record_batch()'s two INSERTs of bind parameters, built once per store."""
        built = self.db._built.get("record_batch")
        if built is not None:
            return built.update, built.audit
        j, e = self.db.t.jobs, self.db.t.events
        row, event = self._record_values(Event.PUBLISHED)
        insert_job = sa.insert(j).values(**row)
        insert_event = sa.insert(e).values(job_id=row["id"], **event)
        if self.db.engine.dialect.insert_executemany_returning:
            # With RETURNING SQLAlchemy sends one multi-row statement; psycopg would send one per row.
            insert_job, insert_event = insert_job.returning(j.c.id), insert_event.returning(e.c.id)
        built = _Audited(update=insert_job, audit=insert_event)
        self.db._built["record_batch"] = built
        return built.update, built.audit

    def reopen(self, job_id: str, task_name: str, payload: str | None, delay: float = 0.0) -> bool:
        """completed or failed -> pending with fresh attempts: its task id was published again (a frozen
        signature applied twice, a shared errback); never a job with an idempotency key."""
        j = self.db.t.jobs
        values: dict[str, Any] = dict(
            status=PENDING, task_name=task_name, available_at=self.db.now_sql + delay,
            updated_at=self.db.now_sql, completed_at=None, failed_at=None, attempt_count=0, expired_count=0,
            dispatch_count=0, lock_token=None, locked_by=None, lease_expires_at=None, last_error=None,
            result=None)
        if payload is not None:
            values["payload"] = payload
        with self.db.begin() as c:
            before = c.execute(sa.select(j.c.status, j.c.last_error).where(j.c.id == job_id)).first()
            res = c.execute(sa.update(j).where(
                j.c.id == job_id,
                sa.or_(fenced_status(j.c.status, COMPLETED), fenced_status(j.c.status, FAILED)),
                j.c.idempotency_key.is_(None),
            ).values(**values))
            if res.rowcount != 1 or before is None:
                return False
            self.db._event(c, job_id, Event.REPUBLISHED, (before.last_error or "")[:200] or None,
                           detail={"previous_status": before.status})
        return True

    def _record_statements(self, keyed: bool, event_name: Event = Event.PUBLISHED) -> _Audited:
        """The publish record as statements of bind parameters, built once per store: on PostgreSQL one
        autocommit statement of CTEs, elsewhere an INSERT each in one transaction. The event's queue and task
        are the row's values: a subquery in the same statement would not see it."""
        async_commit = self.db.publish_async_commit
        cache_key = ("record_keyed" if keyed else "record") + ("_async" if async_commit else "")
        built = self.db._built.get(cache_key)
        if built is not None:
            return built
        j, k, e = self.db.t.jobs, self.db.t.idempotency_keys, self.db.t.events
        row, event = self._record_values(event_name)
        job_id = row["id"]
        key: dict[str, Any] = {"key": row["idempotency_key"], "created_at": self.db.now_sql}
        if not (self.db.dialect.one_statement_writes and self.db.dialect.compiled_fast_path):
            built = _Audited(update=sa.insert(j).values(**row),
                             statement=sa.insert(k).values(job_id=job_id, **key),
                             audit=sa.insert(e).values(job_id=job_id, **event))
            if self.db.dialect.compiled_fast_path:  # SQLite: the INSERTs on the driver, in one transaction
                writes = [built.update, *([built.statement] if keyed else []), built.audit]
                built = _Audited(positional=tuple(_Positional.compile(w, self.db.engine.dialect)
                                                  for w in writes))
        else:
            inserted = sa.insert(j).from_select(
                list(row), sa.select(*row.values()).where(
                    *self.db.dialect.autocommit_settings(self.db.bounds, async_commit))
            ).returning(j.c.id).cte("inserted")
            statement = sa.select(inserted.c.id)
            if keyed:
                statement = statement.add_cte(sa.insert(k).from_select(
                    ["job_id", *key], sa.select(inserted.c.id, *key.values())).cte("keyed"))
            statement = statement.add_cte(sa.insert(e).from_select(
                ["job_id", *event], sa.select(inserted.c.id, *event.values())).cte("audit"))
            compiled = statement.compile(dialect=self.db.engine.dialect)
            built = _Audited(compiled=(compiled.string, compiled.construct_params(_check=False)),
                             columns=["id"])
        self.db._built[cache_key] = built
        return built

    def _param_types(self) -> dict[str, Any]:
        """The bind parameters of _record_params() and their types."""
        j = self.db.t.jobs
        return {"p_job": sa.String(), "p_task": sa.String(), "p_queue": sa.String(), "p_payload": sa.Text(),
                "p_max_attempts": sa.Integer(), "p_key": sa.String(), "p_delay": sa.Double(),
                "p_detail": sa.Text(), **{f"r_{name}": j.c[name].type for name in RECOVERY}}

    def _record_values(self, event_name: Event, source: Mapping[str, Any] | None = None,
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A published job's columns and its event's, as the bind parameters of _record_params() (or the
        columns of ``source`` named like them)."""
        p = source or {name: sa.bindparam(name, type_=t) for name, t in self._param_types().items()}
        row: dict[str, Any] = {
            "id": p["p_job"], "task_name": p["p_task"], "queue_name": p["p_queue"], "payload": p["p_payload"],
            "status": sa.literal(str(PENDING), sa.String()), "attempt_count": sa.literal(0),
            "expired_count": sa.literal(0), "dispatch_count": sa.literal(0),
            "max_attempts": p["p_max_attempts"], "idempotency_key": p["p_key"],
            "available_at": self.db.now_sql + p["p_delay"],
            "created_at": self.db.now_sql, "updated_at": self.db.now_sql,
            **{name: p[f"r_{name}"] for name in RECOVERY},
        }
        event: dict[str, Any] = {"event": sa.literal(str(event_name), sa.String()), "at": self.db.now_sql,
                                 "detail": p["p_detail"], "queue_name": row["queue_name"],
                                 "task_name": row["task_name"]}
        return row, event

    def forget_unpublished(self, job_id: str) -> bool:
        """Delete a pending job whose message never reached the broker, and the idempotency key it holds:
        a key left naming a deleted job would answer every later publish under it with a job nobody runs.
        False, keeping it, once another publish was answered with it (the dispatch scan sends it)."""
        j, k, e = self.db.t.jobs, self.db.t.idempotency_keys, self.db.t.events
        with self.db.begin() as c:
            own = sa.select(j.c.idempotency_key).where(j.c.id == job_id)
            found = c.execute(self.db.dialect.hold_rows(own, j)).first()
            key = found[0] if found is not None else None
            if key is not None and c.execute(sa.select(e.c.id).where(
                    e.c.job_id == job_id, e.c.event == Event.KEYED_PUBLISH_ANSWERED).limit(1)).first():
                return False  # another publish was answered with this job: it stays, for the dispatch scan
            res = c.execute(sa.delete(j).where(j.c.id == job_id, fenced_status(j.c.status, PENDING),
                                               j.c.attempt_count == 0, j.c.dispatch_count == 0))
            if res.rowcount != 1:
                return False
            if key is not None:
                c.execute(sa.delete(k).where(k.c.key == key, k.c.job_id == job_id))
            return True


def _record_params(job: NewJob, idempotency_key: str | None = None) -> dict[str, Any]:
    """The bind parameters of one job's record, named like no column: SQLAlchemy would add it to an INSERT."""
    return {"p_job": job.id, "p_task": job.task_name, "p_queue": job.queue, "p_payload": job.payload,
            "p_max_attempts": job.max_attempts, "p_key": idempotency_key, "p_delay": float(job.delay),
            "p_detail": json.dumps({"queue": job.queue}) if job.queue else None,
            **{f"r_{name}": (job.recovery or {}).get(name) for name in RECOVERY}}
