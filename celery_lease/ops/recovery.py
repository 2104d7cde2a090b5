"""Manual recovery: requeue abandoned leases, redrive or discard dead letters, forget effect keys.

The row changes before the message is re-published: a message that arrived while the old lease
stood would be skipped as a duplicate, leaving a pending job with no message.
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
import socket
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import celery_lease.messaging.events as events
import celery_lease.messaging.messages as messages

from ..errors import JobNotFound, LeaseError, StoreCorrupt
from ..reaper.clock_guard import Hold
from ..reaper.decisions import policy_for
from ..store import COMPLETED, FAILED, PENDING, RUNNING, Job, Store
from ..vocabulary import DeadLetterAction, RecoveryAction

__all__ = ["RecoveryRefused", "AmbiguousJobId", "Outcome", "operator", "resolve_job_id", "requeue_plan",
           "requeue", "redrive_plan", "redrive", "discard_plan", "discard", "dead_letter_plan",
           "recover_dead_letters", "stamp", "forget_plan", "forget"]

log = logging.getLogger(__name__)


class RecoveryRefused(LeaseError):
    """A manual recovery was refused because it could run a job twice or has nothing to do."""

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(message, job_id=job_id)


class AmbiguousJobId(LeaseError):
    """A job id prefix matches more than one job."""

    def __init__(self, prefix: str, matches: list[str]) -> None:
        shown = ", ".join(matches[:PREFIX_MATCHES_SHOWN])
        if len(matches) > PREFIX_MATCHES_SHOWN:
            shown += ", ..."
        super().__init__(f"job id prefix {prefix!r} matches several jobs ({shown}); give more of the id",
                         job_id=prefix, matches=matches)


PREFIX_MATCHES_SHOWN = 10


def resolve_job_id(store: Store, text: str) -> str:
    """The id of the job ``text`` names: the id itself or a prefix unique among the store's ids. The id of a
    job deleted since (discarded, pruned) is no prefix: its events name it, and JobNotFound says so, where a
    re-run of a verb would otherwise act on another job whose id it begins."""
    if store.get(text) is not None:
        return text
    if text and store.reports.list_events(job_id=text, limit=1):
        raise JobNotFound(text)
    matches = store.reports.job_ids_starting(text, PREFIX_MATCHES_SHOWN + 1) if text else []
    if not matches:
        raise JobNotFound(text)
    if len(matches) > 1:
        raise AmbiguousJobId(text, matches)
    return matches[0]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one job: its action (requeued, redriven, discarded, skipped...) and why."""

    job_id: str
    task: str
    queue: str | None
    action: RecoveryAction
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def operator(via: str = "cli", user: str | None = None, host: str | None = None) -> str:
    """Who ran a manual recovery, for the audit log: ``via:user@host``."""
    if user is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown"
    return f"{via}:{user}@{host or socket.gethostname()}"


def _lease_state(store: Store, job: Job) -> str:
    """Why a lease still counts as live, in ages: the lease's expiry and the owner's last heartbeat."""
    now, seen = store.reports.workers_last_seen([job.locked_by] if job.locked_by else [])
    if job.lease_expires_at is None:
        lease = "its lease has no expiry"
    elif job.lease_expires_at > now:
        lease = f"its lease is valid for another {job.lease_expires_at - now:.1f}s"
    else:
        lease = f"its lease expired {now - job.lease_expires_at:.1f}s ago"
    last = seen.get(job.locked_by or "")
    owner = (f"owner {job.locked_by} never registered" if last is None
             else f"owner {job.locked_by} was last seen {now - last:.1f}s ago")
    return (f"{lease} and {owner} (a worker counts as gone after {store.stale_after:g}s without a "
            f"heartbeat; the reaper takes a lease {store.hard_grace:g}s past expiry regardless)")


def requeue_plan(app: Any, store: Store, job_id: str | None = None, expired: bool = False,
                 batch: int = 10, force: bool = False) -> list[Job]:
    """The jobs a ``requeue`` would move: one named job (refused when unsafe) or the oldest abandoned."""
    if job_id is None:
        if not expired:
            raise RecoveryRefused("", "name a job with --job ID or take expired leases with --expired")
        found = store.recovery.requeue_candidates(force, batch)
        return found if force else [job for job in found if _held_for(app, store, job) is None]
    job_id = resolve_job_id(store, job_id)
    job = store.reports.require(job_id)
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
    owned = _still_owned(app, store, job)
    if owned is not None:
        raise RecoveryRefused(job_id, (
            f"job {job_id} {owned}. Requeueing it may run it twice while its worker still works on it. Wait "
            f"for the reaper, check the owner (`celery lease inspect {job_id}`), or use --force if you know "
            "the owner is gone"))
    return [job]


