"""celery_lease: leased execution for Celery tasks, so zombie jobs and duplicates end."""

from .errors import (
    JobNotFound,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    LockUnavailable,
    StoreCorrupt,
    StoreUnavailable,
)
from .task import Lease, LeaseTask

__all__ = [
    "LeaseTask",
    "Lease",
    "LeaseError",
    "LeaseConfigError",
    "LeaseLost",
    "LockUnavailable",
    "JobNotFound",
    "StoreCorrupt",
    "StoreUnavailable",
]
__version__ = "0.1.0"
