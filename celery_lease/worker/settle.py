"""The settle step of a leased run: write how the body ended, deferring the write while the store is
unreachable (never looping on a rejection), and end the delivery as plain Celery would for that end."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

import celery_lease.deadline as deadline
import celery_lease.messaging.messages as messages
import celery_lease.worker.deliveries as deliveries

from ..config import TaskPolicy
from ..errors import StoreRejected, StoreUnavailable
from ..store import Store
from ..vocabulary import Event, LossReason, RunEnd
from .handles import DeferredWrite
from .lease import Lease

__all__ = ["settle"]

log = logging.getLogger(__name__)


def _write(lease: Lease, end: RunEnd, write: Callable[[], bool], then: Callable[[], None] | None = None,
           later: Callable[[], bool] | None = None) -> bool | None:
    """One settle write: True (written, ``then`` followed), False (stale), None (``later`` deferred)."""
    try:
        written = write()
        if not written and lease.vanished_and_recorded_again():
            written = write()
    except StoreRejected:
        raise
    except StoreUnavailable as exc:
        log.error("job %s [%s]: %s not written, the store is unreachable (%s); kept until it answers",
                  lease.job_id, lease.token[:8], end, exc, extra={"action": "settle_deferred"})
        lease.runtime.defer(lease, DeferredWrite(end, later or write, then))
        return None
    if not written:
        # Stale, or this write committed once unanswered: a job left pending gets its message again.
        try:
            lease.send_if_pending()
        except Exception as error:  # noqa: BLE001 - the reaper's dispatch scan sends it later
            log.warning("job %s: not sent again (%s); the dispatch scan will", lease.job_id, error)
    elif then is not None:
        try:
            then()
        except Exception as error:  # noqa: BLE001 - the write landed; what follows it is logged
            log.error("job %s [%s]: what follows the %s failed (%s)", lease.job_id, lease.token[:8], end,
                      error, extra={"action": "settle_followup_failed"})
    return written


def settle(task: Any, lease: Lease, end: RunEnd, value: Any, exc: BaseException | None) -> Any:
    """Write how the body ended, then end the delivery as plain Celery would for that end."""
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    if end == RunEnd.RETURNED:
        return _complete(task, lease, value)
    assert exc is not None
    if end == RunEnd.LOST:
        _lost(task, lease, exc)
    if end == RunEnd.RETRIED:
        _retry(task, lease, exc)
    if end == RunEnd.IGNORED:
        _ending(lease, end, lambda: store.jobs.complete(job_id, token, worker))
    elif end == RunEnd.REJECTED_REQUEUE:
        # Requeued now, it would meet the lease still held and be skipped: it is sent with the release.
        if _write(lease, end, lambda: store.jobs.release(job_id, token, worker,
                                                         reason=Event.REJECTED_REQUEUE),
                  later=lambda: lease.give_back(Event.REJECTED_REQUEUE, republish=True)) is None:
            raise Ignore() from exc
    elif end == RunEnd.REJECTED:
        reason = f"rejected: {exc.reason}"  # type: ignore[attr-defined]
        _write(lease, end, lambda: store.jobs.fail(job_id, token, reason, worker))
    elif end == RunEnd.FAILED:
        _fail(task, lease, exc)
    elif end == RunEnd.OUTAGE:
        log.warning("job %s [%s] stopped: the store is unreachable (%s); it runs again once the store "
                    "answers", job_id, token[:8], exc, extra={"action": "run_ended_by_outage"})
        _write(lease, end, lambda: lease.give_back(Event.RELEASED_AFTER_OUTAGE, republish=True))
        raise Ignore() from exc
    elif end == RunEnd.SHUTDOWN:
        # An unreachable store leaves the lease to expire, and the reaper requeues it.
        with contextlib.suppress(StoreUnavailable, StoreRejected):
            lease.give_back(Event.RELEASED_ON_SHUTDOWN)
        if isinstance(exc, Exception):
            # A solo pool's cold shutdown raises Celery's own error in the body: the worker left.
            raise Reject(f"worker shutting down: {type(exc).__name__}", requeue=True) from exc
    raise exc


def _ending(lease: Lease, end: RunEnd, write: Callable[[], bool]) -> bool | None:
    """A settle write that ends a finished job; one the store refuses fails the job instead, or the reaper
    would run the finished body again."""
    try:
        return _write(lease, end, write)
    except StoreRejected as exc:
        log.error("job %s [%s]: the store refused its %s (%s); the job is recorded as failed so that its "
                  "finished body does not run again", lease.job_id, lease.token[:8], end, exc,
                  extra={"action": "settle_refused"})
        reason = f"the store refused the write of its end ({end}): {exc}"
        return _write(lease, end, lambda: lease.store.jobs.fail(lease.job_id, lease.token, reason,
                                                                lease.worker))


def _complete(task: Any, lease: Lease, value: Any) -> Any:
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    if lease.lost:
        # Lost while finishing: the completion below is fenced and will be rejected if it moved on.
        log.warning("job %s [%s] finished after losing its lease", job_id, token[:8])
    kept = deliveries.keepable_result(task, value)
    try:
        if kept is None:
            written = _ending(lease, RunEnd.RETURNED, lambda: store.jobs.complete(job_id, token, worker))
        else:
            written = _write(lease, RunEnd.RETURNED, lambda: store.jobs.complete(job_id, token, worker, kept))
    except StoreRejected as exc:
        # The kept result only serves a crash's post-run work: one too large is dropped, the job completes.
        log.error("job %s [%s]: result not kept, the store refused it (%s)", job_id, token[:8], exc,
                  extra={"action": "result_not_kept"})
        written = _ending(lease, RunEnd.RETURNED, lambda: store.jobs.complete(job_id, token, worker))
    if written is False:
        log.warning("job %s [%s]: completion rejected, the lease moved on", job_id, token[:8],
                    extra={"action": "stale_completion_rejected"})
        raise Ignore()
    return value


def _lost(task: Any, lease: Lease, exc: BaseException) -> NoReturn:
    log.warning("job %s [%s] stopped: %s", lease.job_id, lease.token[:8], exc, extra={"action": "lease_lost"})
    if lease.lost_reason == LossReason.VANISHED and not task.request.is_eager:
        # The message is the job's only record now: its claim records the job anew.
        log.error("job %s [%s]: its row vanished from the store; message sent again", lease.job_id,
                  lease.token[:8], extra={"action": "vanished_job_sent_again"})
        deliveries.send_again(task, "the job's row vanished from the store")
    elif not lease.lost:
        # LeaseLost on a lease still held: nobody else runs the job, so give it back now, uncharged.
        _write(lease, RunEnd.LOST, lambda: lease.give_back(Event.RELEASED_AFTER_LOCAL_LOSS, republish=True))
    raise Ignore() from exc


def _retry(task: Any, lease: Lease, exc: BaseException) -> None:
    """Celery's Retry: the row goes back to pending (once) before or with the retry's message."""
    assert isinstance(exc, Retry)
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    if lease.deferred_retry is not None:
        due, message = lease.deferred_retry

        def write() -> bool:
            return store.jobs.retry_later(job_id, token, max(0.0, due - deadline.monotonic()), message,
                                          str(exc.exc or exc), worker)

        _write(lease, RunEnd.RETRIED, write, then=lambda: messages.republish(lease.app, job_id, message))
        raise exc
    if lease.retried:
        raise exc  # the row became pending before the retry's message was sent
    payload = None
    if exc.sig is not None:
        payload = messages.encode(exc.sig.task, exc.sig.args, exc.sig.kwargs, dict(exc.sig.options),
                                  task.serializer)
    delay = deadline.seconds_until(exc.when)
    if _write(lease, RunEnd.RETRIED,
              lambda: store.jobs.retry_later(job_id, token, delay, payload, str(exc.exc or exc),
                                             worker)) is False:
        raise Ignore() from exc
    raise exc


def _dead_letter(task: Any, store: Store, job_id: str, policy: TaskPolicy) -> None:
    if not policy.dead_letter_queue:
        return
    job = store.get(job_id)
    messages.republish(task.app, job_id, job.payload if job else None, queue=policy.dead_letter_queue)
    store.event(job_id, Event.DEAD_LETTER_PUBLISHED, policy.dead_letter_queue)


def _fail(task: Any, lease: Lease, exc: BaseException) -> None:
    """A final failure of the attempt: the job is failed (and dead-lettered); Ignore if it moved on. Celery
    sees the body's own exception even when the write is deferred."""
    error = f"{type(exc).__name__}: {exc}"
    store, job_id = lease.store, lease.job_id
    written = _write(lease, RunEnd.FAILED, lambda: store.jobs.fail(job_id, lease.token, error, lease.worker),
                     then=lambda: _dead_letter(task, store, job_id, lease.policy))
    if written is False:
        raise Ignore() from exc
