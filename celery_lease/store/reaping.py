"""Statements of the reaper: scans of abandoned leases and lost dispatches, recovery CAS, pruning.

The reaper reads a page, publishes, then writes each decision as a CAS that re-checks what the scan saw (the
token, the expiry); a dead letter's row is claimed before its message goes out. ``now`` replaces the store's
clock in predicates only; written times use the real clock."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import StoreConflict
from ..vocabulary import Event
from .attempts import PREVIOUS_OWNER, PREVIOUS_TOKEN, previous_attempt
from .base import StoreEngine
from .rows import COMPLETED, FAILED, PENDING, RUNNING, Job, fenced_status, status_sql, storable

__all__ = ["ReaperStatements", "Expired", "REAPER_LOCK", "REAPER_CLOCK"]

REAPER_LOCK = "celery_lease.reaper"
REAPER_CLOCK = "reaper_clock"  # meta key: the last run's view of the store's clock and of its hold


@dataclasses.dataclass(frozen=True)
class Expired:
    """A running job whose lease is past its grace, and what the registry says of its owner."""

    job: Job
    owner_alive: bool
    reapable: bool  # owner gone, or lease past the hard grace

    @property
    def keyset(self) -> tuple[float, str]:
        assert self.job.lease_expires_at is not None  # the scan selects expired leases only
        return self.job.lease_expires_at, self.job.id


class ReaperStatements:
    def __init__(self, db: StoreEngine) -> None:
        self.db = db

    def _clock(self, now: float | None) -> sa.ColumnElement[float]:
        return self.db.now_sql if now is None else sa.literal(float(now), sa.Double())

    def _locking(self, query: sa.Select, lock: bool) -> sa.Select:
        return self.db.dialect.lock_rows(query, self.db.t.jobs) if lock else query

    @contextlib.contextmanager
    def _tx(self, c: Connection | None) -> Iterator[Connection]:
        # The reaper's own transactions hold a batch while they publish: the long bound.
        if c is not None:
            yield c
        else:
            with self.db.begin(long=True) as own:
                yield own

    def _past_grace(self, clock: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
        j = self.db.t.jobs
        return j.c.lease_expires_at + sa.func.coalesce(j.c.grace_period, 0.0) < clock

    def _after(self, query: sa.Select, column: sa.Column, after: tuple[float, str] | None) -> sa.Select:
        """The keyset page of ``query`` past ``after`` = (``column``, id), ordered by both."""
        j = self.db.t.jobs
        query = query.order_by(column, j.c.id)
        if after is None:
            return query
        at, job_id = after
        return query.where(column >= at, sa.or_(column > at, j.c.id > job_id))

    def scan_expired(self, c: Connection, *, limit: int, after: tuple[float, str] | None = None,
                     now: float | None = None, lock: bool = True) -> list[Expired]:
        """Running jobs past lease + grace, oldest first, after the keyset ``(lease_expires_at, id)``."""
        j = self.db.t.jobs
        clock = self._clock(now)
        query = (
            sa.select(j, self.db._owner_alive(clock).label("owner_alive"),
                      self.db._claimable_expired(now=clock).label("reapable"))
            .where(j.c.status == status_sql(RUNNING), j.c.lease_expires_at < clock, self._past_grace(clock))
            .limit(limit)
        )
        rows = c.execute(self._locking(self._after(query, j.c.lease_expires_at, after), lock)).all()
        return [Expired(Job.from_row(r), bool(r.owner_alive), bool(r.reapable)) for r in rows]

    def _abandoned(self, job_id: str, token: str, owner: str | None, expired: bool,
                   clock: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
        """The CAS: same token, still running, and still past grace (reaper) or still ``owner``'s."""
        fence = self._past_grace(clock) if expired else (self.db.t.jobs.c.locked_by == owner)
        return sa.and_(self.db._fenced(job_id, token), fence)

    def claim_abandoned(self, job_id: str, token: str, claim: str, reaper: str,
                        now: float | None = None, *, owner: str | None = None) -> bool:
        """Hold an abandoned lease under the reaper's ``claim`` and name before its dead letter is sent: the
        owner's writes (and its main process's, fenced by its name) are stale from here on, so no dead
        letter goes out for a job someone completes meanwhile. False when the row moved on (a lost race).
        The row stays expired: a reaper that dies before its CAS leaves it to the next run, and the event
        written here keeps ``owner``'s attempt, which the row no longer names."""
        with self._tx(None) as tx:
            fence = self._abandoned(job_id, token, None, True, self._clock(now))
            held = sa.update(self.db.t.jobs).where(fence).values(lock_token=claim, locked_by=reaper)
            if tx.execute(held).rowcount != 1:
                return False
            why = f"held by {reaper} while its dead letter is sent"
            self.db._event(tx, job_id, Event.DEAD_LETTER_CLAIMED, why, owner, token)
            return True

    def unclaim_abandoned(self, job_id: str, claim: str, token: str, owner: str | None) -> bool:
        """Give a claimed row back to its owner's token and name (the dead letter was not sent): the next
        run decides again, and its audit names the owner, not the claim."""
        with self._tx(None) as tx:
            res = tx.execute(sa.update(self.db.t.jobs).where(self.db._fenced(job_id, claim))
                             .values(lock_token=token, locked_by=owner))
            return res.rowcount == 1

    def _take_back(self, job_id: str, token: str, owner: str | None, expired: bool, now: float | None,
                   c: Connection | None, values: dict[str, Any], event: Event, reason: str,
                   detail: Any, shown: str | None = None) -> bool:
        """One fenced recovery write and its event; the losing side writes nothing."""
        j = self.db.t.jobs
        with self._tx(c) as tx:
            fence = self._abandoned(job_id, token, owner, expired, self._clock(now))
            # The attempt taken back, read holding its row: its event keeps it (the row forgets it).
            previous = previous_attempt(self.db, tx, fence)
            if previous is None:
                return False
            if shown is not None:  # the row holds the reaper's claim; the attempt ended is the owner's
                previous.update({PREVIOUS_OWNER: owner, PREVIOUS_TOKEN: shown[:8]})
            res = tx.execute(sa.update(j).where(fence).values(
                lock_token=None, lease_expires_at=None, expired_count=j.c.expired_count + 1,
                updated_at=self.db.now_sql, **values))
            if res.rowcount != 1:
                return False
            self.db._event(tx, job_id, event, reason, owner, shown or token, {**(detail or {}), **previous})
            return True

    def requeue_abandoned(self, job_id: str, token: str, owner: str | None, *, delay: float, reason: str,
                          expired: bool = True, now: float | None = None, detail: Any = None,
                          c: Connection | None = None) -> bool:
        """running -> pending at now + delay, token cleared, one more expiration counted."""
        values = dict(status=PENDING, locked_by=None, available_at=self.db.now_sql + delay,
                      last_error=storable(reason)[:4000])
        return self._take_back(job_id, token, owner, expired, now, c, values, Event.REAPED_EXPIRED_LEASE,
                               reason, {"delay": round(delay, 3), **(detail or {})})

    def dead_letter_abandoned(self, job_id: str, token: str, owner: str | None, *, error: str,
                              expired: bool = True, now: float | None = None, detail: Any = None,
                              c: Connection | None = None, shown: str | None = None) -> bool:
        """running -> failed (the dead letter), token cleared, one more expiration counted; the event names
        ``shown``, the owner's token, where ``token`` is the reaper's claim."""
        values = dict(status=FAILED, failed_at=self.db.now_sql, last_error=storable(error)[:4000])
        return self._take_back(job_id, token, owner, expired, now, c, values, Event.DEAD_LETTERED,
                               error[:200], detail, shown)

    def note_skipped_owner_alive(self, c: Connection, job: Job, reason: str) -> bool:
        """Audit a lease left to its live owner, once per lease (not once per run)."""
        e = self.db.t.events
        prefix = (job.lock_token or "")[:8] or None
        seen = c.execute(sa.select(e.c.id).where(e.c.job_id == job.id,
                                                 e.c.event == Event.REAP_SKIPPED_OWNER_ALIVE,
                                                 e.c.token == prefix).limit(1)).first()
        if seen is not None:
            return False
        self.db._event(c, job.id, Event.REAP_SKIPPED_OWNER_ALIVE, reason, job.locked_by, job.lock_token)
        return True

    def _dispatch_wait(self, floor: float, cap: float) -> sa.ColumnElement[float]:
        """backoff.dispatch_wait of each row: its own timeout (``floor`` where it carries none),
        doubled per re-send so far, at most ``cap`` but never less than the timeout."""
        j = self.db.t.jobs
        timeout = sa.func.coalesce(j.c.dispatch_timeout, sa.literal(floor, sa.Double()))
        # Past this many re-sends every timeout (>= floor) doubled is past the cap.
        doublings = math.ceil(math.log2(max(cap / floor, 1.0))) + 1
        factor = sa.case({n: sa.literal(2.0 ** n, sa.Double()) for n in range(doublings)},
                         value=j.c.dispatch_count, else_=sa.literal(2.0 ** doublings, sa.Double()))
        grown, ceiling = timeout * factor, sa.literal(cap, sa.Double[float]())
        return sa.case((grown <= ceiling, grown), (timeout >= ceiling, timeout), else_=ceiling)

    def scan_lost_dispatches(self, c: Connection, *, older_than: float, limit: int,
                             after: tuple[float, str] | None = None, now: float | None = None,
                             lock: bool = True, backoff_max: float | None = None) -> list[tuple[Job, float]]:
        """Pending jobs available for longer than ``older_than``, oldest first, with seconds waited; with
        ``backoff_max`` only those past their own wait, so jobs in backoff never fill the pages."""
        j = self.db.t.jobs
        clock = self._clock(now)
        due = [j.c.available_at < clock - older_than]  # the index's range
        if backoff_max is not None:
            due.append(j.c.available_at < clock - self._dispatch_wait(older_than, backoff_max))
        query = (sa.select(j, (clock - j.c.available_at).label("waited"))
                 .where(j.c.status == status_sql(PENDING), *due).limit(limit))
        rows = c.execute(self._locking(self._after(query, j.c.available_at, after), lock)).all()
        return [(Job.from_row(r), float(r.waited)) for r in rows]

    def redispatched(self, job: Job, reason: str, *, detail: Any = None, c: Connection | None = None) -> bool:
        """Count a re-published message: CAS on the count the scan saw, so one reaper wins per dispatch.

        The message is out before this runs, so a worker may have claimed (even finished) the job
        already: the re-send is still counted and audited, and only a row still as the scan saw it
        starts its next dispatch wait now. A row made pending again since the scan (reopened, handed
        over, retried, given back: each sets ``available_at``, a claim or completion never does) holds
        another message than the one re-sent, so nothing is counted on it.
        """
        j = self.db.t.jobs
        as_seen = sa.and_(fenced_status(j.c.status, PENDING), j.c.updated_at == job.updated_at)
        with self._tx(c) as tx:
            # In this order: MySQL/MariaDB evaluate SET left to right, each seeing the columns set before it.
            res = tx.execute(sa.update(j).where(
                j.c.id == job.id, j.c.dispatch_count == job.dispatch_count,
                j.c.available_at == job.available_at,
            ).ordered_values((j.c.available_at, sa.case((as_seen, self.db.now_sql), else_=j.c.available_at)),
                             (j.c.updated_at, sa.case((as_seen, self.db.now_sql), else_=j.c.updated_at)),
                             (j.c.dispatch_count, j.c.dispatch_count + 1)))
            if res.rowcount != 1:
                return False
            self.db._event(tx, job.id, Event.REDISPATCHED, reason,
                           detail={"dispatch_count": job.dispatch_count + 1, **(detail or {})})
            return True

    def fail_undispatchable(self, job: Job, error: str) -> bool:
        """pending -> failed for a lost dispatch whose stored message cannot be sent again, fenced on the row
        as the scan saw it (one claimed or made pending again since holds another message)."""
        j = self.db.t.jobs
        with self._tx(None) as tx:
            res = tx.execute(sa.update(j).where(
                j.c.id == job.id, fenced_status(j.c.status, PENDING), j.c.updated_at == job.updated_at,
                j.c.dispatch_count == job.dispatch_count, j.c.available_at == job.available_at,
            ).values(status=FAILED, failed_at=self.db.now_sql, last_error=storable(error)[:4000],
                     updated_at=self.db.now_sql))
            if res.rowcount != 1:
                return False
            self.db._event(tx, job.id, Event.DEAD_LETTERED, error[:200],
                           detail={"attempt": job.attempt_count})
            return True

    # Not effects.py's lock statements: their INSERT IGNORE + UPDATE in one transaction
    # deadlocks on MySQL when two reapers start together (gap locks).
    def acquire_reaper_lock(self, token: str, owner: str, ttl: float) -> bool:
        """Take the reaper lock when it is free or expired; False while another reaper holds it."""
        k = self.db.t.locks
        with self.db.begin() as c:
            res = c.execute(sa.update(k).where(k.c.resource == REAPER_LOCK, k.c.expires_at < self.db.now_sql)
                            .values(token=token, owner=owner, job_id=None, expires_at=self.db.now_sql + ttl))
            if res.rowcount == 1:
                return True
        try:
            with self.db.begin() as c:
                c.execute(sa.insert(k).values(resource=REAPER_LOCK, token=token, owner=owner, job_id=None,
                                              expires_at=self.db.now_sql + ttl))
        except StoreConflict:
            return False
        return True

    def renew_reaper_lock(self, token: str, ttl: float) -> bool:
        k = self.db.t.locks
        with self.db.begin() as c:
            res = c.execute(sa.update(k).where(k.c.resource == REAPER_LOCK, k.c.token == token)
                            .values(expires_at=self.db.now_sql + ttl))
            return res.rowcount == 1

    def release_reaper_lock(self, token: str) -> bool:
        return self.db._delete_lock(REAPER_LOCK, token)

    def reaper_lock_holder(self) -> tuple[str | None, float] | None:
        """(owner, seconds left) of a live reaper lock, or None when it is free."""
        k = self.db.t.locks
        with self.db.begin(read=True) as c:
            row = c.execute(sa.select(k.c.owner, (k.c.expires_at - self.db.now_sql).label("left"))
                            .where(k.c.resource == REAPER_LOCK, k.c.expires_at >= self.db.now_sql)).first()
        return None if row is None else (row.owner, float(row.left))

    def hold_since(self, c: Connection) -> float | None:
        """On ``c``: when the reaper last began a hold (the store away or its clock stepped), or None."""
        since = (self._clock_in(c) or {}).get("calm_since")
        return float(since) if isinstance(since, (int, float)) else None

    def holds(self, c: Connection, lease: float, heartbeat: float, now: float | None = None) -> bool:
        """On ``c``: whether the reaper's hold still covers an owner of a ``lease``-second lease (it had not
        yet its lease and a heartbeat to renew since the hold began); the reaper's ``Hold`` rule."""
        since = self.hold_since(c)
        if since is None:
            return False
        if now is None:
            now = float(c.execute(sa.select(self.db.now_sql)).scalar_one())
        return now < since + lease + heartbeat

    def reaper_clock(self) -> dict[str, Any] | None:
        """What the last reaper run recorded of the store's clock (``ClockGuard``), or None."""
        with self.db.begin(read=True) as c:
            return self._clock_in(c)

    def _clock_in(self, c: Connection) -> dict[str, Any] | None:
        m = self.db.t.meta
        value = c.execute(sa.select(m.c.value).where(m.c.key == REAPER_CLOCK)).scalar()
        try:
            state = json.loads(value) if value else None
        except ValueError:
            return None  # unreadable: judged as no history, and overwritten by the reaper's next run
        return state if isinstance(state, dict) else None

    def record_reaper_clock(self, state: dict[str, Any], *, held_back: str | None = None,
                            owner: str | None = None, step_back: bool = False) -> None:
        """Record this run's view of the clock; with ``held_back`` also the hold's audit event.
        With ``step_back`` (the clock stepped back) leases and registry rows left in its future are clamped to
        now, so a dead owner's job is not delayed."""
        j, w = self.db.t.jobs, self.db.t.workers
        with self.db.begin() as c:
            c.execute(self.db.dialect.upsert(self.db.t.meta, {"key": REAPER_CLOCK, "value": json.dumps(state),
                                                              "updated_at": self.db.now_sql},
                                             update=("value", "updated_at")))
            if step_back:
                horizon = self.db.now_sql + j.c.lease_duration
                c.execute(sa.update(j).where(j.c.status == status_sql(RUNNING),
                                             j.c.lease_duration.is_not(None), j.c.lease_expires_at > horizon)
                          .values(lease_expires_at=horizon))
                c.execute(sa.update(w).where(w.c.last_seen_at > self.db.now_sql)
                          .values(last_seen_at=self.db.now_sql))
            if held_back is not None:
                self.db._event(c, None, Event.REAPER_HELD_BACK, held_back, owner, detail=state)

    def _delete_ids(self, table: sa.Table, key: sa.Column, where: sa.ColumnElement[bool], limit: int,
                    dry: bool) -> int:
        # Select then delete: MySQL rejects LIMIT inside an IN subquery. ``dry``: only count them.
        with self.db.begin(long=True, read=dry) as c:
            ids = [r[0] for r in c.execute(sa.select(key).where(where).limit(limit))]
            if not ids or dry:
                return len(ids)
            return c.execute(sa.delete(table).where(key.in_(ids), where)).rowcount

    def prune_completed(self, older_than: float, limit: int, now: float | None = None,
                        dry: bool = False) -> int:
        """Delete up to ``limit`` completed jobs finished more than ``older_than`` seconds ago (``dry``: count
        them; so for each prune)."""
        j = self.db.t.jobs
        return self._delete_ids(j, j.c.id, sa.and_(
            j.c.status == status_sql(COMPLETED), j.c.updated_at < self._clock(now) - older_than), limit, dry)

    def prune_events(self, older_than: float, limit: int, now: float | None = None, dry: bool = False) -> int:
        """Delete up to ``limit`` old events, except a dead letter's: its history lasts as long as it."""
        e, j = self.db.t.events, self.db.t.jobs
        dead_letter = sa.exists().where(j.c.id == e.c.job_id, fenced_status(j.c.status, FAILED))
        old = e.c.at < self._clock(now) - older_than
        return self._delete_ids(e, e.c.id, sa.and_(old, ~dead_letter), limit, dry)

    def prune_idempotency_keys(self, older_than: float, limit: int, now: float | None = None,
                               dry: bool = False) -> int:
        """Delete up to ``limit`` keys older than ``older_than`` (lease_idempotency_retention)."""
        k = self.db.t.idempotency_keys
        return self._delete_ids(k, k.c.key, k.c.created_at < self._clock(now) - older_than, limit, dry)

    def prune_workers(self, older_than: float, limit: int, now: float | None = None,
                      dry: bool = False) -> int:
        w = self.db.t.workers
        stale = w.c.last_seen_at < self._clock(now) - older_than
        return self._delete_ids(w, w.c.worker_id, stale, limit, dry)
