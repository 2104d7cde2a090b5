"""What the reaper does with one expired job: its policy, the decision, the message, the CAS.

Shared by the reaper's runs (run.py) and a lost child's recovery (worker_lost.py).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import celery_lease.messaging.messages as messages

from ..app_state import app_state
from ..backoff import backoff
from ..config import TaskPolicy, app_config, task_policy
from ..errors import StoreCorrupt
from ..store import Job, Store
from ..vocabulary import Decision

__all__ = ["ReapDecision", "ReapResult", "after_publish", "decide", "policy_for", "publish_decision",
           "settle"]

log = logging.getLogger("celery_lease.reaper")


def after_publish(app: Any, job_id: str) -> None:
    """The test seam (``AppState.after_publish``): called after a job's message is sent, before the CAS."""
    seam = app_state(app).after_publish
    if seam is not None:
        seam(job_id)


@dataclasses.dataclass(frozen=True)
class ReapDecision:
    """What the reaper does (or, in a dry run, would do) with one job: its Decision and why."""

    job_id: str
    task: str
    decision: Decision
    reason: str
    owner: str | None = None
    delay: float = 0.0
    queue: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ReapResult:
    """The counts of one run; ``skipped`` when another reaper held the lock."""

    seen: int = 0
    reaped: int = 0
    dead_lettered: int = 0
    failed: int = 0
    redispatched: int = 0
    skipped_owner_alive: int = 0
    held_back: int = 0  # expired leases left alone while the store's hold lasts (clock_guard.py)
    lost_races: int = 0
    publish_errors: int = 0
    pruned_jobs: int = 0
    pruned_events: int = 0
    pruned_workers: int = 0
    pruned_keys: int = 0
    skipped: bool = False
    dry_run: bool = False
    planned: list[ReapDecision] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any((self.reaped, self.dead_lettered, self.failed, self.redispatched, self.publish_errors,
                    self.pruned_jobs, self.pruned_events, self.pruned_workers, self.pruned_keys))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"seen={self.seen} reaped={self.reaped} dead_lettered={self.dead_lettered} "
                f"failed={self.failed} redispatched={self.redispatched} "
                f"skipped_owner_alive={self.skipped_owner_alive} held_back={self.held_back} "
                f"lost_races={self.lost_races} "
                f"publish_errors={self.publish_errors} pruned={self.pruned_jobs}/{self.pruned_events}/"
                f"{self.pruned_workers}/{self.pruned_keys}")


def policy_for(app: Any, job: Job) -> TaskPolicy:
    """The job's recovery policy: its row's (a reaper may not import the task), else its task's or app's."""
    task = app.tasks.get(job.task_name)
    base = task_policy(task, job.queue_name) if task is not None else app_config(app).policy(
        queue=job.queue_name)
    carried = job.recovery()
    return dataclasses.replace(base, **carried) if carried else base


def decide(job: Job, policy: TaskPolicy, why: str, rng: Any = random) -> ReapDecision:
    """Requeue with backoff while attempts and expirations last, else dead-letter (or fail)."""
    if policy.on_expired == Decision.FAIL:
        kind, reason = Decision.FAIL, f"{why}; lease_on_expired='fail'"
    elif policy.on_expired == Decision.DEAD_LETTER:
        kind, reason = Decision.DEAD_LETTER, f"{why}; lease_on_expired='dead_letter'"
    elif job.attempt_count >= job.max_attempts:
        # The row's max_attempts is the one the claim's takeover checks: both must agree.
        kind, reason = Decision.DEAD_LETTER, "lease expired and max attempts reached"
    elif job.expired_count >= policy.max_expirations:
        kind, reason = Decision.DEAD_LETTER, "lease expired and max lease expirations reached"
    else:
        delay = backoff(job.attempt_count, policy.backoff_base, policy.backoff_max, policy.backoff_jitter,
                        rng)
        return ReapDecision(job.id, job.task_name, Decision.REQUEUE, why, job.locked_by, delay,
                            job.queue_name)
    queue = policy.dead_letter_queue if kind == Decision.DEAD_LETTER else None
    return ReapDecision(job.id, job.task_name, kind, reason, job.locked_by, 0.0, queue)


def publish_decision(app: Any, job: Job, decision: ReapDecision) -> ReapDecision:
    """Send the job's message for a decision (before its CAS); an unreadable message turns it to ``fail``."""
    kind = decision.decision
    if kind == Decision.FAIL or (kind == Decision.DEAD_LETTER and not decision.queue):
        return decision
    try:
        messages.republish(app, job.id, job.payload, countdown=decision.delay,
                           queue=decision.queue if decision.decision == Decision.DEAD_LETTER else None)
    except StoreCorrupt as exc:
        return dataclasses.replace(decision, decision=Decision.FAIL, queue=None,
                                   reason=f"{decision.reason}; message unreadable: {exc}")
    after_publish(app, job.id)
    return decision


def settle(store: Store, job: Job, decision: ReapDecision, result: ReapResult, *, expired: bool = True,
           now: float | None = None, c: Any = None, claim: str | None = None) -> bool:
    """The CAS on the token read with the row, or on the reaper's ``claim`` of it (a dead letter's); a lost
    race writes nothing and is only counted."""
    kind, token = decision.decision, job.lock_token or ""
    detail: dict[str, Any] = {"attempt": job.attempt_count, "expired_count": job.expired_count + 1}
    if kind == Decision.REQUEUE:
        won = store.reaping.requeue_abandoned(job.id, token, job.locked_by, delay=decision.delay,
                                              reason=decision.reason, expired=expired, now=now, detail=detail,
                                              c=c)
    else:
        if decision.queue:
            detail["published_to"] = decision.queue
        won = store.reaping.dead_letter_abandoned(job.id, claim or token, job.locked_by,
                                                  error=decision.reason, expired=expired, now=now,
                                                  detail=detail, c=c, shown=token if claim else None)
    if not won:
        result.lost_races += 1
        log.debug("job %s [%s]: %s lost the race, the row moved on", job.id, token[:8], kind)
    elif kind == Decision.REQUEUE:
        result.reaped += 1
        log.debug("job %s [%s] requeued in %.2fs: %s", job.id, token[:8], decision.delay, decision.reason,
                  extra={"action": "reaped_expired_lease"})
    else:
        if kind == Decision.FAIL:
            result.failed += 1
        else:
            result.dead_lettered += 1
        log.warning("job %s [%s] of %s dead-lettered: %s", job.id, token[:8], job.task_name, decision.reason,
                    extra={"action": "dead_lettered"})
    return won
