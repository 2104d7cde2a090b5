"""The jobs row as the store hands it out, and statuses as SQL."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa

from ..config import RECOVERY, TaskPolicy
from ..errors import StoreCorrupt
from ..vocabulary import ClaimOutcome, Decision, Status

__all__ = ["PENDING", "RUNNING", "COMPLETED", "FAILED", "status_sql", "fenced_status", "NewJob", "Job",
           "Claim", "ClaimTerms", "storable"]


PENDING, RUNNING, COMPLETED, FAILED = Status.PENDING, Status.RUNNING, Status.COMPLETED, Status.FAILED


def storable(text: str) -> str:
    """Free text (an error, a reason) as every database stores it: PostgreSQL's text refuses NUL and no
    driver encodes a lone surrogate (a file name decoded by os.fsdecode), both of which an exception's message
    can hold, and a refused write would leave the job running or an effect's key held."""
    text = text.replace("\x00", "\\x00") if "\x00" in text else text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def status_sql(status: Status) -> sa.ColumnElement[Any]:
    """A status written into the statement's text, not bound: a planner uses a partial index (one
    status each) only for a statement whose text states that status."""
    return sa.literal_column(f"'{Status(status).value}'")


def fenced_status(column: sa.ColumnElement[Any], status: Status) -> sa.ColumnElement[bool]:
    """``column`` is ``status``, in a statement that finds its rows by id, written so no index matches it.
    Statistics that count no pending job would otherwise send each claim of a sudden backlog through the whole
    pending index instead of the primary key (measured: twice as slow at 2,000)."""
    return sa.func.coalesce(column, sa.literal_column("''")) == status_sql(status)


@dataclasses.dataclass(frozen=True)
class NewJob:
    """A job to record as published, without an idempotency key (see PublishStatements.record_batch)."""

    id: str
    task_name: str
    queue: str | None
    payload: str | None
    max_attempts: int
    delay: float = 0.0
    recovery: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """A snapshot of one jobs row."""

    id: str
    task_name: str
    queue_name: str | None
    status: str
    attempt_count: int
    expired_count: int
    dispatch_count: int
    max_attempts: int
    available_at: float
    lease_expires_at: float | None
    last_heartbeat_at: float | None
    started_at: float | None
    locked_by: str | None
    lock_token: str | None
    idempotency_key: str | None
    checkpoint: str | None
    last_error: str | None
    created_at: float
    updated_at: float
    completed_at: float | None = None
    failed_at: float | None = None
    lease_duration: float | None = None
    grace_period: float | None = None
    payload: str | None = None
    # The task's recovery policy as recorded (None: recorded before revision 0002; app settings).
    on_expired: str | None = None
    max_expirations: int | None = None
    backoff_base: float | None = None
    backoff_max: float | None = None
    backoff_jitter: bool | None = None
    dead_letter_queue: str | None = None
    dispatch_timeout: float | None = None

    def recovery(self) -> dict[str, Any]:
        """The recovery options the row carries (those recorded), by option name."""
        return {name: getattr(self, name) for name in RECOVERY if getattr(self, name) is not None}

    @classmethod
    def from_row(cls, row: Any) -> Job:
        data = getattr(row, "_mapping", row)
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def checkpoint_state(self) -> Any:
        if self.checkpoint is None:
            return None
        try:
            return json.loads(self.checkpoint)
        except ValueError as exc:
            raise StoreCorrupt(f"job {self.id}: checkpoint is not JSON ({exc})", job_id=self.id) from exc


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a claim found; ``early`` waits ``wait`` more seconds, ``replaced`` names the chain's first
    ``step`` that carries the job on now (None if it is gone)."""

    outcome: ClaimOutcome
    job: Job | None
    wait: float = 0.0
    step: Job | None = None
    claimed: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "claimed", self.outcome == ClaimOutcome.CLAIMED)


@dataclasses.dataclass(frozen=True)
class ClaimTerms:
    """What a task's policy asks of a claim: its lease, attempt limits, takeover rule and recovery options."""

    duration: float
    grace: float
    max_attempts: int
    max_expirations: int
    takeover: bool
    recovery: Mapping[str, Any] | None = None
    # replaced_task_nesting: a copy of a replaced run's message has the replaced run's, not one more.
    nesting: int = 0
    # The task's heartbeat interval: a takeover waits out the reaper's hold for a lease and a heartbeat.
    heartbeat: float = 0.0
    # Reads the replaced_task_nesting of a stored message (None: unreadable); None compares nothing.
    carried: Callable[[str | None], int | None] | None = None

    @classmethod
    def of(cls, policy: TaskPolicy, nesting: int = 0,
           carried: Callable[[str | None], int | None] | None = None) -> ClaimTerms:
        """The terms a task's policy (on one queue) asks of a claim."""
        return cls(duration=policy.duration, grace=policy.grace_period, max_attempts=policy.max_attempts,
                   max_expirations=policy.max_expirations, takeover=policy.on_expired == Decision.REQUEUE,
                   recovery=policy.recovery(), nesting=nesting, heartbeat=policy.heartbeat_interval,
                   carried=carried)
