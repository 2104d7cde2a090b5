"""`celery -A proj lease ...`: the operator's commands, as a Celery subcommand (``celery.commands``)."""

import celery_lease.cli.manual as manual
import celery_lease.cli.ops as ops
import celery_lease.cli.reads as reads

from .base import CommandError, lease

__all__ = ["lease", "CommandError", "manual", "ops", "reads"]
