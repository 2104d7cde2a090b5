"""The LeaseTasks of ``tests.apps.include_app``, registered only when this module is imported."""

from __future__ import annotations

from celery_lease import LeaseTask
from tests.apps.include_app import app


@app.task(base=LeaseTask, name="inc.strict", lease_on_expired="dead_letter", lease_duration=45.0)
def strict(n: int = 0) -> int:
    """Dead-lettered, never requeued, when its lease expires."""
    return n


@app.task(base=LeaseTask, name="inc.reports", lease_duration=600.0, lease_heartbeat_interval=60.0)
def reports(n: int = 0) -> int:
    """A long job with a long lease."""
    return n
