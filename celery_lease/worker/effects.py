"""Fenced effects (once per key), resource locks and a forward-only update. An effect's key is written before
its block runs, so two racers cannot both see ``first``, and taken back if the block raises."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from sqlalchemy.engine import Connection

import celery_lease.deadline as deadline
import celery_lease.store.schema as schema

from ..context import BODY
from ..errors import LeaseConfigError, LeaseError, LeaseLost, LockUnavailable, StoreRejected, StoreUnavailable
from ..store.base import uninterrupted
from ..store.django_database import holds_store_file
from ..store.effects import advance_statement
from ..vocabulary import EffectOutcome, Event, StoreFailure
from .handles import LeaseHandle

__all__ = ["effect", "lock", "advance", "ResourceLock", "Locks", "connection_for"]

log = logging.getLogger(__name__)

MAX_POLL = 0.5  # seconds between two tries of a held lock, at most
INTERRUPTIONS = (SoftTimeLimitExceeded, TimeLimitExceeded)  # land in a block from outside (so does SIGUSR1)
RESERVED = "celery_lease."  # lock names of the library itself (store.reaping.REAPER_LOCK)


def _check_key(kind: str, key: str) -> None:
    # MySQL's INSERT IGNORE would truncate a longer key silently, merging distinct keys.
    if not isinstance(key, str) or not key or len(key) > schema.ID:
        raise ValueError(f"{kind} must be a non-empty string of at most {schema.ID} characters, got {key!r}")


def connection_for(using: str) -> Any:
    """This thread's Django connection for database alias ``using`` (``connections[using]``)."""
    try:
        from django.db import connections
    except ImportError as exc:
        raise ImportError("effect(using=...) names a Django database: pip install django") from exc
    return connections[using]


def _refuse_in_own_transaction(store: Any, exc: StoreUnavailable, call: str, instead: str) -> None:
    """A write that timed out inside this thread's atomic block holding the store's SQLite file waited on
    itself: a clear error, not an outage to wait out until the lease is lost."""
    if holds_store_file(store):
        raise StoreRejected(f"{call} cannot write the lease store inside this thread's transaction.atomic(), "
                            f"which holds the SQLite file the store shares once it has written: {instead}, "
                            "or call it before the block writes", kind=StoreFailure.LOCKED_BY_CALLER) from exc


@contextlib.contextmanager
def effect(lease: LeaseHandle, key: str, connection: Connection | None = None) -> Iterator[bool]:
    """``with effect(lease, key) as first:`` do the side effect only when ``first``; a block that raises frees
    the key (in ``connection``'s transaction when given) so a later attempt performs it."""
    _check_key("effect key", key)
    lease.check()
    store = lease.store
    if connection is None:
        # One mark for every try of this call: a try that finds the key under it knows the key is its own
        # (an earlier try's commit went through, its answer lost) and not another attempt's.
        nonce = secrets.token_hex(16)

        def record() -> EffectOutcome:
            try:
                return store.effects.record_effect(key, lease.job_id, lease.token, lease.worker, nonce)
            except StoreUnavailable as exc:
                _refuse_in_own_transaction(store, exc, f"effect({key!r})", "use effect(key, using=<alias>)")
                raise

        # Shielded across the record: a loss held back during the call, or landing as the shield ends,
        # comes after the key it wrote is given back (its block will not run), never in place of the
        # call's answer with the key left recorded.
        outcome: EffectOutcome | None = None
        try:
            with uninterrupted():
                # An unreachable store is waited for until the local deadline, then LeaseLost.
                outcome = lease.patiently(record)
                if outcome == EffectOutcome.LOST and lease.vanished_and_recorded_again():
                    outcome = lease.patiently(record)
                if outcome == EffectOutcome.FIRST:
                    lease.check()
        except LeaseLost:
            if outcome == EffectOutcome.FIRST:
                # Written for a lease known lost, whose own shield would refuse the call at its start.
                outside = BODY.set(None)
                try:
                    _release(lease, key, "lease lost while the key was recorded; the block did not run")
                finally:
                    BODY.reset(outside)
            raise
    else:
        outcome = store.effects.record_effect_in(connection, key, lease.job_id, lease.token, lease.worker)
    if outcome == EffectOutcome.LOST:
        log.warning("job %s [%s]: effect %r rejected, the lease moved on", lease.job_id, lease.token[:8], key,
                    extra={"action": "stale_effect_rejected"})
        lease.mark_lost(f"effect {key!r} rejected: token no longer matches")
        lease.check()
    first = outcome == EffectOutcome.FIRST
    try:
        yield first
    except BaseException as exc:
        if first:
            _take_back(lease, key, connection, exc)
        raise


