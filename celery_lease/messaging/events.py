"""Celery task events for the moves no worker announces (a dead letter, a requeue or redrive, a lease given
back on shutdown), so Flower sees them. Sent after the store committed the move, only when the app sends
task events; a failure to send is logged and never fails the move."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

from ..vocabulary import TaskEvent

__all__ = ["enabled", "send", "failed", "retried", "node", "REAPER", "RELEASED_ON_SHUTDOWN"]

log = logging.getLogger(__name__)

#: The node name the reaper's events come from (``celery_lease.reaper@<host>``).
REAPER = "celery_lease.reaper"
#: The reason a worker's shutdown release sends with its ``task-retried``.
RELEASED_ON_SHUTDOWN = "released on shutdown"


def node(name: str) -> str:
    return f"{name}@{socket.gethostname()}"


def enabled(app: Any) -> bool:
    """Whether the app sends task events (``worker_send_task_events``, or ``-E`` in a worker)."""
    return app is not None and bool(app.conf.worker_send_task_events)


def failed(job_id: str, name: str, reason: str, attempt: int) -> tuple[TaskEvent, dict[str, Any]]:
    """The ``task-failed`` of a dead letter: the reason as its exception, with the attempt."""
    return TaskEvent.FAILED, {"uuid": job_id, "name": name, "exception": reason, "traceback": None,
                              "reason": reason, "attempt": attempt}


def retried(job_id: str, reason: str, attempt: int) -> tuple[TaskEvent, dict[str, Any]]:
    """The ``task-retried`` of a job that runs again: the reason as its exception, with the attempt."""
    return TaskEvent.RETRIED, {"uuid": job_id, "exception": reason, "traceback": None, "reason": reason,
                               "attempt": attempt}


def send(app: Any, hostname: str, events: Iterable[tuple[TaskEvent, dict[str, Any]]]) -> int:
    """Send ``events`` from ``hostname`` through one dispatcher; how many were sent (0 when the app sends no
    task events)."""
    batch = list(events)
    if not batch or not enabled(app):
        return 0
    sent = 0
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            for kind, fields in batch:
                dispatcher.send(kind.value, **fields)
                sent += 1
    except Exception as exc:  # noqa: BLE001 - any broker or serializer failure: the move stands
        log.warning("%d of %d task event(s) not sent (%s): %s", len(batch) - sent, len(batch), exc,
                    ", ".join(f"{kind.value} {fields['uuid']}" for kind, fields in batch[sent:]),
                    extra={"action": "task_event_unsent"})
    return sent
