"""Manual recovery: requeue abandoned leases and redrive dead letters, in small batches.

These are the operator's versions of the reaper's moves, with the same rules: a
lease is only taken when it expired past its grace and its owner is gone (unless
forced), every move is one compare-and-set, and each one is audited
(``manual_requeue``, ``dlq_redriven``). The row changes first and the stored
message is re-published after: a message that arrived while the old lease still
stood would be skipped as a duplicate and acknowledged, leaving a pending job
with no message. If the publish fails after the change, the job is pending and
the reaper re-dispatches it after ``lease_dispatch_timeout``; the outcome says so.
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
import socket
from collections.abc import Iterable, Iterator
from typing import Any

from . import messages
from .errors import LeaseError
from .store import COMPLETED, FAILED, PENDING, Job, ReportStore
from .vocabulary import RecoveryAction

__all__ = ["RecoveryRefused", "Outcome", "operator", "requeue_plan", "requeue", "redrive_plan", "redrive"]

log = logging.getLogger(__name__)


class RecoveryRefused(LeaseError):
    """A manual recovery was refused because it could run a job twice or has nothing to do."""

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(message, job_id=job_id)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one job: ``requeued``/``redriven``, ``skipped`` or ``publish_failed``."""

    job_id: str
    task: str
    queue: str | None
    action: RecoveryAction
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def operator() -> str:
    """Who ran a manual recovery, for the audit log."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def _lease_state(store: ReportStore, job: Job) -> str:
    now = store.now()
    if job.lease_expires_at is None:
        return "no lease expiry"
    left = job.lease_expires_at - now
    if left > 0:
        return f"lease valid for another {left:.1f}s"
    return f"lease expired {-left:.1f}s ago, within its grace period or its owner is alive"


def requeue_plan(app: Any, store: ReportStore, job_id: str | None = None, expired: bool = False,
                 batch: int = 10, force: bool = False) -> list[Job]:
    """The jobs a ``requeue`` would move: one named job (refused when that is unsafe) or up to
    ``batch`` abandoned leases, oldest first."""
    if job_id is None:
        if not expired:
            raise RecoveryRefused("", "name a job with --job ID or take expired leases with --expired")
        return store.requeue_candidates(force, batch)
    job = store.require(job_id)
    if job.status == COMPLETED:
        raise RecoveryRefused(job_id, f"job {job_id} is completed; there is nothing to requeue")
    if job.status == FAILED:
        raise RecoveryRefused(job_id, f"job {job_id} is a dead letter (failed); "
                                      f"use `celery lease dlq redrive --job {job_id}`")
    if force:
        return [job]
    if job.status == PENDING:
        raise RecoveryRefused(job_id, (
            f"job {job_id} is pending and waits for a worker; the reaper re-publishes it after "
            f"lease_dispatch_timeout. Use --force to re-publish its message now"))
    if not store.is_claimable_expired(job_id):
        raise RecoveryRefused(job_id, (
            f"job {job_id} holds a live lease (owner {job.locked_by}, {_lease_state(store, job)}); "
            "requeueing it may run it twice while its worker still works on it. Wait for the reaper, "
            "check the owner (`celery lease inspect`), or use --force if you know the owner is gone"))
    return [job]


def _publish(app: Any, job: Job, done: RecoveryAction) -> Outcome:
    try:
        messages.republish(app, job.id, job.payload)
    except Exception as exc:  # noqa: BLE001 - the row already moved: report any publish failure, go on

        log.error("job %s is pending but its message could not be sent: %s", job.id, exc,
                  extra={"action": "manual_publish_failed"})
        return Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.PUBLISH_FAILED,
                       f"pending, but its message could not be sent ({exc}); the reaper re-publishes it "
                       f"after lease_dispatch_timeout, or run `celery lease requeue --job {job.id} --force`")
    return Outcome(job.id, job.task_name, job.queue_name, done, "message re-published")


def requeue(app: Any, store: ReportStore, jobs: Iterable[Job], force: bool = False,
            who: str | None = None) -> Iterator[Outcome]:
    """Requeue each job (CAS on its token), then re-publish its stored message."""
    who = who or operator()
    for job in jobs:
        if not store.manual_requeue(job, who, force):
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since it was read (renewed, finished or taken by someone else)")
            continue
        log.info("job %s [%s] requeued by %s%s", job.id, (job.lock_token or "")[:8], who,
                 " (forced)" if force else "", extra={"action": "manual_requeue"})
        yield _publish(app, job, RecoveryAction.REQUEUED)


def redrive_plan(store: ReportStore, job_id: str | None = None, task: str | None = None,
                 batch: int = 10) -> list[Job]:
    """The dead letters a redrive would send back: one named job, or up to ``batch`` failed
    jobs (oldest first) that were not revoked on purpose."""
    if job_id is None:
        return store.dead_letters(task, batch, include_revoked=False)
    job = store.require(job_id)
    if job.status != FAILED:
        raise RecoveryRefused(job_id, f"job {job_id} is {job.status}, not a dead letter; only failed "
                                      "jobs can be redriven (see `celery lease dlq list`)")
    return [job]


def redrive(app: Any, store: ReportStore, jobs: Iterable[Job], who: str | None = None) -> Iterator[Outcome]:
    """Set each dead letter back to pending with fresh attempts, then re-publish its message."""
    who = who or operator()
    for job in jobs:
        if not store.redrive(job, who):
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since it was read")
            continue
        log.info("job %s redriven from the dead letters by %s", job.id, who, extra={"action": "dlq_redriven"})
        yield _publish(app, job, RecoveryAction.REDRIVEN)