def _take_back(lease: LeaseHandle, key: str, connection: Connection | None, exc: BaseException) -> None:
    """The block failed: free its key so the effect is not lost, never masking its error. A block ended from
    outside (its lost lease, a time limit, not an ``Exception``) keeps it: that lands after the effect too."""
    reason = f"{type(exc).__name__}: {exc}"[:200]
    if connection is not None:
        try:
            lease.store.effects.unrecord_effect_in(connection, key, lease.job_id)
        except (StoreUnavailable, StoreRejected) as error:
            # An aborted transaction (PostgreSQL) can only roll back, and the rollback drops the key.
            log.info("job %s [%s]: effect %r left to the transaction's rollback (%s)", lease.job_id,
                     lease.token[:8], key, error, extra={"action": "effect_released"})
        return
    if isinstance(exc, LeaseLost) or lease.lost:
        _unconfirmed(lease, key, reason, "the lost lease")
    elif isinstance(exc, INTERRUPTIONS) or not isinstance(exc, Exception):
        _unconfirmed(lease, key, reason, f"an interruption ({type(exc).__name__})")
    else:
        _release(lease, key, reason)


def _unconfirmed(lease: LeaseHandle, key: str, reason: str, ended_by: str) -> None:
    """Keep the key of a block ended from outside, audited ``effect_unconfirmed``."""
    log.warning("job %s [%s]: effect %r ended by %s (%s); key kept, the effect may or may not have happened",
                lease.job_id, lease.token[:8], key, ended_by, reason, extra={"action": "effect_unconfirmed"})
    try:
        lease.store.event(lease.job_id, Event.EFFECT_UNCONFIRMED, f"block ended by {ended_by}; key kept",
                          worker=lease.worker, token=lease.token, detail={"key": key, "error": reason})
    except (StoreUnavailable, StoreRejected, LeaseLost) as error:
        # LeaseLost: the interruption still due lands on this call; the block's own error is the one raised.
        log.error("job %s [%s]: effect_unconfirmed for %r not audited (%s)", lease.job_id, lease.token[:8],
                  key, error, extra={"action": "effect_unconfirmed"})


def _release(lease: LeaseHandle, key: str, reason: str) -> None:
    """Free a key whose block did not do its effect, fenced by the job's token."""
    try:
        released = lease.store.effects.release_effect(key, lease.job_id, lease.token, lease.worker, reason)
    except (StoreUnavailable, StoreRejected) as error:
        log.error("job %s [%s]: effect %r failed (%s) and its key could not be released (%s); "
                  "the effect may not have happened", lease.job_id, lease.token[:8], key, reason, error,
                  extra={"action": "effect_unconfirmed"})
        return
    if not released:
        log.warning("job %s [%s]: effect %r failed after the lease was lost; key kept, the effect may "
                    "not have happened", lease.job_id, lease.token[:8], key,
                    extra={"action": "effect_unconfirmed"})


def advance(connection: Connection, column: sa.Column, where: sa.ColumnElement[bool], value: Any,
            order: Sequence[Any] | None = None) -> bool:
    """Set ``column`` to ``value`` where NULL or behind (``<``, or earlier in ``order``); True when a row
    moved."""
    return connection.execute(advance_statement(column, where, value, order)).rowcount > 0


@dataclasses.dataclass(eq=False)
class ResourceLock:
    """A held lease on a business resource under its own token; past its local deadline the holder stops
    trusting it whether or not the store answers, since the store lets another owner take it after expiry."""

    resource: str
    token: str
    ttl: float
    lease: LeaseHandle
    deadline: float = float("-inf")  # local monotonic seconds, set by the acquisition
    confirmed_at: float = float("-inf")  # send time of the last confirmed acquisition or renewal
    lost: bool = False
    done: bool = False  # the block ended (or the lock was lost): release, never renew
    released: bool = False
    release_sent: bool = False  # a release was tried: one whose answer was lost may have deleted the row
    _mutex: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def confirm(self, sent_at: float) -> None:
        """The store took or renewed the lock with a statement sent at ``sent_at``; a lost lock stays lost."""
        if not self.lost:
            self.confirmed_at = max(self.confirmed_at, sent_at)
            self.deadline = max(self.deadline, deadline.local_deadline(sent_at, self.ttl))

    def check(self) -> None:
        """Raise LeaseLost if the lock (or the job's lease) can no longer be trusted."""
        if not self.lost and not self.done and deadline.monotonic() >= self.deadline:
            self.lease.runtime.locks.expire(self)
        if self.lost:
            # The heartbeat flags the lock lost before it marks the lease lost and interrupts.
            self.lease.raising_in_body()
            raise LeaseLost(self.lease.job_id, f"resource lock {self.resource!r} lost")
        self.lease.check()


