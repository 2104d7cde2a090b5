"""A pool child died under a job: the worker's main process applies the reaper's decision at once,
long before the lease would expire."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import celery_lease.messaging.messages as messages
import celery_lease.reaper.decisions as decisions

from ..errors import StoreCorrupt
from ..store import PENDING, RUNNING, Job, Store, for_app
from ..vocabulary import Decision, Event, WorkerLostOutcome
from .decisions import ReapDecision, ReapResult, decide, policy_for, publish_decision, settle

__all__ = ["recover_worker_lost", "complete_worker_lost"]

log = logging.getLogger(__name__)


def recover_worker_lost(app: Any, job_id: str, owner: str, reason: str, final: bool = False,
                        resend: bool = True) -> WorkerLostOutcome:
    """Recover a job whose child died, if still running under ``owner``: ``final`` (a hard time limit)
    fails it; ``resend=False`` when Celery requeued the message itself, so only the row moves."""
    store = for_app(app)
    job = store.get(job_id)
    if not final and job is not None and job.status == PENDING and _given_back_by(store, job_id, owner):
        return _resend_given_back(app, job, owner, reason, resend)
    if job is None or job.status != RUNNING or job.locked_by != owner or not job.lock_token:
        if not final and job is not None and (job.status == RUNNING or (
                job.status == PENDING and _moved_on_by_lease(store, job_id))):
            # Taken back already (the reaper, another worker's takeover, a give-back), its message sent
            # again: the lease runs it, so Celery is told of no failure, as when the take-back lands a moment
            # later. A job never claimed is Celery's to requeue or fail, as a plain task's.
            return WorkerLostOutcome.LOST_RACE
        return WorkerLostOutcome.NONE
    policy = policy_for(app, job)
    if final:
        why = f"worker process lost: {reason}; a final failure"
        kind = Decision.DEAD_LETTER if policy.dead_letter_queue else Decision.FAIL
        decision = ReapDecision(job.id, job.task_name, kind, why, job.locked_by, 0.0,
                                policy.dead_letter_queue)
    else:
        decision = decide(job, policy, f"worker process lost: {reason}")
    if decision.decision == Decision.REQUEUE:
        return _requeue_lost(app, store, job, decision, owner, reason, resend)
    try:
        decision = publish_decision(app, job, decision)
    except Exception as exc:  # noqa: BLE001 - broker down: the reaper recovers it after expiry
        if not final:
            log.error("job %s [%s]: child %s lost but its message could not be re-sent (%s); the reaper "
                      "will recover it after the lease expires", job_id, job.lock_token[:8], owner, exc,
                      extra={"action": "worker_lost_publish_failed"})
            return WorkerLostOutcome.ERROR
        # A final failure stays final: left running, the reaper would later requeue a job Celery failed.
        log.error("job %s [%s]: its dead letter could not be sent (%s); failed in the store, where "
                  "`lease dlq` lists it", job_id, job.lock_token[:8], exc,
                  extra={"action": "worker_lost_publish_failed"})
        decision = dataclasses.replace(decision, queue=None,
                                       reason=f"{decision.reason}; dead letter not sent: {exc}")
    if not settle(store, job, decision, ReapResult(), expired=False):
        return WorkerLostOutcome.LOST_RACE
    log.info("job %s [%s]: worker process %s lost (%s): %s", job_id, job.lock_token[:8], owner, reason,
             decision.decision, extra={"action": "worker_lost_recovered"})
    return WorkerLostOutcome(decision.decision)


def _moved_on_by_lease(store: Store, job_id: str) -> bool:
    """Whether a pending job was made pending by the lease (any event past its publish): never claimed, it
    has none, since a first claim writes no event of its own."""
    return any(event["event"] != Event.PUBLISHED for event in store.reports.events(job_id))


def _given_back_by(store: Store, job_id: str, owner: str) -> bool:
    """Whether the job's last give-back on shutdown was ``owner``'s (its row is pending since)."""
    released = store.reports.events(job_id, Event.RELEASED_ON_SHUTDOWN)
    return bool(released) and released[-1]["worker"] == owner


def _resend_given_back(app: Any, job: Job, owner: str, reason: str, resend: bool) -> WorkerLostOutcome:
    """A child that shut down on its own (a SIGTERM to it, or to the worker's process group) gave its job
    back for the broker to deliver again; Celery acks that delivery as lost, so the lease sends it again. A
    task without acks_late had its message sent again by the child's give-back already."""
    task = app.tasks.get(job.task_name)
    if resend and task is not None and task.acks_late:
        try:
            messages.republish(app, job.id, job.payload)
        except Exception as exc:  # noqa: BLE001 - broker down: the dispatch scan re-sends it
            log.error("job %s: child %s shut down and gave it back, its message could not be sent (%s); the "
                      "reaper re-dispatches it after lease_dispatch_timeout", job.id, owner, exc,
                      extra={"action": "worker_lost_publish_failed"})
            return WorkerLostOutcome.ERROR
    log.info("job %s: worker process %s shut down (%s) after giving it back: sent again", job.id, owner,
             reason, extra={"action": "worker_lost_recovered"})
    return WorkerLostOutcome.REQUEUE


def complete_worker_lost(app: Any, job_id: str, owner: str, reason: str) -> WorkerLostOutcome:
    """Complete a job whose child died after Celery stored its SUCCESS, if still running under ``owner``: the
    body returned, but its completion waited for the store (deferred) when the child died."""
    store = for_app(app)
    job = store.get(job_id)
    if job is None or job.status != RUNNING or job.locked_by != owner or not job.lock_token:
        return WorkerLostOutcome.NONE
    if not store.jobs.complete(job_id, job.lock_token, owner):
        return WorkerLostOutcome.LOST_RACE
    log.warning("job %s [%s]: worker process %s lost (%s) after Celery stored its SUCCESS: completed, not "
                "run again", job_id, job.lock_token[:8], owner, reason,
                extra={"action": "worker_lost_recovered"})
    return WorkerLostOutcome.COMPLETED


def _requeue_lost(app: Any, store: Store, job: Job, decision: ReapDecision, owner: str,
                  reason: str, resend: bool = True) -> WorkerLostOutcome:
    """Requeue a dead child's job: the row first, then its message, so no delivery finds it busy."""
    try:
        messages.decode(job.payload, app.conf.accept_content, job.id)
    except StoreCorrupt as exc:
        decision = dataclasses.replace(decision, decision=Decision.FAIL, queue=None,
                                       reason=f"{decision.reason}; message unreadable: {exc}")
    if not settle(store, job, decision, ReapResult(), expired=False):
        return WorkerLostOutcome.LOST_RACE
    if decision.decision != Decision.REQUEUE or not resend:
        return WorkerLostOutcome(decision.decision)
    try:
        messages.republish(app, job.id, job.payload, countdown=decision.delay)
    except Exception as exc:  # noqa: BLE001 - broker down: the dispatch scan re-sends it
        log.error("job %s: child %s lost, job requeued but its message could not be sent (%s); the reaper "
                  "re-dispatches it after lease_dispatch_timeout", job.id, owner, exc,
                  extra={"action": "worker_lost_publish_failed"})
        return WorkerLostOutcome.ERROR
    decisions.after_publish(app, job.id)  # the reaper's test seam
    log.info("job %s [%s]: worker process %s lost (%s): %s", job.id, (job.lock_token or "")[:8], owner,
             reason, decision.decision, extra={"action": "worker_lost_recovered"})
    return WorkerLostOutcome(decision.decision)
