"""`celery -A proj lease ...`: the operator's commands, as a Celery subcommand.

Installed through the ``celery.commands`` entry point (``lease = celery_lease.cli:lease``).
The verbs live in ``reads`` (status, jobs, inspect, events, tune) and ``ops``
(migrate, reap, requeue, dlq, check, exporter).
"""

from . import ops, reads
from .base import CommandError, lease

__all__ = ["lease", "CommandError", "ops", "reads"]