def _still_owned(app: Any, store: Store, job: Job) -> str | None:
    """Why a running job's lease still counts as its owner's (live, or covered by the reaper's hold), or None
    when the reaper would take it now."""
    if not store.recovery.is_claimable_expired(job.id):
        return f"holds a live lease: {_lease_state(store, job)}"
    held = _held_for(app, store, job)
    if held is not None:
        return (f"has a lease that looks expired, but the store was away or its clock stepped (the reaper "
                f"holds back too): its owner may still run it for {held:.0f}s")
    return None


def _held_for(app: Any, store: Store, job: Job) -> float | None:
    """Seconds the reaper's hold still covers the job's owner (the reaper's rule: a lease and a heartbeat
    since the hold began), or None when it does not."""
    since = (store.reaping.reaper_clock() or {}).get("calm_since")
    if not isinstance(since, (int, float)):
        return None
    policy = policy_for(app, job)
    left = Hold(since).left(store.now(), job.lease_duration or policy.duration, policy.heartbeat_interval)
    return left or None


def _announce(app: Any, job: Job, reason: str, who: str) -> None:
    """``task-retried`` for a job an operator sent back to pending, from ``celery_lease.<via>@host``."""
    via = who.split(":", 1)[0] or "cli"
    events.send(app, events.node(f"celery_lease.{via}"), [events.retried(job.id, reason, job.attempt_count)])


def _unsendable(app: Any, job: Job) -> Outcome | None:
    """A job whose stored message cannot be sent again stays as it is: moved to pending, it would wait for
    a message nobody can send, and a dead letter would leave the list that shows it."""
    try:
        messages.check_sendable(app, job.id, job.payload)
    except StoreCorrupt as exc:
        fix = f"; discard it with `celery lease dlq discard --job {job.id}`" if job.status == FAILED else ""
        return Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.UNSENDABLE,
                       f"nothing changed: {exc}{fix}")
    return None


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


def requeue(app: Any, store: Store, jobs: Iterable[Job], force: bool = False,
            who: str | None = None, *, expired: bool = False) -> Iterator[Outcome]:
    """Requeue each job (CAS on its token; with ``expired``, a plan of expired leases, only while the lease
    is still expired), then re-publish its stored message."""
    who = who or operator()
    for job in jobs:
        if (unsendable := _unsendable(app, job)) is not None:
            yield unsendable
            continue
        if not store.recovery.manual_requeue(job, who, force, expired=expired):
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since it was read (renewed, finished or taken by someone else)")
            continue
        log.info("job %s [%s] requeued by %s%s", job.id, (job.lock_token or "")[:8], who,
                 " (forced)" if force else "", extra={"action": "manual_requeue"})
        _announce(app, job, f"requeued by {who}", who)
        yield _publish(app, job, RecoveryAction.REQUEUED)


def redrive_plan(store: Store, job_id: str | None = None, task: str | None = None,
                 batch: int = 10) -> list[Job]:
    """The dead letters a redrive would send back: one named job, or the oldest not revoked on purpose."""
    if job_id is None:
        return store.recovery.dead_letters(task, batch, include_revoked=False)
    return [_dead_letter(store, job_id, "redriven")]


def _dead_letter(store: Store, job_id: str, verb: str) -> Job:
    job = store.reports.require(resolve_job_id(store, job_id))
    if job.status != FAILED:
        raise RecoveryRefused(job.id, f"job {job.id} is {job.status}, not a dead letter; only failed "
                                      f"jobs can be {verb} (see `celery lease dlq list`)")
    return job


def redrive(app: Any, store: Store, jobs: Iterable[Job], who: str | None = None) -> Iterator[Outcome]:
    """Set each dead letter back to pending with fresh attempts, then re-publish its message."""
    who = who or operator()
    for job in jobs:
        if (unsendable := _unsendable(app, job)) is not None:
            yield unsendable
            continue
        if not store.recovery.redrive(job, who):
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since it was read")
            continue
        log.info("job %s redriven from the dead letters by %s", job.id, who, extra={"action": "dlq_redriven"})
        _announce(app, job, f"redriven from the dead letters by {who}", who)
        yield _publish(app, job, RecoveryAction.REDRIVEN)