class Locks:
    """The resource locks of one worker process; its runtime renews them after each heartbeat."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.held: dict[str, ResourceLock] = {}
        self._mutex = threading.Lock()

    def holds(self, job_id: str, resource: str) -> bool:
        with self._mutex:
            return any(lk.resource == resource and lk.lease.job_id == job_id and not lk.done
                       for lk in self.held.values())

    def add(self, lk: ResourceLock) -> None:
        with self._mutex:
            self.held[lk.token] = lk
        # The timer may sleep past this lock's deadline: tell it (it wakes only when it must).
        lk.lease.runtime.timer.watch(lk.deadline)

    def release(self, lk: ResourceLock) -> None:
        """Release fenced by the lock's token, once; retried next round if the store is unreachable."""
        lk.done = True
        with lk._mutex:
            if lk.released:
                return
            tried_before, lk.release_sent = lk.release_sent, True
            try:
                deleted = self.store.effects.release_lock(lk.resource, lk.token)
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("lock %r [%s] not released yet (%s); it expires in at most %gs", lk.resource,
                            lk.token[:8], exc, lk.ttl, extra={"action": "lock_release_deferred"})
                return
            lk.released = True
        with self._mutex:
            self.held.pop(lk.token, None)
        if not deleted and not lk.lost and not tried_before:
            # (After a try whose answer was lost, the row missing is most likely that try's own delete.)
            lk.lost = True
            self._lost(lk, "expired and moved on before release")

    def _lost(self, lk: ResourceLock, why: str) -> None:
        """Audit a lost lock; an audit the store does not take is logged, never raised."""
        lease = lk.lease
        log.warning("job %s [%s]: resource lock %r [%s] lost: %s", lease.job_id, lease.token[:8],
                    lk.resource, lk.token[:8], why, extra={"action": "lock_lost"})
        try:
            self.store.event(lease.job_id, Event.LOCK_LOST, f"{lk.resource}: {why}", lease.worker, lk.token)
        except (StoreUnavailable, StoreRejected, LeaseLost) as exc:
            log.error("job %s [%s]: lock_lost of %r not audited (%s)", lease.job_id, lease.token[:8],
                      lk.resource, exc, extra={"action": "lock_lost"})

    def expire(self, lk: ResourceLock, now: float | None = None) -> None:
        """The lock passed its local deadline: lost, and its job's lease with it; no store call."""
        # Not lk._mutex: a release may hold it through a store call that does not return.
        with self._mutex:
            if lk.lost or lk.done:
                return
            lk.lost = lk.done = True
        lease = lk.lease
        now = deadline.monotonic() if now is None else now
        overran = lease.past_max_runtime(now)
        if overran:
            why = (f"resource lock {lk.resource!r} past its local deadline: past lease_max_runtime "
                   f"({lease.policy.max_runtime:g}s), no longer renewed")
        else:
            why = (f"resource lock {lk.resource!r} past its local deadline: no renewal confirmed for "
                   f"{now - lk.confirmed_at:.1f}s of its {lk.ttl:g}s TTL")
        log.warning("job %s [%s]: resource lock %r [%s] lost: %s", lease.job_id, lease.token[:8],
                    lk.resource, lk.token[:8], why, extra={"action": "lock_lost"})
        lease.mark_lost(why)
        # An overrun job is left to expire, so the reaper counts the expiration against it.
        lease.runtime.lost_locally(lease, give_back=not overran)

    def expire_due(self, now: float, lease: LeaseHandle | None = None) -> float | None:
        """Expire the locks (of ``lease``, or all) past their local deadline; the next deadline, if any."""
        if not self.held:
            return None
        with self._mutex:
            held = [lk for lk in self.held.values() if lease is None or lk.lease is lease]
        upcoming = []
        for lk in held:
            if lk.lost or lk.done:
                continue
            if now >= lk.deadline:
                self.expire(lk, now)
            else:
                upcoming.append(lk.deadline)
        return min(upcoming, default=None)

    def renew(self, now: float) -> None:
        """Release the locks of ended blocks and lost leases; renew the others in one statement. A lease past
        its ``lease_max_runtime`` keeps no lock: a hung body cannot hold a resource."""
        with self._mutex:
            held = list(self.held.values())
        if not held:
            return
        for lk in held:
            if lk.done or lk.lease.lost:
                self.release(lk)
        live = [lk for lk in held if not lk.done and not lk.lost and lk.lease.renewable(now)]
        sent = deadline.monotonic()
        renewed = self.store.effects.renew_locks({lk.token: lk.ttl for lk in live}) if live else set()
        for lk in live:
            # A block that ended during the renewal released its own row.
            if lk.token in renewed:
                lk.confirm(sent)
                continue
            if lk.done:
                continue
            lk.lost = lk.done = True
            with self._mutex:
                self.held.pop(lk.token, None)
            lk.lease.mark_lost(f"resource lock {lk.resource!r} lost")
            self._lost(lk, "taken by another owner after it expired")
            # The job's own lease is still this process's in the store: give it back, as a local loss is.
            lk.lease.runtime.lost_locally(lk.lease, give_back=True)


