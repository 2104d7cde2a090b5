"""The reaper: takes back leases nobody renews, re-sends lost messages, prunes old rows.

The message is published *before* the CAS, so a reaper that dies in between leaves an expired
lease (reaped next run), never a pending job without a message; and between the transaction that
reads a page and the one that writes it, so no transaction waits on the broker. A dead letter's row is
claimed (its token swapped for the reaper's) before the dead letter is sent, so none goes out for a job
its owner completes meanwhile.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from typing import Any

from celery import Task
from celery._state import connect_on_app_finalize

import celery_lease.messaging.events as events
import celery_lease.messaging.messages as messages
import celery_lease.reaper.decisions as decisions

from ..backoff import backoff, dispatch_wait
from ..config import REAPER_RUNS_KEPT, app_config, worker_stale_after
from ..errors import StoreCorrupt, StoreRejected, StoreUnavailable
from ..kinds import is_lease_task
from ..store import Job, Store, for_app
from ..vocabulary import Decision, RunMode, TaskEvent
from .clock_guard import ClockGuard, Hold
from .decisions import ReapDecision, ReapResult, decide, policy_for, publish_decision, settle
from .outcomes import report_failure

__all__ = ["Reaper", "ReapResult", "ReapDecision", "backoff", "decide", "policy_for", "publish_decision",
           "settle", "reap", "register", "REAP"]

log = logging.getLogger("celery_lease.reaper")

MAX_PAGES = 10  # keyset pages one run may walk past leases left to live owners
PRUNE_CHUNK = 1000  # rows deleted per statement
PRUNE_CHUNKS = 10  # statements per table per run
WORKER_PRUNE_FACTOR = 10  # registry rows go after 10 x lease_worker_stale_after unseen


class Reaper:
    """One reaper of an app: ``run_once()`` is a round, ``run_forever()`` the thin loop."""

    def __init__(self, app: Any, store: Store | None = None, *, batch_size: int | None = None,
                 rng: Any = None) -> None:
        self.app = app
        self.store: Store = store or for_app(app)
        self.cfg = app_config(app)
        self.batch_size = batch_size or self.cfg.reaper_batch_size
        self.rng = rng or random.Random()
        self.guard = ClockGuard.for_app(app, self.cfg.clock_tolerance)

    @property
    def owner(self) -> str:
        return f"reaper@{socket.gethostname()}:{os.getpid()}"

    @property
    def node(self) -> str:
        """The node name of this reaper's task events (``celery_lease.reaper@<host>``)."""
        return events.node(events.REAPER)

    def run_once(self, now: float | None = None, dry_run: bool = False) -> ReapResult:
        """One round: recover expired leases, re-send lost dispatches, prune; returns the counts.

        The store's clock is read once and bound as a parameter: compared row by row, PostgreSQL's
        clock_timestamp() and MySQL's SYSDATE() (volatile) would read the whole status range.
        """
        result = ReapResult(dry_run=dry_run)
        try:
            return self._run(result, now, dry_run)
        except StoreUnavailable:
            self.guard.failed()
            raise

    def _run(self, result: ReapResult, now: float | None, dry_run: bool) -> ReapResult:
        # A ``now`` given by the caller is a simulated time: it says nothing of the store's clock.
        mono: tuple[float, float] | None = None
        if now is None:
            before = time.monotonic()
            now = self.store.now()
            after = time.monotonic()
            mono = ((before + after) / 2, (after - before) / 2)
        if dry_run:
            hold = self._judge(now, mono, record=False)
            self._recover_expired(result, now, hold, RunMode.DRY_RUN)
            self._redispatch(result, now, RunMode.DRY_RUN)
            self._prune(result, now, dry=True)
            return result
        token, ttl = secrets.token_hex(16), self.cfg.reaper_lock_ttl
        if not self.store.reaping.acquire_reaper_lock(token, self.owner, ttl):
            result.skipped = True
            log.debug("reaper run skipped: another reaper holds the lock")
            return result
        started = time.monotonic()
        try:
            hold = self._judge(now, mono, record=True)
            if (self._recover_expired(result, now, hold, RunMode.APPLY, token)
                    and self._redispatch(result, now, RunMode.APPLY, token)):
                self._prune(result, now)
        finally:
            try:
                self.store.reaping.release_reaper_lock(token)
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("reaper lock not released (it expires in %gs): %s", ttl, exc)
        self._record(result, time.monotonic() - started)
        if result.changed:
            log.info("reaper: %s", result.summary(), extra={"action": "reap"})
        return result

    def _judge(self, now: float, mono: tuple[float, float] | None, record: bool) -> Hold:
        """This run's hold (clock_guard.py); none for a simulated ``now``."""
        if mono is None:
            return Hold()
        return self.guard.judge(self.store, now, self.owner, worker_stale_after(self.app), record=record,
                                mono=mono)

    def _record(self, result: ReapResult, duration: float) -> None:
        """Note the run in the store (its liveness for `lease check`); a failure to note it is only logged."""
        counts = {k: v for k, v in result.as_dict().items() if type(v) is int}
        try:
            self.store.runs.record_reaper_run(duration, counts, self.owner, REAPER_RUNS_KEPT)
        except (StoreUnavailable, StoreRejected) as exc:
            log.warning("reaper run not recorded: %s", exc, extra={"action": "reap_record_failed"})

    def _still_ours(self, mode: RunMode, token: str) -> bool:
        """Whether this round may go on: a dry run holds no lock; an applying one renews its lock."""
        if mode is RunMode.DRY_RUN or self.store.reaping.renew_reaper_lock(token, self.cfg.reaper_lock_ttl):
            return True
        log.warning("reaper lock lost mid-run (another reaper took it after %gs); stopping",
                    self.cfg.reaper_lock_ttl)
        return False

    def _recover_expired(self, result: ReapResult, now: float, hold: Hold, mode: RunMode,
                         token: str = "") -> bool:
        budget, after, dry = self.batch_size, None, mode is RunMode.DRY_RUN
        for _ in range(MAX_PAGES):
            # Read, publish, then write: no transaction is open while the broker is asked (on SQLite one
            # would hold the file's write lock, and every worker's heartbeat, through a silent broker).
            with self.store.begin(long=True, read=True) as c:
                page = self.store.reaping.scan_expired(c, limit=self.batch_size, after=after, now=now,
                                                       lock=False)
            alive: list[tuple[Job, str]] = []
            taken: list[tuple[Job, ReapDecision, str | None]] = []
            for item in page:
                if budget == 0:
                    break
                job = item.job
                after = item.keyset
                result.seen += 1
                if not item.reapable:
                    result.skipped_owner_alive += 1
                    why = f"lease expired but owner {job.locked_by} is alive; waiting for the hard grace"
                    if dry:
                        result.planned.append(ReapDecision(job.id, job.task_name, Decision.SKIP_OWNER_ALIVE,
                                                           why, job.locked_by))
                    else:
                        alive.append((job, why))
                    continue
                policy = policy_for(self.app, job)
                if hold.holds(now, job.lease_duration or policy.duration, policy.heartbeat_interval):
                    result.held_back += 1
                    if dry:
                        why = (f"lease expired, but the store was away or its clock stepped: owner "
                               f"{job.locked_by} gets a lease's time to renew")
                        result.planned.append(ReapDecision(job.id, job.task_name, Decision.HOLD_BACK,
                                                           why, job.locked_by))
                    continue
                budget -= 1
                why = ("lease expired past the hard grace, owner still registered" if item.owner_alive
                       else f"lease expired, owner {job.locked_by} gone")
                decision = decide(job, policy, why, self.rng)
                if dry:
                    result.planned.append(decision)
                    continue
                # A dead letter's row is claimed first: its owner cannot complete it while the dead letter
                # is out, and a second reaper's claim finds the token moved on.
                sends_dead_letter = decision.decision == Decision.DEAD_LETTER and decision.queue
                claim = secrets.token_hex(16) if sends_dead_letter else None
                try:
                    if claim and not self.store.reaping.claim_abandoned(job.id, job.lock_token or "", claim,
                                                                        self.owner, now, owner=job.locked_by):
                        result.lost_races += 1
                        continue
                except StoreUnavailable as exc:  # the page's messages already sent still get their writes
                    result.publish_errors += 1
                    log.error("job %s: could not claim it for its dead letter (%s); left for the next run",
                              job.id, exc, extra={"action": "reap_publish_failed"})
                    break
                try:
                    taken.append((job, publish_decision(self.app, job, decision), claim))
                except Exception as exc:  # noqa: BLE001 - broker down: stop publishing this run
                    result.publish_errors += 1
                    log.error("job %s [%s]: could not publish its message (%s); left expired for "
                              "the next run", job.id, (job.lock_token or "")[:8], exc,
                              extra={"action": "reap_publish_failed"})
                    if claim:
                        self._unclaim(job, claim)
                    break
            if alive or taken:
                self._take_back(result, now, alive, taken)
            if len(page) < self.batch_size or budget == 0 or result.publish_errors:
                return not result.publish_errors
            if not self._still_ours(mode, token):
                return False
        return True

    def _unclaim(self, job: Job, claim: str) -> None:
        """The dead letter was not sent: the row goes back to its owner's token and name, for the next run."""
        try:
            self.store.reaping.unclaim_abandoned(job.id, claim, job.lock_token or "", job.locked_by)
        except StoreUnavailable as exc:
            log.warning("job %s: could not give its row back after its dead letter was not sent (%s); the "
                        "next run dead-letters it under this reaper's claim", job.id, exc)

    def _take_back(self, result: ReapResult, now: float, alive: list[tuple[Job, str]],
                   taken: list[tuple[Job, ReapDecision, str | None]]) -> None:
        """One page's writes in one transaction: each take-back a CAS on the token and expiry the scan read
        (a lease renewed meanwhile is a lost race), then Celery and monitors are told what committed."""
        finals: list[tuple[Job, str]] = []
        moved: list[tuple[TaskEvent, dict[str, Any]]] = []
        with self.store.begin(long=True) as c:
            for job, why in alive:
                self.store.reaping.note_skipped_owner_alive(c, job, why)
            for job, decision, claim in taken:
                if not settle(self.store, job, decision, result, now=now, c=c, claim=claim):
                    continue
                if decision.decision == Decision.REQUEUE:
                    moved.append(events.retried(job.id, decision.reason, job.attempt_count))
                else:
                    finals.append((job, decision.reason))
                    moved.append(events.failed(job.id, job.task_name, decision.reason, job.attempt_count))
        for job, reason in finals:
            report_failure(self.app, job, reason)
        events.send(self.app, self.node, moved)

    def _dispatch_floor(self) -> float:
        """The shortest lease_dispatch_timeout any job may have: the scan's bound."""
        floors = [self.cfg.dispatch_timeout]
        floors += [p["lease_dispatch_timeout"] for p in self.cfg.queue_policies.values()
                   if "lease_dispatch_timeout" in p]
        floors += [t.lease_dispatch_timeout for t in list(self.app.tasks.values())
                   if getattr(t, "lease_dispatch_timeout", None)]
        return min(floors)

    def _redispatch(self, result: ReapResult, now: float | None, mode: RunMode, token: str = "") -> bool:
        budget, after, dry = self.batch_size, None, mode is RunMode.DRY_RUN
        floor, cap = self._dispatch_floor(), self.cfg.dispatch_backoff_max
        for _ in range(MAX_PAGES):
            with self.store.begin(long=True, read=True) as c:  # no transaction open while the broker is asked
                page = self.store.reaping.scan_lost_dispatches(c, older_than=floor, limit=self.batch_size,
                                                               after=after, now=now, lock=False,
                                                               backoff_max=cap)
            sent: list[tuple[Job, str]] = []
            broker_down = False
            for job, waited in page:
                if budget == 0:
                    break
                after = (job.available_at, job.id)
                timeout = policy_for(self.app, job).dispatch_timeout
                wait = dispatch_wait(timeout, job.dispatch_count, cap)
                if waited <= wait:
                    continue
                budget -= 1
                why = f"pending {waited:.1f}s past available_at (lease_dispatch_timeout {timeout:g}s"
                if job.dispatch_count:
                    why += f", doubled per re-send: {job.dispatch_count} so far, so {wait:g}s"
                why += ")"
                if dry:
                    result.planned.append(ReapDecision(job.id, job.task_name, Decision.REDISPATCH, why))
                    continue
                try:
                    messages.republish(self.app, job.id, job.payload)
                except StoreCorrupt as exc:
                    # Failed, as an expired lease's unreadable message is: left pending, it would head every
                    # scan and spend the budget of the lost dispatches that can be sent.
                    reason = f"lost dispatch cannot be re-sent: message unreadable: {exc}"
                    log.error("job %s: %s; failed", job.id, reason, extra={"action": "dead_lettered"})
                    if self.store.reaping.fail_undispatchable(job, reason):
                        result.failed += 1
                        report_failure(self.app, job, reason)
                    else:
                        result.lost_races += 1
                    continue
                except Exception as exc:  # noqa: BLE001 - broker down: stop publishing this run
                    result.publish_errors += 1
                    log.error("job %s: could not re-send its lost message (%s)", job.id, exc,
                              extra={"action": "redispatch_failed"})
                    broker_down = True
                    break
                decisions.after_publish(self.app, job.id)
                sent.append((job, why))
            if sent:
                # Each a CAS on what the scan read: one reaper counts a re-send.
                with self.store.begin(long=True) as c:
                    for job, why in sent:
                        if self.store.reaping.redispatched(job, why, c=c):
                            result.redispatched += 1
                        else:
                            result.lost_races += 1
            if broker_down:
                return False
            if len(page) < self.batch_size or budget == 0:
                return True
            if not self._still_ours(mode, token):
                return False
        return True

    def _prune(self, result: ReapResult, now: float | None, dry: bool = False) -> None:
        """Delete what outlived its retention, in chunks; ``dry``: count what this run would delete."""
        retention, store = self.cfg.retention, self.store
        stale = WORKER_PRUNE_FACTOR * worker_stale_after(self.app)
        for field, prune, age in (("pruned_jobs", store.reaping.prune_completed, retention),
                                  ("pruned_events", store.reaping.prune_events, retention),
                                  ("pruned_workers", store.reaping.prune_workers, stale),
                                  ("pruned_keys", store.reaping.prune_idempotency_keys,
                                   self.cfg.idempotency_retention)):
            if dry:
                setattr(result, field, prune(age, PRUNE_CHUNK * PRUNE_CHUNKS, now, dry=True))
                continue
            for _ in range(PRUNE_CHUNKS):
                deleted = prune(age, PRUNE_CHUNK, now)
                setattr(result, field, getattr(result, field) + deleted)
                if deleted < PRUNE_CHUNK:
                    break

    def run_forever(self, interval: float, stop: threading.Event | None = None) -> None:
        """Run rounds every ``interval`` seconds (at once again after a full batch) until ``stop``."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                result = self.run_once()
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("reaper round failed: %s", exc)
                result = ReapResult()
            full = result.reaped + result.dead_lettered + result.failed >= self.batch_size
            stop.wait(0 if full else interval)


REAP = "celery_lease.reap"


def reap(self: Task, dry_run: bool = False) -> dict[str, Any]:
    """One reaper round (schedule it with celery beat); its result is ignored: each run records itself."""
    return Reaper(self.app).run_once(dry_run=dry_run).as_dict()


def register(app: Any) -> None:
    """Register ``celery_lease.reap`` on an app that uses leases (once); a plain app never lists it."""
    # The registry itself, not app.tasks: this runs inside the app's finalize and a task's bind.
    if REAP in app._tasks:
        return
    if getattr(app._finalize_mutex, "_is_owned", lambda: False)():
        # Inside finalize, which may be iterating over the registry binding its tasks: once it is done.
        app.on_after_finalize.connect(_register_after_finalize, weak=False)
        return
    _register_now(app)


def _register_now(app: Any) -> None:
    if REAP not in app._tasks:
        app._task_from_fun(reap, name=REAP, base=Task, bind=True, ignore_result=True)


def _register_after_finalize(sender: Any = None, **_: Any) -> None:
    if sender is not None:
        _register_now(sender)


@connect_on_app_finalize
def _register_on_finalize(app: Any) -> None:
    # An app whose default task class is LeaseTask, or that sets lease_* settings (CELERY_LEASE_* under
    # Django's namespace); an app whose LeaseTasks name the class as their base registers it when they are
    # bound (LeaseTask.on_bound).
    settings = (str(key) for key in app.conf.keys())
    if is_lease_task(app.Task) or any(key.startswith(("lease_", "CELERY_LEASE_")) for key in settings):
        register(app)
