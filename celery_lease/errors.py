"""The exceptions celery_lease raises, all under one root.

    LeaseError
    ├── LeaseConfigError      a ``lease_*`` setting or task option is invalid
    │   └── LeaseConfigErrors several are: ``problems`` lists each (``setting`` is the first's)
    ├── StoreUnavailable      the lease store cannot be reached (driver error wrapped): an outage
    │   ├── SchemaMismatch    the store's schema revision is not one this code runs against
    │   └── StoreNotMigrated  a table or column is missing: run `celery -A proj lease migrate`
    ├── StoreRejected         the store refused a statement for good: retrying cannot help
    │   └── StoreConflict     a row with the same key exists (a race the store settles itself)
    ├── StoreCorrupt          a row in the store cannot be understood
    ├── JobNotFound           no job with that id in the store
    ├── LeaseLost             this worker no longer holds the job's lease
    ├── JobDeadLettered       the reaper gave up on a job (the failure Celery is told of)
    └── LockUnavailable       a resource lock is held by someone else

Each class's docstring is its default message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .masking import mask_secrets, mask_value

__all__ = [
    "LeaseError",
    "LeaseConfigError",
    "LeaseConfigErrors",
    "StoreUnavailable",
    "SchemaMismatch",
    "StoreNotMigrated",
    "StoreRejected",
    "StoreConflict",
    "JobDeadLettered",
    "StoreCorrupt",
    "JobNotFound",
    "LeaseLost",
    "LockUnavailable",
]


class LeaseError(Exception):
    """celery_lease failed."""

    def __init__(self, message: str | None = None, **context: Any) -> None:
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)
        # A driver's message may quote the store URL: no password leaves in an exception.
        super().__init__(mask_secrets(message or (self.__doc__ or "").strip()))

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword context, not the message: pickle-based result backends need both.
        return (_rebuild, (type(self), str(self), self.context))


class LeaseConfigError(LeaseError):
    """A celery_lease setting is invalid (its message and ``value`` show a store URL masked)."""

    setting: str
    value: Any
    rule: str

    def __init__(self, setting: str, value: Any, rule: str, hint: str = "") -> None:
        value = mask_value(value)
        message = f"{setting}={value!r} is invalid: {rule}"
        if hint:
            message += f". {hint}"
        super().__init__(message, setting=setting, value=value, rule=mask_secrets(rule))


class LeaseConfigErrors(LeaseConfigError):
    """Several celery_lease settings are invalid, reported at once; ``problems`` lists each one."""

    problems: tuple[LeaseConfigError, ...]

    def __init__(self, problems: Sequence[LeaseConfigError]) -> None:
        first = problems[0]
        listed = "\n".join(f"  - {problem}" for problem in problems)
        message = f"{len(problems)} celery_lease settings are invalid:\n{listed}"
        LeaseError.__init__(self, message, setting=first.setting, value=first.value, rule=first.rule,
                            problems=tuple(problems))


class StoreUnavailable(LeaseError):
    """The lease store cannot be reached; check lease_store_url and that the database is up."""


class SchemaMismatch(StoreUnavailable):
    """The lease store's schema is not at a revision this celery_lease runs against; run `lease migrate`."""


class StoreNotMigrated(StoreUnavailable):
    """The lease store lacks a table or column; run `celery -A proj lease migrate`."""


class StoreRejected(LeaseError):
    """The lease store refused a statement (permission, syntax, data or constraint).

    Not a StoreUnavailable: the store answered, and the same write would be refused again, so
    a caller reports it instead of deferring and retrying; ``kind`` says which refusal it was.
    """


class StoreConflict(StoreRejected):
    """A row with the same key already exists in the lease store."""


class StoreCorrupt(LeaseError):
    """A row in the lease store cannot be understood."""


class JobDeadLettered(LeaseError):
    """The job was dead-lettered: its lease expired and it will not run again."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id} dead-lettered: {reason}", job_id=job_id, reason=reason)


class JobNotFound(LeaseError):
    """No job with that id exists in the lease store."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job {job_id!r} in the lease store; list jobs with `celery lease jobs`",
            job_id=job_id,
        )


class LeaseLost(LeaseError):
    """This worker no longer holds the job's lease; stop and let the new owner finish."""

    job_id: str
    reason: str
    owner: str | None

    def __init__(self, job_id: str, reason: str = "lost", owner: str | None = None) -> None:
        message = f"lease on job {job_id} lost: {reason}"
        if owner:
            message += f" (now held by {owner})"
        super().__init__(message, job_id=job_id, reason=reason, owner=owner)


class LockUnavailable(LeaseError):
    """A resource lock is held by another owner."""

    def __init__(self, resource: str, timeout: float) -> None:
        super().__init__(
            f"lock on {resource!r} is held by another owner (waited {timeout:g}s)",
            resource=resource,
            timeout=timeout,
        )


def _rebuild(cls: type[LeaseError], message: str, context: dict[str, Any]) -> LeaseError:
    error = cls.__new__(cls)
    LeaseError.__init__(error, message, **context)
    return error
