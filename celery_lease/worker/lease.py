"""Lease, the running job's handle: trusted until its local deadline (deadline.py), past which it is lost
whether or not the store answers, and never revived."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import celery_lease.deadline as deadline
import celery_lease.messaging.events as events
import celery_lease.messaging.messages as messages
import celery_lease.worker.checkpoints as checkpoints
import celery_lease.worker.effects as effects
import celery_lease.worker.interrupt as interrupt
import celery_lease.worker.locks as locks

from ..config import HEARTBEATS_PER_LEASE, TaskPolicy
from ..errors import LeaseLost, StoreRejected, StoreUnavailable
from ..vocabulary import Event, OnLost
from .handles import DeferredWrite, RuntimeHandle

__all__ = ["Lease", "DeferredWrite"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_STORE_WAIT = 1.0  # seconds between two tries of a body's store call while the store is down


class Lease:
    """The running job's lease: its token, attempt, checkpoint, deadline and fenced helpers."""

    def __init__(self, runtime: RuntimeHandle, job_id: str, token: str, attempt: int, policy: TaskPolicy,
                 idempotency_key: str, checkpoint_state: Any, *, sent_at: float, app: Any = None,
                 acks_late: bool = True, record_again: Callable[[], bool] | None = None,
                 soft_limit: interrupt.SoftLimit | None = None) -> None:
        self.runtime = runtime
        # Celery's soft time limit, held outside the body (the run's, from lifecycle.py).
        self.soft_limit = soft_limit or interrupt.SoftLimit(job_id)
        # Records the job anew under this lease's token when its row vanished (lifecycle.py).
        self._record_again = record_again
        self.store = runtime.store
        self.worker = runtime.worker
        self.app = app
        self._release_sent = False
        # Jobs the body published whose record the store did not answer (publishing.py).
        self.unsent: list[str] = []
        self.acks_late = acks_late
        self.job_id = job_id
        self.token = token
        self.attempt = attempt
        self.policy = policy
        self.duration = policy.duration
        self.idempotency_key = idempotency_key
        self.checkpoint_state = checkpoint_state
        self.lost = False
        self.lost_reason: str | None = None
        self.lost_owner: str | None = None
        self.started_at = deadline.monotonic()
        # The send time of the last statement the store confirmed (claim or renewal).
        self.confirmed_at = sent_at
        self.deadline = deadline.local_deadline(sent_at, self.duration)
        self.finishing = False
        # Set when the body handed the job on: Task.replace() or Task.retry() changed the row.
        self.handed_over = False
        self.retried = False
        # The retry's row is written, its message refused by the broker: Celery ends the run with a Reject.
        self.retry_unsent = False
        # The settle write the store could not take yet (Runtime.flush_deferred writes it).
        self.deferred: DeferredWrite | None = None
        # A checkpoint the store could not take yet: the heartbeat writes it once it answers.
        self.pending_checkpoint: tuple[Any] | None = None
        # One checkpoint write at a time, the body's or the heartbeat's: an older state never lands last.
        self.checkpoint_turn = threading.Lock()
        # A retry the store could not write yet: (due, monotonic; its message, sent once written).
        self.deferred_retry: tuple[float, str] | None = None
        self._in_body = False
        # The body got its LeaseLost (raised it itself, or the interruption went out): no other.
        self._raised = False
        self._shield = 0  # depth of the body's store calls under way (shielded())
        self._deferred = False  # an interruption came during one: raised when it ends
        self._interrupter = runtime.interrupter()
        self._guard = threading.Lock()
        # Held by a hand-over from its write until its flag is set, and by the heartbeat deciding a loss:
        # else the heartbeat could record a handed-over row again, or interrupt before its message is sent.
        self.turn = threading.RLock()

    def __repr__(self) -> str:
        return f"<Lease job={self.job_id} token={self.token[:8]} attempt={self.attempt}>"

    def check(self) -> None:
        """Raise LeaseLost if the lease moved on or its local deadline passed."""
        if not self.lost:
            self.expire_if_due(deadline.monotonic())
        if self.lost:
            self.raising_in_body()
            raise self._lost_error()

    def _lost_error(self) -> LeaseLost:
        return LeaseLost(self.job_id, self.lost_reason or "lost", self.lost_owner)

    def raising_in_body(self) -> None:
        """Called just before the body's own thread raises LeaseLost, so a flagged but not yet sent
        interruption cannot land a second one in its except and finally blocks."""
        with self._guard:
            if self._in_body and self._interrupter.is_current():
                self._raised = True
                self._interrupter.cancel()

    def expire_if_due(self, now: float) -> bool:
        """Mark the lease lost if ``now`` is past its local deadline; True when it is lost."""
        if not self.lost and now >= self.deadline:
            overran = self.past_max_runtime(now)
            if overran:
                reason = f"past lease_max_runtime ({self.policy.max_runtime:g}s), no longer renewed"
            else:
                reason = (f"local deadline passed: no renewal confirmed for {now - self.confirmed_at:.1f}s "
                          f"of a {self.duration:g}s lease")
            self.mark_lost(reason)
            # An overrun lease is left to expire, so the reaper counts the expiration against the job.
            self.runtime.lost_locally(self, give_back=not overran)
        if not self.lost:
            # A resource lock held past its own local deadline: the body can no longer trust it.
            self.runtime.locks.expire_due(now, self)
        return self.lost

    def confirm(self, sent_at: float, duration: float | None = None, cap: float | None = None) -> bool:
        """The store renewed the lease with a statement sent at ``sent_at`` (for at most ``cap`` seconds, the
        duration that statement wrote); False if already lost."""
        with self._guard:
            if self.lost:
                return False  # never revived: the runtime gives it back instead
            self.confirmed_at = max(self.confirmed_at, sent_at)
            if duration is not None:  # an extend: the deadline may move earlier, as the store's expiry
                self.duration = duration
                self.deadline = deadline.local_deadline(sent_at, duration)
            else:
                held = self.duration if cap is None else min(self.duration, cap)
                self.deadline = max(self.deadline, deadline.local_deadline(sent_at, held))
            return True

    @property
    def renew_every(self) -> float:
        """Seconds between the renewals this lease needs: its policy's, fewer under a short extend()."""
        return min(self.policy.heartbeat_interval, self.duration / HEARTBEATS_PER_LEASE)

    def extending(self, sent_at: float, duration: float) -> None:
        """An ``extend`` to ``duration`` is being sent: until answered, trust the shorter lease, so a lost
        answer cannot leave the deadline past the store's expiry."""
        with self._guard:
            if duration < self.duration:
                self.duration = duration
                self.deadline = min(self.deadline, deadline.local_deadline(sent_at, duration))

    def past_max_runtime(self, now: float) -> bool:
        limit = self.policy.max_runtime
        return limit is not None and now - self.started_at > limit

    def renewable(self, now: float) -> bool:
        """Still to be renewed: not lost and within lease_max_runtime."""
        return not self.lost and not self.past_max_runtime(now)

    def extend(self, seconds: float) -> None:
        """Renew now for ``seconds`` (on both clocks, and at each heartbeat from then on), before a long
        blocking call; below the lease's duration this shortens it. LeaseLost if the lease moved on."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"extend() takes a number of seconds > 0, got {seconds!r}")
        self.check()
        if not self.runtime.extend(self, seconds):
            self.check()

    def checkpoint(self, state: Any) -> None:
        """Save JSON progress for a later attempt; kept for the heartbeat while the store is down."""
        checkpoints.checkpoint(self, state)

    def recorded_again(self) -> bool:
        """The job's row vanished: record it again under this lease's token; True when it is ours again. The
        vanished row's renewals then count no more: the new row holds the claim's duration (an extend is
        written again by the next heartbeat), counted from no earlier than this record's send."""
        sent = deadline.monotonic()
        if not checkpoints.recorded_again(self, self._record_again):
            return False
        with self._guard:
            held = min(self.duration, self.policy.duration)
            self.deadline = min(self.deadline, deadline.local_deadline(sent, held))
        self.runtime.timer.watch(self.deadline)
        return True

    def send_if_pending(self) -> bool:
        """After a deferred write the store refused as stale: send a pending job's message again."""
        return checkpoints.send_if_pending(self)

    def vanished_and_recorded_again(self) -> bool:
        """After a fenced write changed nothing: whether the row had vanished and is ours again now."""
        return checkpoints.vanished_and_recorded_again(self, self._record_again)

    def write_pending_checkpoint(self) -> None:
        """The heartbeat's part: write the checkpoint an outage held back (StoreUnavailable if still down)."""
        checkpoints.write_pending_checkpoint(self)

    def patiently(self, call: Callable[[], _T]) -> _T:
        """Make a body's store call, waiting through an outage until the local deadline (then LeaseLost)."""
        delay = 0.05
        while True:
            self.check()
            try:
                return call()
            except StoreUnavailable as exc:
                log.warning("job %s [%s]: store unreachable (%s); waiting for it until the lease's local "
                            "deadline", self.job_id, self.token[:8], exc, extra={"action": "store_waited"})
            remaining = self.deadline - deadline.monotonic()
            time.sleep(max(0.0, min(delay, remaining)))
            delay = min(delay * 2, MAX_STORE_WAIT)

    def effect(self, key: str, connection: Any = None, using: str | None = None) -> Any:
        """``with lease.effect(key) as first:``; ``using`` or ``connection``: the key joins that
        transaction."""
        if using is not None:
            connection = effects.connection_for(using)
        return effects.effect(self, key, connection)

    def lock(self, resource: str, ttl: float | None = None, timeout: float | None = None) -> Any:
        """``with lease.lock(resource):`` a lease on a business resource."""
        return locks.lock(self, resource, ttl, timeout)

    def give_back(self, reason: Event = Event.RELEASED_ON_SHUTDOWN, republish: bool | None = None) -> bool:
        """Release the lease so the job runs again soon, re-sending its message when the broker forgot it
        (``republish`` defaults to acks_late off)."""
        # A try whose answer was lost may have released the job: asked before a second release would
        # find the row moved on (by itself) and leave it pending with no message.
        if not (self._release_sent and self.store.jobs.wrote(self.job_id, self.token, reason)):
            self._release_sent = True
            if not self.store.jobs.release(self.job_id, self.token, self.worker, reason):
                return False
        if reason == Event.RELEASED_ON_SHUTDOWN:
            events.send(self.app, self.runtime.hostname,
                        [events.retried(self.job_id, events.RELEASED_ON_SHUTDOWN, self.attempt)])
        if (not self.acks_late if republish is None else republish) and self.app is not None:
            job = self.store.get(self.job_id)
            if job is None and self.recorded_again() and self.store.jobs.release(self.job_id, self.token,
                                                                             self.worker, reason):
                job = self.store.get(self.job_id)  # vanished once released: recorded again, released again
            try:
                messages.republish(self.app, self.job_id, job.payload if job else None)
            except Exception as exc:  # noqa: BLE001 - the dispatch scan re-sends it later
                log.warning("job %s released but not re-sent (%s); the reaper will re-dispatch it",
                            self.job_id, exc, extra={"action": "release_republish_failed"})
        return True

    def forget_unsent(self) -> None:
        """Delete the jobs the body published unanswered, whose records may have committed with their
        messages never sent: the body was told they were not published (after an outage give-back, its
        next run publishes them anew), as a failed send deletes its record."""
        while self.unsent:
            job_id = self.unsent[0]
            if self.store.publishes.forget_unpublished(job_id):
                log.info("job %s: published by job %s's body unanswered and never sent; deleted", job_id,
                         self.job_id, extra={"action": "unsent_job_forgotten"})
            self.unsent.pop(0)

    def settle_unsent(self) -> None:
        """A body that went on past an unanswered publish has ended: forget what it was told is unsent; a
        store still away leaves those jobs to the dispatch scan."""
        try:
            self.forget_unsent()
        except (StoreUnavailable, StoreRejected) as exc:
            log.warning("job %s: jobs its body was told are unpublished (%s) left to the dispatch scan: %s",
                        self.job_id, ", ".join(self.unsent), exc, extra={"action": "unsent_job_kept"})

    def mark_lost(self, reason: str, owner: str | None = None) -> None:
        """Flag the lease lost; with ``lease_on_lost='raise'`` interrupt the body too."""
        with self._guard:
            if self.lost:
                return
            self.lost, self.lost_reason, self.lost_owner = True, reason, owner
            log.warning("lease on job %s [%s] lost: %s%s", self.job_id, self.token[:8], reason,
                        f" (now held by {owner})" if owner else "", extra={"action": "lease_lost"})
            if self.policy.on_lost == OnLost.RAISE and self._in_body:
                self._interrupter.interrupt(LeaseLost(self.job_id, reason, owner), self._still_running)

    def _still_running(self) -> bool:
        """Whether the interrupter may raise in the body now; inside a store call it defers."""
        running = self._in_body and not self.finishing and not self._raised
        if running and self._shield:
            self._deferred = True
            return False
        # The body's one LeaseLost: its handlers' store calls (a key given back, a lock released) run.
        self._raised = self._raised or running
        return running

    def _interruption_due(self) -> bool:
        return (self.lost and self.policy.on_lost == OnLost.RAISE and self._in_body and not self.finishing
                and not self._raised)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """A store call of the body: an interruption waits until it ends, then raises LeaseLost. Not the body
        (another thread with a copied context): nothing is deferred or raised."""
        if not self._interrupter.is_current():
            yield
            return
        with self._guard:
            lost_already = self._interruption_due()
            if lost_already:
                self._raised = True
                self._interrupter.cancel()
            else:
                self._shield += 1
        if lost_already:
            raise self._lost_error()
        try:
            yield
        finally:
            with self._guard:
                self._shield -= 1
                due = not self._shield and self._deferred and self._interruption_due()
                if not self._shield:
                    self._deferred = False
                if due:
                    self._raised = True
            if due:
                raise self._lost_error()

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """Mark the task body as running so a lost lease may interrupt it."""
        # Set first and reset in the finally: an interruption may land as soon as _in_body is.
        body = interrupt.BODY.set(self)
        try:
            now = deadline.monotonic()
            if not self.lost and now >= self.deadline:  # no lock is held yet: only the lease's own deadline
                self.expire_if_due(now)
            with self._guard:
                self._interrupter.bind()
                self._in_body = True
                # Lost before the body began (a STARTED state stored slowly, a pause): no interruption
                # comes for it, and the job may be another worker's already, so the body never starts.
                lost_already = self._interruption_due()
                self._raised = self._raised or lost_already
            self.soft_limit.release()
            if lost_already:
                raise self._lost_error()
            yield
        finally:
            interrupt.BODY.reset(body)
            with self._guard:
                self._in_body = False
                self.finishing = True
                if self.lost and self.policy.on_lost == OnLost.RAISE:
                    # An interruption queued as the body returned must not land in the bookkeeping.
                    self._interrupter.cancel()
            # Last, once no interruption can land here; inside the body's try, so a soft time limit
            # arriving before it fails the run rather than cut its settle short.
            self.soft_limit.hold()
