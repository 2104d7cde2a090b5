"""Resource locks held under a job's lease: each under its own token, renewed by the heartbeat, trusted by
its holder only until its local deadline, released when its block ends."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import celery_lease.deadline as deadline

from ..errors import LeaseConfigError, LeaseError, LeaseLost, LockUnavailable, StoreRejected, StoreUnavailable
from ..store.base import uninterrupted
from ..vocabulary import EffectOutcome, Event
from .effects import check_key, refuse_in_own_transaction
from .handles import LeaseHandle

__all__ = ["lock", "ResourceLock", "Locks"]

log = logging.getLogger(__name__)

MAX_POLL = 0.5  # seconds between two tries of a held lock, at most
RESERVED = "celery_lease."  # lock names of the library itself (store.reaping.REAPER_LOCK)


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
    check_key("lock resource", resource)
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
            refuse_in_own_transaction(lease.store, exc, f"lock({held.resource!r})", "take it before")
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
