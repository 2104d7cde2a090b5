"""`celery -A proj lease ...`: the operator's commands, as a Celery subcommand.

Installed through the ``celery.commands`` entry point (``lease = celery_lease.cli:lease``).
The verbs live in ``reads`` (status, jobs, inspect, events, tune), ``ops`` (migrate, web,
reap, check, exporter) and ``manual`` (requeue, dlq, effects: they ask before changing jobs).
"""

import celery_lease.cli.manual as manual
import celery_lease.cli.ops as ops
import celery_lease.cli.reads as reads

from .base import CommandError, lease

__all__ = ["lease", "CommandError", "manual", "ops", "reads"]
