"""Deliveries whose body must not run now: the store is down, the job is not available
yet, or the job is leased or finished. Each is acknowledged, logged and audited, and
the first two are sent again for later; none writes a task state or result.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject

from . import messages
from .errors import StoreUnavailable
from .store import Store
from .vocabulary import ClaimOutcome, Event

__all__ = ["fail_closed", "defer_early", "skip_duplicate"]

log = logging.getLogger(__name__)


def _send_again(task: Task, countdown: float, why: str) -> NoReturn:
    """Re-send this delivery's message ``countdown`` seconds from now and drop this one."""
    request = task.request
    sig = task.signature_from_request(request, countdown=countdown)
    try:
        with messages.publishing_unrecorded():
            sig.apply_async()
    except Exception as publish_error:  # noqa: BLE001 - the broker is failing too
        log.error("job %s: cannot re-send (%s); rejecting with requeue", request.id, publish_error)
        raise Reject(why, requeue=True) from publish_error
    raise Ignore()


def fail_closed(task: Task, retry_delay: float, exc: StoreUnavailable) -> NoReturn:
    """The store is down: send the message again later and do not run the body."""
    log.warning("job %s not started, lease store unreachable (%s); delivering again in %gs",
                task.request.id, exc, retry_delay, extra={"action": "fail_closed"})
    _send_again(task, retry_delay, str(exc))


def defer_early(task: Task, store: Store, worker: str, wait: float) -> NoReturn:
    """The job is not available yet (a copy of its message came early): send it for then."""
    job_id = task.request.id
    log.info("job %s delivered %.1fs before it is available: sent again for then", job_id, wait,
             extra={"action": "early_delivery_deferred"})
    _audit(store, job_id, Event.EARLY_DELIVERY_DEFERRED, f"available in {wait:.1f}s", worker,
           {"wait": round(wait, 3)})
    _send_again(task, wait, "delivered before the job is available")


def _audit(store: Store, job_id: str, event: Event, reason: str, worker: str, detail: Any) -> None:
    """Audit a delivery whose body does not run; a store outage costs the event, not the delivery.

    Raising here would fail the task and let Celery write a FAILURE state for a job
    that another delivery runs or ran.
    """
    try:
        store.event(job_id, event, reason, worker, detail=detail)
    except StoreUnavailable as exc:
        log.warning("job %s: audit event %s not written (%s)", job_id, event, exc)


def skip_duplicate(task: Task, store: Store, worker: str, outcome: ClaimOutcome, job: Any) -> NoReturn:
    """The job is leased by another delivery or finished: acknowledge this one unrun."""
    job_id = task.request.id
    log.info("job %s delivered again but is %s (owner %s): body not run", job_id,
             job.status if job else outcome, job.locked_by if job else None,
             extra={"action": "duplicate_delivery_skipped"})
    _audit(store, job_id, Event.DUPLICATE_DELIVERY_SKIPPED, f"job {job.status if job else outcome}", worker,
           {"owner": job.locked_by if job else None,
            "redelivered": bool((task.request.delivery_info or {}).get("redelivered"))})
    raise Ignore()
