"""The names celery_lease stores and reports: statuses, outcomes, decisions, policy values, failure kinds,
modes and audit events.

Each is a ``str`` enum member equal to the string stored (``Status.RUNNING == "running"``), so existing
stores read the same; the groups at the bottom are built from the members, never from literals."""

from __future__ import annotations

import enum

__all__ = [
    "Name", "Status", "ClaimOutcome", "EffectOutcome", "Decision", "RecoveryAction", "Event", "RunEnd",
    "LossReason", "TaskEvent", "WorkerLostOutcome", "OnLost", "StoreFailure", "RunMode", "Severity",
    "DeadLetterAction", "CancelReason", "TimelineSource",
    "STALE_WRITES", "RELEASES", "RECOVERIES", "MANUAL_RECOVERIES", "REPLACEMENTS",
]


class Name(str, enum.Enum):
    """A stored name: ``str()`` and ``format()`` give its value, as for ``enum.StrEnum`` (3.11+)."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # typeshed's Enum.__format__ differs in name only


class Status(Name):
    """A job's status (the ``jobs.status`` column)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


class ClaimOutcome(Name):
    """What a claim found: the job is ours, leased by another, finished, or not available yet."""

    CLAIMED = "claimed"
    BUSY = "busy"
    DONE = "done"
    EARLY = "early"
    # A copy of a replaced run's message, after that run removed the row for a carrier not recorded yet.
    REPLACED = "replaced"


class EffectOutcome(Name):
    """What a fenced insert (effect key, resource lock) found: written, there already, or lease gone."""

    FIRST = "first"
    DUPLICATE = "duplicate"
    LOST = "lost"


class RunEnd(Name):
    """How a leased body ended: the settle step writes each one to the store its own way."""

    RETURNED = "returned"
    RETRIED = "retried"
    IGNORED = "ignored"
    REPLACED = "replaced"
    REJECTED_REQUEUE = "rejected_requeue"
    REJECTED = "rejected"
    FAILED = "failed"
    LOST = "lost"
    OUTAGE = "outage"
    SHUTDOWN = "shutdown"


class TimelineSource(Name):
    """Where an entry of a job's timeline comes from: a stored event row, or the job's row."""

    EVENT = "event"
    ROW = "row"


class CancelReason(Name):
    """Why a hook cancelled a job (``revoked (<reason>)`` in its last error): Celery revoked its
    delivery, the delivery expired, or ``revoke(terminate=True)`` ended its run."""

    REVOKED = "revoked"
    EXPIRED = "expired"
    TERMINATED = "terminated"


class OnLost(Name):
    """What a body sees when its lease is lost (``lease_on_lost``): LeaseLost raised in it, or a flag only."""

    RAISE = "raise"
    FLAG = "flag"


class LossReason(Name):
    """Why the store did not renew a lease (``describe_loss``): the row is gone or moved on."""

    VANISHED = "vanished"
    TAKEN_OVER = "taken_over"


class Decision(Name):
    """What the reaper does (or would do) with one job; the first three are ``lease_on_expired``'s values."""

    REQUEUE = "requeue"
    DEAD_LETTER = "dead_letter"
    FAIL = "fail"
    REDISPATCH = "redispatch"
    SKIP_OWNER_ALIVE = "skip_owner_alive"
    # After an outage or a clock step: its owner gets a lease's time to renew first.
    HOLD_BACK = "hold_back"


class WorkerLostOutcome(Name):
    """What settling a dead pool child's lease came to: a decision applied, or why none was."""

    REQUEUE = "requeue"
    DEAD_LETTER = "dead_letter"
    FAIL = "fail"
    # Another writer moved the row first: the CAS wrote nothing.
    LOST_RACE = "lost_race"
    # The message could not be re-sent: the reaper (or its dispatch scan) recovers the job.
    ERROR = "error"
    # Celery had stored the run's SUCCESS before the child died: the job completed, not run again.
    COMPLETED = "completed"
    # The store could not be asked: the lease expires and the reaper settles it.
    STORE_UNAVAILABLE = "store_unavailable"
    # Not this owner's running job (finished, taken over, never claimed): nothing to settle.
    NONE = "none"


class RunMode(Name):
    """How a reaper round runs: a dry run only reads and plans; applying takes the lock and writes."""

    DRY_RUN = "dry_run"
    APPLY = "apply"


class DeadLetterAction(Name):
    """What an operator asks of selected dead letters on the page and in the Django admin."""

    REDRIVE = "redrive"
    DISCARD = "discard"


class RecoveryAction(Name):
    """What a manual recovery (``lease requeue``, ``lease dlq redrive|discard``) did to one job."""

    REQUEUED = "requeued"
    REDRIVEN = "redriven"
    DISCARDED = "discarded"
    SKIPPED = "skipped"
    PUBLISH_FAILED = "publish_failed"
    UNSENDABLE = "unsendable"  # left as it was: its stored message cannot be read back


