"""celery_lease: leased execution for Celery tasks, so zombie jobs and duplicates end."""

import celery_lease.reaper.run as _reaper  # registers celery_lease.reap  # noqa: F401

from .errors import (
    JobDeadLettered,
    JobNotFound,
    LeaseConfigError,
    LeaseConfigErrors,
    LeaseError,
    LeaseLost,
    LockUnavailable,
    SchemaMismatch,
    StoreConflict,
    StoreCorrupt,
    StoreNotMigrated,
    StoreRejected,
    StoreUnavailable,
)
from .integration.task import Lease, LeaseTask

__all__ = [
    "LeaseTask",
    "Lease",
    "LeaseError",
    "LeaseConfigError",
    "LeaseConfigErrors",
    "LeaseLost",
    "JobDeadLettered",
    "LockUnavailable",
    "JobNotFound",
    "StoreCorrupt",
    "StoreUnavailable",
    "SchemaMismatch",
    "StoreNotMigrated",
    "StoreRejected",
    "StoreConflict",
]
from .version import __version__ as __version__  # noqa: E402 - one source for setup.cfg and the store