def discard_plan(store: Store, job_id: str | None = None, task: str | None = None,
                 batch: int = 10) -> list[Job]:
    """The dead letters a discard would delete: one named job, or the oldest ``batch``."""
    if job_id is None:
        return store.recovery.dead_letters(task, batch)
    return [_dead_letter(store, job_id, "discarded")]


def discard(store: Store, jobs: Iterable[Job], who: str | None = None) -> Iterator[Outcome]:
    """Delete each dead letter (CAS on status and failed_at), audited dlq_discarded; no message is sent."""
    who = who or operator()
    for job in jobs:
        if not store.recovery.discard_dead_letter(job, who):
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since it was read")
            continue
        log.info("dead letter %s discarded by %s", job.id, who, extra={"action": "dlq_discarded"})
        yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.DISCARDED,
                      "deleted from the store")


def dead_letter_plan(store: Store, action: DeadLetterAction, job_ids: list[str] | None,
                     task: str | None = None, batch: int = 10) -> tuple[list[Job], list[str]]:
    """The dead letters ``action`` would move and, for named jobs that cannot be moved, why not."""
    plan = redrive_plan if action == DeadLetterAction.REDRIVE else discard_plan
    if job_ids is None:
        return plan(store, None, task, batch), []
    jobs, refused = [], []
    for job_id in job_ids:
        try:
            jobs += plan(store, job_id, None, batch)
        except LeaseError as exc:
            refused.append(" ".join(str(exc).split()))
    return jobs, refused


def stamp(job: Job) -> str:
    """The job as a plan showed it, carried by the confirmation: one changed since is not moved on it."""
    return repr(job.updated_at)


def recover_dead_letters(app: Any, store: Store, action: DeadLetterAction, jobs: Iterable[Job],
                         who: str, stamps: Mapping[str, str] | None = None) -> Iterator[Outcome]:
    """Redrive or discard planned dead letters; with a confirmation's ``stamps``, a job changed since its
    plan was shown (or not in it) is skipped."""
    jobs = list(jobs)
    if stamps is not None:
        changed = [job for job in jobs if stamp(job) != stamps.get(job.id)]
        for job in changed:
            yield Outcome(job.id, job.task_name, job.queue_name, RecoveryAction.SKIPPED,
                          "changed since the plan was shown")
        jobs = [job for job in jobs if job not in changed]
    if action == DeadLetterAction.REDRIVE:
        yield from redrive(app, store, jobs, who=who)
    else:
        yield from discard(store, jobs, who=who)


def forget_plan(app: Any, store: Store, key: str, force: bool = False) -> dict[str, Any]:
    """The effect key an ``effects forget`` would delete: its job and when it was recorded. Refused, unless
    ``force``, while that job holds a live lease: its worker may be inside the effect block."""
    found = store.reports.effect_record(key)
    if found is None:
        raise RecoveryRefused("", f"no effect key {key!r} in the lease store; a job's keys show with "
                                  "`celery lease inspect JOB`")
    job = store.get(found["job_id"])
    if force or job is None or job.status != RUNNING or (state := _still_owned(app, store, job)) is None:
        return found
    raise RecoveryRefused(job.id, (
        f"effect key {key!r} belongs to job {job.id}, which {state}. Its worker may be inside the effect "
        "block now, and with the key gone the effect could happen twice. Wait for the job to end or the "
        "reaper to take its lease, or use --force if you know the effect did not happen"))


def forget(store: Store, key: str, who: str | None = None, *, recorded: tuple[str, float] | None = None,
           force: bool = False) -> bool:
    """Delete an effect key, so that the next run of its effect happens again (audited effect_forgotten):
    only as ``recorded`` (the plan's job and time) and, unless ``force``, not under a live lease."""
    who = who or operator()
    done = store.recovery.forget_effect(key, reason=f"forgotten by {who}", recorded=recorded, live=force)
    if done:
        log.info("effect key %r forgotten by %s", key, who, extra={"action": "effect_forgotten"})
    return done