class Event(Name):
    """An audit event name (the ``events.event`` column); each one is written somewhere."""

    # A job's life, written by its worker.
    PUBLISHED = "published"
    # A finished job's task id published again by a caller (not a redelivery): it runs again.
    REPUBLISHED = "republished"
    # A publish under an idempotency key another job holds: answered with that job, nothing sent.
    KEYED_PUBLISH_ANSWERED = "keyed_publish_answered"
    CLAIMED = "claimed"
    LEASE_TAKEN_OVER = "lease_taken_over"
    # A worker's own claim whose answer it never got, taken back: neither a takeover nor a recovery.
    CLAIM_TAKEN_BACK = "claim_taken_back"
    COMPLETED = "completed"
    FAILED = "failed"
    RETRY_SCHEDULED = "retry_scheduled"
    CHECKPOINT = "checkpoint"
    REVOKED = "revoked"
    LEASE_LOST = "lease_lost"
    DEAD_LETTER_PUBLISHED = "dead_letter_published"
    # Task.replace(): the job's id passed to its replacement; or its lease ends (replacement not leased).
    HANDED_OVER = "handed_over"
    REPLACED = "replaced"
    # Leases given back before expiry: the release's reason is its event.
    RELEASED_ON_SHUTDOWN = "released_on_shutdown"
    REJECTED_REQUEUE = "rejected_requeue"
    # A lease this worker stopped trusting on its own clock, given back once the store answered.
    RELEASED_AFTER_LOCAL_LOSS = "released_after_local_loss"
    # A body that met an unreachable store where it could not wait: given back, attempt uncharged.
    RELEASED_AFTER_OUTAGE = "released_after_outage"
    # Deliveries whose body did not run.
    EARLY_DELIVERY_DEFERRED = "early_delivery_deferred"
    DUPLICATE_DELIVERY_SKIPPED = "duplicate_delivery_skipped"
    # A completed job whose result a crash kept from the backend: the kept result is stored.
    POST_RUN_RESUMED = "post_run_resumed"
    # Writes of a worker that had lost its lease, rejected by the token check.
    STALE_COMPLETION_REJECTED = "stale_completion_rejected"
    STALE_FAILURE_REJECTED = "stale_failure_rejected"
    STALE_RETRY_REJECTED = "stale_retry_rejected"
    STALE_RELEASE_REJECTED = "stale_release_rejected"
    STALE_CHECKPOINT_REJECTED = "stale_checkpoint_rejected"
    STALE_EFFECT_REJECTED = "stale_effect_rejected"
    STALE_LOCK_REJECTED = "stale_lock_rejected"
    # Effect keys and resource locks.
    EFFECT_RELEASED = "effect_released"
    EFFECT_UNCONFIRMED = "effect_unconfirmed"
    EFFECT_FORGOTTEN = "effect_forgotten"
    LOCK_TAKEN_AFTER_EXPIRY = "lock_taken_after_expiry"
    LOCK_LOST = "lock_lost"
    # The reaper.
    REAPED_EXPIRED_LEASE = "reaped_expired_lease"
    DEAD_LETTERED = "dead_lettered"
    # An abandoned lease held under the reaper's claim while its dead letter is sent.
    DEAD_LETTER_CLAIMED = "dead_letter_claimed"
    REAP_SKIPPED_OWNER_ALIVE = "reap_skipped_owner_alive"
    REDISPATCHED = "redispatched"
    # A gap in the store's history or a clock step: nothing taken back until owners could renew.
    REAPER_HELD_BACK = "reaper_held_back"
    # An operator.
    MANUAL_REQUEUE = "manual_requeue"
    DLQ_REDRIVEN = "dlq_redriven"
    DLQ_DISCARDED = "dlq_discarded"


class StoreFailure(Name):
    """What a store error was (``StoreUnavailable.kind``, ``StoreRejected.kind``): store/failures.py."""

    # Asks for a migration.
    MISSING = "missing"
    # Refusals: the store answered, and the same write would be refused again.
    CONFLICT = "conflict"
    CONSTRAINT = "constraint"
    PERMISSION = "permission"
    SYNTAX = "syntax"
    DATA = "data"
    # The caller's own transaction holds the SQLite file the store shares: waiting would wait on itself.
    LOCKED_BY_CALLER = "locked_by_caller"
    # Outages: the caller fails closed and retries.
    TIMEOUT = "timeout"
    POOL = "pool"
    UNREACHABLE = "unreachable"


class Severity(Name):
    """How bad a ``lease check`` finding is: an error fails the check, a warning is printed, ok passed."""

    ERROR = "error"
    WARNING = "warning"
    OK = "ok"


class TaskEvent(Name):
    """A Celery task event the lease sends for a move no worker reports (events.py)."""

    # Celery's own names: a custom type would rank above STARTED in Flower (states.precedence).
    FAILED = "task-failed"
    RETRIED = "task-retried"


#: Stale writes rejected by the token check, in the order metrics and the CLI list them.
STALE_WRITES: tuple[Event, ...] = (
    Event.STALE_COMPLETION_REJECTED, Event.STALE_FAILURE_REJECTED, Event.STALE_RETRY_REJECTED,
    Event.STALE_RELEASE_REJECTED, Event.STALE_CHECKPOINT_REJECTED, Event.STALE_EFFECT_REJECTED,
    Event.STALE_LOCK_REJECTED,
)
#: Leases given back before expiry (the reasons ``release`` accepts).
RELEASES: tuple[Event, ...] = (Event.RELEASED_ON_SHUTDOWN, Event.REJECTED_REQUEUE,
                               Event.RELEASED_AFTER_LOCAL_LOSS, Event.RELEASED_AFTER_OUTAGE)
#: A job taken back from a crashed or lost worker: proof that recovery works on a store.
RECOVERIES: tuple[Event, ...] = (Event.LEASE_TAKEN_OVER, Event.REAPED_EXPIRED_LEASE, Event.REDISPATCHED)
#: A job that passed its id to a replacement (Task.replace()).
REPLACEMENTS: tuple[Event, ...] = (Event.HANDED_OVER, Event.REPLACED)
#: Recoveries an operator ran by hand.
MANUAL_RECOVERIES: tuple[Event, ...] = (Event.MANUAL_REQUEUE, Event.DLQ_REDRIVEN, Event.DLQ_DISCARDED)


def stale_write(event: Event) -> str:
    """The write a stale-rejection event names: ``stale_lock_rejected`` -> ``lock``."""
    if event not in STALE_WRITES:
        raise ValueError(f"{event!r} is not a stale-write rejection")
    return event.value[len("stale_"):-len("_rejected")]
