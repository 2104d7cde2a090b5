"""Statements of fenced effects, resource locks and the monotonic ``advance`` helper.

An effect key is one ``INSERT ... SELECT`` from the jobs row under the caller's token; the ``*_in`` statements
run in the caller's transaction. Locks are rows with a token and an expiry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import StoreUnavailable
from ..vocabulary import EffectOutcome, Event
from .base import StoreEngine
from .caller import for_caller, is_django
from .reaping import ReaperStatements

__all__ = ["EffectStatements", "advance_statement"]

FIRST, DUPLICATE, LOST = EffectOutcome.FIRST, EffectOutcome.DUPLICATE, EffectOutcome.LOST


def advance_statement(column: sa.Column, where: sa.ColumnElement[bool], value: Any,
                      order: Sequence[Any] | None = None) -> sa.Update:
    """UPDATE that moves ``column`` to ``value`` only where it is behind (NULL or earlier)."""
    if order is None:
        behind = column < value
    else:
        states = list(order)
        if value not in states:
            raise ValueError(f"{value!r} is not one of the states {states!r}; add it to order=")
        earlier = states[:states.index(value)]
        behind = column.in_(earlier) if earlier else sa.false()
    return sa.update(column.table).where(where, sa.or_(column.is_(None), behind)).values({column.name: value})


class EffectStatements:
    """Fenced effect keys and resource locks, as a running job takes and gives them back."""

    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def _lease_held(self, c: Connection, job_id: str, token: str) -> bool:
        j = self.db.t.jobs
        return c.execute(sa.select(j.c.id).where(self.db._fenced(job_id, token))).first() is not None

    def _effect_insert(self, key: str, job_id: str, token: str, fenced: bool = True,
                       nonce: str | None = None) -> Any:
        """The key's insert; ``nonce`` marks the row as this call's."""
        e, j = self.db.t.effects, self.db.t.jobs
        mark = {"nonce": nonce} if nonce is not None else {}
        if not fenced:
            return self.db.dialect.insert_ignore(e).values(key=key, job_id=job_id, at=self.db.now_sql, **mark)
        source = (sa.select(sa.literal(key, sa.String()), j.c.id, self.db.now_sql,
                            *(sa.literal(v, sa.String()) for v in mark.values()))
                  .where(self.db._fenced(job_id, token)))
        return self.db.dialect.insert_ignore(e).from_select(["key", "job_id", "at", *mark], source)

    def record_effect(self, key: str, job_id: str, token: str, worker: str | None = None,
                      nonce: str | None = None) -> EffectOutcome:
        """Insert ``key`` for the job while ``token`` holds it: FIRST, DUPLICATE or LOST (audited).

        ``nonce`` is the call's own mark, the same on each of its tries: a try that finds the key with
        it is told FIRST, as the try whose commit went through and whose answer was lost would have been.
        """
        e = self.db.t.effects
        with self.db.begin() as c:
            if c.execute(self._effect_insert(key, job_id, token, nonce=nonce)).rowcount == 1:
                return FIRST
            if self._lease_held(c, job_id, token):
                if nonce is not None and c.execute(sa.select(e.c.nonce).where(
                        e.c.key == key, e.c.job_id == job_id)).scalar() == nonce:
                    return FIRST
                return DUPLICATE
            self.db._stale(c, job_id, Event.STALE_EFFECT_REJECTED, worker, token, {"key": key})
            return LOST

    @contextlib.contextmanager
    def _caller_errors(self, conn: Any, what: str) -> Iterator[None]:
        """Driver errors of the caller's connection, as the LeaseError they mean, naming the connection."""
        try:
            yield
        except (sa.exc.DBAPIError, sa.exc.TimeoutError) as exc:
            error = self.db.dialect.classify(exc, "behind the caller's connection", self.db.bounds)
            raise type(error)(f"{what}: {error}; pass a connection to the lease store's database "
                              f"({self.db.safe_url}), migrated", **error.context) from exc

    def record_effect_in(self, conn: Connection | Any, key: str, job_id: str, token: str,
                         worker: str | None = None) -> EffectOutcome:
        """Like record_effect, but the key is written in the caller's transaction on ``conn``.
        On MySQL/MariaDB the fenced insert would share-lock the jobs row until the caller commits (blocking
        heartbeats and the reaper): the fence is read on the store's connection instead."""
        conn = self._caller(conn)
        what = f"effect {key!r}"
        if self.db.dialect.fence_locks_rows:
            with self.db.begin() as c:
                if not self._lease_held(c, job_id, token):
                    self._stale_effect(c, key, job_id, token, worker)
                    return LOST
            with self._caller_errors(conn, what):
                inserted = conn.execute(self._effect_insert(key, job_id, token, fenced=False))
                self._same_database(conn, job_id)
            return FIRST if inserted.rowcount == 1 else DUPLICATE
        with self._caller_errors(conn, what):
            if conn.execute(self._effect_insert(key, job_id, token)).rowcount == 1:
                return FIRST
            if self.db.dialect.single_writer:
                # The caller's connection may hold the only write lock: read and audit on it.
                self._same_database(conn, job_id)
                outcome = self._duplicate_or_lost(conn, key, job_id, token, worker)
        if not self.db.dialect.single_writer:
            with self.db.begin() as c:
                outcome = self._duplicate_or_lost(c, key, job_id, token, worker)
        if outcome is DUPLICATE:
            with self._caller_errors(conn, what):
                self._same_database(conn, job_id)
        return outcome

    def _same_database(self, conn: Any, job_id: str) -> None:
        """Refuse a caller's connection that does not see a job the store holds: another database of the same
        kind (old store tables left there), where the key would be written unfenced or taken for a duplicate
        or a lost lease. A job gone from the store too is left to the fence."""
        held = sa.select(self.db.t.jobs.c.id).where(self.db.t.jobs.c.id == job_id)
        if conn.execute(held).first() is not None:
            return
        with self.db.begin(read=True) as c:  # a read: the caller's connection may hold SQLite's write lock
            gone = c.execute(held).first() is None
        if not gone:
            raise ValueError(f"effect(connection=...) needs a connection to the lease store's database "
                             f"({self.db.safe_url}); the one given does not hold job {job_id}: it is another "
                             "database (a Django alias other than the store's?)")

    def _caller(self, conn: Any) -> Any:
        """The caller's connection as the statements take it; ValueError for another kind of database."""
        django = is_django(conn)
        name = conn.vendor if django else conn.dialect.name
        if not self.db.dialect.speaks(name):
            raise ValueError(f"effect(connection=...) needs a connection to the lease store's database "
                             f"({self.db.safe_url}); got a {name} connection")
        if not django:
            return conn
        return for_caller(conn, self.db.engine.dialect)

    def record_unfenced_effect_in(self, conn: Any, key: str, job_id: str) -> EffectOutcome:
        """Write ``key`` in the caller's transaction for a run without a lease (eager): FIRST or DUPLICATE."""
        conn = self._caller(conn)
        with self._caller_errors(conn, f"effect {key!r}"):
            inserted = conn.execute(self._effect_insert(key, job_id, "", fenced=False))
        return FIRST if inserted.rowcount == 1 else DUPLICATE

    def _duplicate_or_lost(self, c: Any, key: str, job_id: str, token: str,
                           worker: str | None) -> EffectOutcome:
        """Why a fenced key insert wrote nothing: the key exists (DUPLICATE) or the lease is gone (LOST)."""
        if self._lease_held(c, job_id, token):
            return DUPLICATE
        self._stale_effect(c, key, job_id, token, worker)
        return LOST

    def _stale_effect(self, c: Any, key: str, job_id: str, token: str, worker: str | None) -> None:
        self.db._stale(c, job_id, Event.STALE_EFFECT_REJECTED, worker, token,
                       {"key": key, "in_transaction": True})

    def release_effect(self, key: str, job_id: str, token: str, worker: str | None = None,
                       reason: str | None = None, nonce: str | None = None) -> bool:
        """Delete a key whose block failed while ``token`` holds the job; else keep it, audited
        ``effect_unconfirmed`` (the effect may not have happened). With ``nonce``, the recording call's
        mark, a key that call recorded is deleted whoever holds the job now (a try whose answer was lost
        wrote it, and its block never ran); none recorded, nothing is written."""
        e = self.db.t.effects
        mine = e.c.nonce == nonce if nonce is not None else sa.exists().where(self.db._fenced(job_id, token))
        with self.db.begin() as c:
            res = c.execute(sa.delete(e).where(e.c.key == key, e.c.job_id == job_id, mine))
            if res.rowcount == 1:
                self.db._event(c, job_id, Event.EFFECT_RELEASED, reason, worker, token, {"key": key})
                return True
            if nonce is not None:
                return False
            self.db._event(c, job_id, Event.EFFECT_UNCONFIRMED,
                           "block failed after the lease was lost; key kept", worker, token,
                           {"key": key, "error": reason})
            return False

    def unrecord_effect_in(self, conn: Connection | Any, key: str, job_id: str) -> bool:
        """Take back a key this transaction wrote on ``conn`` (its block failed; nobody saw it yet)."""
        e = self.db.t.effects
        conn = self._caller(conn)
        with self._caller_errors(conn, f"effect {key!r}"):
            return conn.execute(sa.delete(e).where(e.c.key == key, e.c.job_id == job_id)).rowcount == 1

    def acquire_lock(self, resource: str, token: str, ttl: float, owner: str | None = None,
                     job_id: str | None = None, job_token: str | None = None,
                     heartbeat: float = 0.0) -> EffectOutcome:
        """Take ``resource`` if it is free or expired: FIRST, DUPLICATE (held) or LOST (with ``job_token``,
        that job's lease is gone; audited). ``heartbeat``: the taker's interval, for the reaper's hold."""
        for attempt in range(3):
            try:
                return self._acquire_lock_once(resource, token, ttl, owner, job_id, job_token, heartbeat)
            except StoreUnavailable as exc:
                # Racing takers can deadlock on MySQL; the loser was rolled back whole: safe to rerun.
                if attempt == 2 or not self.db.dialect.retryable(exc.__cause__):
                    raise
        raise AssertionError("unreachable")

    def _acquire_lock_once(self, resource: str, token: str, ttl: float, owner: str | None,
                           job_id: str | None, job_token: str | None, heartbeat: float) -> EffectOutcome:
        lk, j = self.db.t.locks, self.db.t.jobs
        fence = self.db._fenced(job_id, job_token) if job_token is not None and job_id is not None else None
        with self.db.begin() as c:
            values: list[sa.ColumnElement[Any]] = [
                sa.literal(resource, sa.String()), sa.literal(token, sa.String()),
                sa.literal(job_id, sa.String()), sa.literal(owner, sa.String()), self.db.now_sql + ttl]
            # SQLite wants a WHERE before ON CONFLICT in INSERT ... SELECT.
            source = sa.select(*values).where(sa.true())
            if fence is not None:
                source = source.select_from(j).where(fence)
            cols = ["resource", "token", "job_id", "owner", "expires_at"]
            if c.execute(self.db.dialect.insert_ignore(lk).from_select(cols, source)).rowcount == 1:
                return FIRST
            # This acquisition's own row (an earlier try committed and its answer was lost): ours, its
            # expiry counted again from this statement, which the caller's local deadline counts from.
            again = sa.update(lk).where(lk.c.resource == resource, lk.c.token == token)
            if fence is not None:
                again = again.where(sa.exists().where(fence))
            if c.execute(again.values(expires_at=self.db.now_sql + ttl)).rowcount == 1:
                return FIRST
            take = sa.update(lk).where(lk.c.resource == resource, self._lapsed())
            if fence is not None:
                take = take.where(sa.exists().where(fence))
            res = None if self._held(c, resource, ttl, heartbeat) else c.execute(
                take.values(token=token, job_id=job_id, owner=owner, expires_at=self.db.now_sql + ttl))
            if res is not None and res.rowcount == 1:
                self.db._event(c, job_id, Event.LOCK_TAKEN_AFTER_EXPIRY, resource, owner, token)
                return FIRST
            if fence is not None and job_id is not None and job_token is not None \
                    and not self._lease_held(c, job_id, job_token):
                self.db._stale(c, job_id, Event.STALE_LOCK_REJECTED, owner, job_token, {"resource": resource})
                return LOST
            return DUPLICATE

    def _lapsed(self) -> sa.ColumnElement[bool]:
        """A lock another job may take: expired by more than lease_clock_tolerance, since its holder's local
        margin (1% of the TTL) does not cover a step of the store's clock within that tolerance."""
        return self.db.t.locks.c.expires_at + self.db.clock_tolerance < self.db.now_sql

    def _held(self, c: Connection, resource: str, ttl: float, heartbeat: float) -> bool:
        """Whether the reaper's hold still covers the holder of an expired-looking lock (the store was away or
        its clock stepped): a holder trusts its lock no longer than its job's lease, which the hold covers
        for that lease and a heartbeat, as it covers a takeover claim."""
        lk, j = self.db.t.locks, self.db.t.jobs
        holder = lk.outerjoin(j, j.c.id == lk.c.job_id)
        row = c.execute(sa.select(j.c.lease_duration, self.db.now_sql).select_from(holder).where(
            lk.c.resource == resource, self._lapsed())).first()
        if row is None:
            return False  # not expired: nothing to take
        lease, now = row
        return ReaperStatements(self.db).holds(c, lease or ttl, heartbeat, float(now))

    def renew_locks(self, ttls: Mapping[str, float]) -> set[str]:
        """Extend every lock whose token is given (token -> ttl) in one statement; returns renewed tokens."""
        if not ttls:
            return set()
        lk = self.db.t.locks
        tokens = list(ttls)
        ttl = sa.case(*((lk.c.token == tok, sa.literal(sec)) for tok, sec in ttls.items()), else_=0.0)
        stmt = sa.update(lk).where(lk.c.token.in_(tokens)).values(expires_at=self.db.now_sql + ttl)
        with self.db.begin() as c:
            if self.db.dialect.update_returning:
                return {r[0] for r in c.execute(stmt.returning(lk.c.token))}
            c.execute(stmt)
            return set(c.execute(sa.select(lk.c.token).where(lk.c.token.in_(tokens))).scalars())

    def release_lock(self, resource: str, token: str) -> bool:
        """Delete the lock row if ``token`` still holds it; False when it expired and moved on."""
        return self.db._delete_lock(resource, token)
