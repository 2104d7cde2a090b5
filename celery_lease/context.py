"""Every context variable of the package, in one core module so no layer needs another's private names.

The values are higher layers' objects, so they are typed ``Any``; each comment names the type.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

__all__ = ["BODY", "LOCAL", "BATCH", "HANDING", "HANDING_LATER", "RESUMED", "UNRECORDED"]

#: The worker.lease.Lease whose body runs here; set by Lease.body(), read by store.base.uninterrupted().
BODY: ContextVar[Any] = ContextVar("celery_lease_body", default=None)

#: The worker.local.LocalLease of a body run outside a worker (eager); set by worker.local.running().
LOCAL: ContextVar[Any] = ContextVar("celery_lease_local", default=None)

#: The publish.batching.Batch of the group being published here; set by publish.batching's wrapper.
BATCH: ContextVar[Any] = ContextVar("celery_lease_batch", default=None)

#: The worker.lease.Lease whose job a Task.replace() hands over to the carrier it publishes now, and the
#: replaced run's replaced_task_nesting: (lease, nesting); set by publish.replacing.hand_over().
HANDING: ContextVar[Any] = ContextVar("celery_lease_handing", default=None)

#: A hand-over whose carrier is sent later: (the Lease, the carrier's name, the replaced run's
#: replaced_task_nesting) until the first step is recorded; set by publish.replacing.hand_over().
HANDING_LATER: ContextVar[Any] = ContextVar("celery_lease_handing_later", default=None)

#: The job id (str) whose post-run work this context finishes: its publishes re-send what a crash may
#: have sent already, so they reopen nothing; set by worker.deliveries.
RESUMED: ContextVar[str | None] = ContextVar("celery_lease_resumed", default=None)

#: True while publishing without recording a job (the row exists, or the store is down); set by
#: messaging.messages.publishing_unrecorded().
UNRECORDED: ContextVar[bool] = ContextVar("celery_lease_unrecorded", default=False)
