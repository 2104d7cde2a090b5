"""LeaseTask's consumer strategy: with task events on, one read of the job's row acknowledges a sure duplicate
before Celery sends ``task-received`` and ``task-started``, which would tell Flower this worker ran a job
another one ran. Anything less sure goes on to Celery's path and the claim."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.worker.strategy import default

import celery_lease.messaging.backend as results

from ..errors import StoreRejected, StoreUnavailable
from ..kinds import leased
from ..store import Glance, for_app
from ..vocabulary import Event, Status
from ..worker.threads import worker_id

__all__ = ["lease_strategy", "sure_duplicate", "owner_node"]

log = logging.getLogger(__name__)

#: Seconds the strategy reads nothing after the store did not answer. The read runs in the consumer's event
#: loop: in an outage each one would hold every delivery (and the broker connection's heartbeats) for the
#: store's call bound, where the claim waits in the pool, as plain Celery would have run on.
QUIET = 10.0


def owner_node(locked_by: str | None) -> str | None:
    """The Celery node name of a lease owner (``node:pid``)."""
    return locked_by.rsplit(":", 1)[0] if locked_by else None


def sure_duplicate(glance: Glance | None, node: str, result_held: Callable[[], bool]) -> bool:
    """Whether a delivery of this job can only be skipped, whatever the claim would find; a lease of this
    node's own is never sure (it may be a claim whose answer was lost)."""
    if glance is None:
        return False
    if glance.status == Status.FAILED:
        return True
    if glance.status == Status.RUNNING:
        return glance.lease_live and owner_node(glance.locked_by) not in (None, node)
    if glance.status == Status.COMPLETED:
        return not glance.result_kept or result_held()
    return False


def _result_held(task: Any, job_id: str) -> bool:
    """Whether no delivery could resume the job's post-run work: the backend holds its result, or is not one a
    worker reads back."""
    backend = task.backend
    if isinstance(backend, (DisabledBackend, RPCBackend)) or not getattr(backend, "persistent", True):
        return True
    try:
        return results.post_run_finished(results.of(task.app, backend).get_state(job_id))
    except Exception as exc:  # noqa: BLE001 - unreadable: the task's path asks again
        log.debug("job %s: result backend unreadable before task-received (%s)", job_id, exc)
        return False


def lease_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Celery's default strategy, behind one read of the job's row when task events are on."""
    handler = default(task, app, consumer, **kwargs)
    eventer = consumer.event_dispatcher
    if not (eventer and eventer.enabled and task.send_events and leased(task)):
        return handler
    node, errors = consumer.hostname, consumer.connection_errors
    quiet_until = 0.0

    def lease_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                              **more: Any) -> Any:
        nonlocal quiet_until
        job_id = (message.headers or {}).get("id")
        if job_id and time.monotonic() >= quiet_until:
            try:
                store = for_app(app)
                glance = store.deliveries.glance(job_id)
            except (StoreUnavailable, StoreRejected) as exc:
                if isinstance(exc, StoreUnavailable):
                    quiet_until = time.monotonic() + QUIET
                log.debug("job %s: not read before task-received (%s)", job_id, exc)
            else:
                if sure_duplicate(glance, node, lambda: _result_held(task, job_id)):
                    _skip(store, message, job_id, glance, node)
                    # Celery's ack promise, not the message's own ack: on Celery 5.7 it also restores the
                    # prefetch count a reconnect reduced, which a run of skipped duplicates would hold low.
                    ack(log, errors)
                    return None
        return handler(message, body, ack, reject, callbacks, **more)

    return lease_message_handler


def _skip(store: Any, message: Any, job_id: str, glance: Any, node: str) -> None:
    """Log and audit a sure duplicate that is acknowledged unannounced, as the claim's skip is."""
    log.info("job %s delivered again but is %s (owner %s): acknowledged before task-received", job_id,
             glance.status, glance.locked_by, extra={"action": "duplicate_delivery_skipped"})
    redelivered = bool((getattr(message, "delivery_info", None) or {}).get("redelivered"))
    try:
        store.event(job_id, Event.DUPLICATE_DELIVERY_SKIPPED, f"job {glance.status}", worker_id(node),
                    detail={"owner": glance.locked_by, "redelivered": redelivered, "before": "task-received"})
    except (StoreUnavailable, StoreRejected) as exc:
        log.warning("job %s: audit event %s not written (%s)", job_id, Event.DUPLICATE_DELIVERY_SKIPPED, exc)