@contextlib.contextmanager
def lock(lease: LeaseHandle, resource: str, ttl: float | None = None,
         timeout: float | None = None) -> Iterator[ResourceLock]:
    """``with lock(lease, "account:42"):`` hold a resource, waiting up to ``timeout`` seconds (LockUnavailable
    after); renewed by the heartbeat, released on exit, expiring after ``ttl`` if the process dies."""
    _check_key("lock resource", resource)
    if resource.startswith(RESERVED):
        raise ValueError(f"lock resource {resource!r}: names starting with {RESERVED!r} are reserved "
                         "(the reaper's own lock lives there)")
    ttl = lease.policy.lock_ttl if ttl is None else ttl
    ttl = lease.duration if ttl is None else float(ttl)
    timeout = lease.policy.lock_timeout if timeout is None else float(timeout)
    interval = lease.policy.heartbeat_interval
    if ttl < 2 * interval:
        raise LeaseConfigError("lease_lock_ttl", ttl, f"must be at least two heartbeat intervals "
                               f"({2 * interval:g}s): renewed every interval, a shorter lock would pass "
                               "its deadline before its next renewal lands")
    locks = lease.runtime.locks
    if locks.holds(lease.job_id, resource):
        raise LeaseError(f"job {lease.job_id} already holds the lock on {resource!r}; "
                         "locks are not re-entrant")
    held = ResourceLock(resource, secrets.token_hex(16), ttl, lease)
    taken = False
    try:
        # Shielded until the lock is listed: a loss held back during the acquisition lands after it, and
        # the finally releases the row it took rather than leave it held for its whole ttl.
        with uninterrupted():
            _acquire(lease, held, timeout)
            locks.add(held)
            taken = True
        yield held
    finally:
        if taken:
            locks.release(held)


def _acquire(lease: LeaseHandle, held: ResourceLock, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    delay = 0.02
    sent: list[float] = []
    interval = lease.policy.heartbeat_interval

    def attempt() -> EffectOutcome:
        # The send time of the statement that answers: the one whose expiry the row carries.
        sent.append(deadline.monotonic())
        try:
            return lease.store.effects.acquire_lock(held.resource, held.token, held.ttl, lease.worker,
                                                    lease.job_id, lease.token, interval)
        except StoreUnavailable as exc:
            _refuse_in_own_transaction(lease.store, exc, f"lock({held.resource!r})", "take it before")
            raise

    while True:
        lease.check()
        outcome = lease.patiently(attempt)
        if outcome == EffectOutcome.FIRST:
            held.confirm(sent[-1])
            if deadline.monotonic() < held.deadline:
                log.debug("job %s [%s]: lock %r [%s] taken", lease.job_id, lease.token[:8], held.resource,
                          held.token[:8], extra={"action": "lock_acquired"})
                return
            # Answered past the lock's local deadline: another job may hold it by now. Give the row back
            # (if still ours) and ask again, trusting nothing of this answer.
            lease.patiently(lambda: lease.store.effects.release_lock(held.resource, held.token))
            held.deadline = held.confirmed_at = float("-inf")
        if outcome == EffectOutcome.LOST and lease.vanished_and_recorded_again():
            continue  # the job's row is back under this lease: ask again
        if outcome == EffectOutcome.LOST:
            lease.mark_lost(f"lock {held.resource!r} refused: token no longer matches")
            lease.check()
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            raise LockUnavailable(held.resource, timeout)
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, MAX_POLL)
