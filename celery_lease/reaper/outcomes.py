"""Final outcomes that no worker reports: Celery hears of a job the reaper dead-lettered.

No worker is left to store FAILURE and fire the errbacks, so this does it from the stored message.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery.app.task import Context
from celery.utils.functional import maybe_list

import celery_lease.messaging.backend as results
import celery_lease.messaging.messages as messages

from ..errors import JobDeadLettered, StoreCorrupt
from ..store import Job

__all__ = ["report_failure", "request_from"]

log = logging.getLogger(__name__)


def request_from(app: Any, job: Job) -> tuple[Context, list[Any], dict[str, Any]]:
    """The request Celery's worker would have built for the job's stored message, with its args."""
    try:
        sig = messages.decode(job.payload, app.conf.accept_content, job.id)
    except StoreCorrupt:
        sig = {"args": [], "kwargs": {}, "options": {}}
    options = sig.get("options") or {}
    args, kwargs = list(sig.get("args") or ()), dict(sig.get("kwargs") or {})
    request = Context(
        id=job.id, task=job.task_name, args=args, kwargs=kwargs, root_id=options.get("root_id"),
        parent_id=options.get("parent_id"), group=options.get("group_id"),
        group_index=options.get("group_index"), chord=options.get("chord"), chain=options.get("chain"),
        callbacks=maybe_list(options.get("link")), errbacks=maybe_list(options.get("link_error")),
        reply_to=options.get("reply_to"), correlation_id=job.id, hostname=job.locked_by,
        ignore_result=bool(options.get("ignore_result", False)),
        delivery_info={"routing_key": job.queue_name, "redelivered": False},
    )
    return request, args, kwargs


def report_failure(app: Any, job: Job, reason: str) -> bool:
    """Store FAILURE, fire the errbacks and the chord's error path, send ``task_failure``; True when done."""
    task = app.tasks.get(job.task_name)
    backend = task.backend if task is not None else app.backend
    exc = JobDeadLettered(job.id, reason)
    try:
        request, args, kwargs = request_from(app, job)
        store_result = not (request.ignore_result or getattr(task, "ignore_result", False)) or bool(
            getattr(task, "store_errors_even_if_ignored", False))
        results.of(app, backend).mark_as_failure(job.id, exc, traceback=None, request=request,
                                                 store_result=store_result)
        signals.task_failure.send(sender=task, task_id=job.id, exception=exc, args=args, kwargs=kwargs,
                                  traceback=None, einfo=None)
    except Exception as error:  # noqa: BLE001 - the dead letter stands; tell the operator, go on
        log.error("job %s dead-lettered but Celery could not be told (%s)", job.id, error,
                  extra={"action": "dead_letter_unreported"})
        return False
    return True
