"""One leased run: claim (take the lease, or learn why the body must not run), attach (join the runtime, store
STARTED), body (named by how it ends, a ``RunEnd``), settle (write that end, deferring the write while the
store is unreachable and never looping on a rejection, then end the delivery as plain Celery would)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task, states
from celery.exceptions import Ignore, Reject, Retry

import celery_lease.deadline as deadline
import celery_lease.messaging.backend as results
import celery_lease.messaging.messages as messages
import celery_lease.worker.deliveries as deliveries
import celery_lease.worker.interrupt as interrupt
import celery_lease.worker.runtime as runtime

from ..config import TaskPolicy, task_policy
from ..errors import LeaseLost, StoreRejected, StoreUnavailable
from ..store import Claim, ClaimTerms, Job, Store
from ..vocabulary import ClaimOutcome, Event, LossReason, RunEnd, Status
from .checkpoints import held_back_first
from .handles import DeferredWrite
from .lease import Lease

__all__ = ["queue_of", "run", "settle"]

log = logging.getLogger(__name__)


def queue_of(task: Task, request: Any) -> str | None:
    info = request.delivery_info or {}
    return info.get("routing_key") or getattr(task, "queue", None) or task.app.conf.task_default_queue


class _Resumed:
    """The claim found a completed job whose post-run work a crash interrupted: finish it."""

    def __init__(self, value: Any) -> None:
        self.value = value


def run(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one delivery of a leased task: claim, attach, body, settle; a soft time limit lands in the body."""
    with interrupt.soft_limit_held(task.request.id, enabled=not task.request.is_eager) as soft:
        claimed = _claim(task, args, kwargs)
        if isinstance(claimed, _Resumed):
            return claimed.value  # Celery's tracer stores it and sends the chain's next step
        rt, job, token, policy, sent, record_again = claimed
        # The body runs under the tracer's own request, as a plain task's: Celery reads what it sets there.
        request = task.request
        lease = rt.admit(task, request, job, token, policy, sent_at=sent, record_again=record_again,
                         soft=soft)
        try:
            _store_started(task, request, lease)
            end, value, exc = _body(task, lease, args, kwargs)
            return settle(task, lease, end, value, exc)
        finally:
            rt.detach(request, lease)


def _fail_closed(task: Any, queue: str | None, exc: StoreUnavailable) -> NoReturn:
    """Deliver the message again later, with the task's store-retry backoff on this queue."""
    policy = task_policy(task, queue)
    deliveries.fail_closed(task, policy.store_retry_delay, policy.store_retry_max, exc)


# The claimed job with what its lease is built of: runtime, job, token, policy, claim sent at, record_again.
_Claimed = tuple["runtime.Runtime", Job, str, TaskPolicy, float, Callable[[], bool]]


def _claim(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Claimed | _Resumed:
    """Take the job's lease, or learn why its body must not run (a finished run resumed returns its value)."""
    request = task.request
    job_id = request.id
    queue = queue_of(task, request)
    token = secrets.token_hex(16)

    def payload() -> str | None:
        return messages.encode(task.name, args, kwargs, dict(task.signature_from_request(request).options),
                               task.serializer)

    rt: runtime.Runtime | None = None
    try:
        found, store, policy, terms = runtime.for_delivery(
            task, queue, int(getattr(request, "replaced_task_nesting", 0) or 0))
        rt = found
        # The lease's local deadline counts from when the claim was sent, not answered.
        sent = deadline.monotonic()
        claim = store.jobs.claim(job_id, rt.worker, token, terms, task_name=task.name, queue=queue,
                                 payload=payload)
    except StoreRejected as exc:
        # Neither run nor lost: the message comes back later with the fail-closed backoff.
        log.error("job %s: the store refused its claim (%s)", job_id, exc, extra={"action": "claim_rejected"})
        if request.is_eager:
            raise
        _fail_closed(task, queue, StoreUnavailable(str(exc), job_id=job_id))
    except StoreUnavailable as exc:
        if request.is_eager:
            raise  # no message to deliver again: the caller sees the outage
        if rt is not None:
            rt.unanswered.remember(job_id, token, task.app)  # the server may still commit it
        _fail_closed(task, queue, exc)
    if claim.outcome == ClaimOutcome.EARLY:
        deliveries.defer_early(task, store, rt.worker, claim.wait)
    if claim.outcome == ClaimOutcome.REPLACED:
        deliveries.skip_replaced_copy(task, store, rt.worker, claim.step)
    if not claim.claimed and claim.job is not None and rt.unanswered.orphaned(job_id, claim.job.lock_token):
        claim = _reclaim(store, rt, claim, token, terms)
    if not claim.claimed:
        if claim.job is not None and claim.job.status == Status.COMPLETED:
            try:
                resumed, value = deliveries.resume_post_run(task, store, rt.worker, claim.job)
            except StoreUnavailable as exc:
                deliveries.fail_closed(task, policy.store_retry_delay, policy.store_retry_max, exc)
            if resumed:
                return _Resumed(value)
        deliveries.skip_duplicate(task, store, rt.worker, claim.outcome, claim.job)
    job = claim.job
    assert job is not None

    def record_again() -> bool:
        again = store.jobs.claim(job_id, rt.worker, token, terms, task_name=task.name, queue=queue,
                                 payload=payload)
        if again.outcome == ClaimOutcome.REPLACED:  # the row went with a hand-over whose answer was lost
            deliveries.send_pending_step(task.app, job_id, again.step)
        return again.claimed and again.job is not None and again.job.lock_token == token

    return rt, job, token, policy, sent, record_again


def _reclaim(store: Store, rt: runtime.Runtime, claim: Claim, token: str, terms: ClaimTerms) -> Claim:
    """The job runs under a claim of this very process whose answer was lost: take it with ``token``."""
    assert claim.job is not None and claim.job.lock_token is not None
    lost = claim.job.lock_token
    try:
        job = store.jobs.reclaim(claim.job.id, lost, rt.worker, token, terms)
    except (StoreUnavailable, StoreRejected) as exc:
        log.warning("job %s: could not take back the claim whose answer was lost (%s)", claim.job.id, exc)
        return claim
    if job is None:
        return claim
    rt.unanswered.forget(lost)
    log.info("job %s [%s]: took back this process's claim [%s] whose answer was lost", job.id, token[:8],
             lost[:8], extra={"action": "lost_claim_taken_back"})
    return Claim(ClaimOutcome.CLAIMED, job)


def _store_started(task: Any, request: Any, lease: Lease) -> None:
    """Celery's task_track_started, once the claim proved this delivery runs the job; a backend that refuses
    it costs the report, not the run. An eager run stores none: its STARTED would stay for ever."""
    if request.is_eager or not task.lease_tracks_started or messages.ignores_result(task, request):
        return
    try:
        results.of(task.app, task.backend).store_result(
            lease.job_id, {"pid": os.getpid(), "hostname": request.hostname}, states.STARTED, request=request)
    except Exception as exc:  # noqa: BLE001 - any backend failure: the run goes on unreported
        log.warning("job %s [%s]: STARTED not stored (%s); the body runs", lease.job_id, lease.token[:8], exc,
                    extra={"action": "started_not_stored"})


def _body(task: Any, lease: Lease, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[RunEnd, Any, BaseException | None]:
    try:
        with lease.body():
            # As Celery's tracer calls a plain task's body: under the task and request it pushed.
            result = task.run(*args, **kwargs)
    except LeaseLost as exc:
        return RunEnd.LOST, None, exc
    except Retry as exc:
        return RunEnd.RETRIED, None, exc
    except Ignore as exc:
        return (RunEnd.REPLACED if lease.handed_over else RunEnd.IGNORED), None, exc
    except Reject as exc:
        if lease.lost:
            return RunEnd.LOST, None, exc  # Celery's retry() turns the lost lease's LeaseLost into Reject
        return (RunEnd.REJECTED_REQUEUE if exc.requeue else RunEnd.REJECTED), None, exc
    except StoreRejected as exc:
        return RunEnd.FAILED, None, exc  # a write the store refuses for good: the body's error
    except StoreUnavailable as exc:
        # A library call in the body that cannot wait for the store (a publish, a hand-over).
        return RunEnd.OUTAGE, None, exc
    except Exception as exc:  # noqa: BLE001 - named here, raised again by the settle step
        if interrupt.worker_terminating():
            return RunEnd.SHUTDOWN, None, exc
        # Raised after the loss (the interruption, or a LeaseLost turned into another error): no failure.
        return (RunEnd.LOST if lease.lost else RunEnd.FAILED), None, exc
    except BaseException as exc:  # noqa: BLE001 - named here, raised again by the settle step
        if interrupt.worker_leaving(exc):
            return RunEnd.SHUTDOWN, None, exc
        # The body's own SystemExit, KeyboardInterrupt or gevent.Timeout: final, as in plain Celery.
        return RunEnd.FAILED, None, exc
    return (RunEnd.REPLACED if lease.handed_over else RunEnd.RETURNED), result, None  # eager replace()


def _write(lease: Lease, end: RunEnd, write: Callable[[], bool], then: Callable[[], None] | None = None,
           later: Callable[[], bool] | None = None, landed: Callable[[], bool] | None = None) -> bool | None:
    """One settle write: True (written, ``then`` followed), False (stale), None (``later`` deferred)."""
    if lease.pending_checkpoint is not None:
        write, later = held_back_first(lease, write), later and held_back_first(lease, later)
    try:
        written = write() or (lease.vanished_and_recorded_again() and write())
    except StoreUnavailable as exc:
        log.error("job %s [%s]: %s not written, the store is unreachable (%s); kept until it answers",
                  lease.job_id, lease.token[:8], end, exc, extra={"action": "settle_deferred"})
        lease.runtime.defer(lease, DeferredWrite(end, later or write, then, landed))
        return None
    if not written:
        # Stale, or this write committed once unanswered: a job left pending gets its message again.
        lease.send_if_pending()
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
    if lease.unsent and end != RunEnd.OUTAGE:  # an outage's give-back forgets them once it lands
        lease.settle_unsent()
    if (lease.retried or lease.deferred_retry is not None) and end in (RunEnd.RETURNED, RunEnd.FAILED):
        # retry(throw=False) or a caught Retry, then the body's own end: the row is the retry's.
        _send_deferred_retry(lease, f"retried, then {end}")
        if exc is not None:
            raise exc
        return value
    if end == RunEnd.RETURNED:
        return _complete(task, lease, value)
    if exc is None:  # an eager replace() returned its replacement's value: that run wrote the job
        return value
    if end == RunEnd.LOST:
        _lost(task, lease, exc)
    if end == RunEnd.RETRIED:
        _retry(task, lease, exc)
    if end == RunEnd.IGNORED:
        _ending(lease, end, lambda: store.jobs.complete(job_id, token, worker))
    elif end == RunEnd.REJECTED_REQUEUE:
        # Requeued now, it would meet the lease still held and be skipped: it is sent with the release.
        if _write(lease, end, lambda: store.jobs.release(job_id, token, worker, Event.REJECTED_REQUEUE),
                  later=lambda: lease.give_back(Event.REJECTED_REQUEUE, republish=True)) is None:
            raise Ignore() from exc
    elif end == RunEnd.REJECTED and not _failed_unsent_retry(task, lease, exc):
        reason = f"rejected: {exc.reason}"  # type: ignore[attr-defined]
        _ending(lease, end, lambda: store.jobs.fail(job_id, token, reason, worker))
    elif end == RunEnd.FAILED:
        _fail(task, lease, exc)
    elif end == RunEnd.OUTAGE:
        log.warning("job %s [%s] stopped: the store is unreachable (%s); it runs again once the store "
                    "answers", job_id, token[:8], exc, extra={"action": "run_ended_by_outage"})
        _write(lease, end, lambda: lease.give_back(Event.RELEASED_AFTER_OUTAGE, republish=True),
               then=lease.forget_unsent)
        raise Ignore() from exc
    elif end == RunEnd.SHUTDOWN:
        # An unreachable store leaves the lease to expire, and the reaper requeues it.
        with contextlib.suppress(StoreUnavailable, StoreRejected):
            lease.give_back(Event.RELEASED_ON_SHUTDOWN)
        if isinstance(exc, Exception):
            # A solo pool's cold shutdown raises Celery's own error in the body: the worker left.
            raise Reject(f"worker shutting down: {type(exc).__name__}", requeue=True) from exc
    raise exc


def _ending(lease: Lease, end: RunEnd, write: Callable[[], bool], **after: Any) -> bool | None:
    """A settle write that ends a finished job; one the store refuses (now, or when deferred) fails the job
    instead, with the refusal as its error, or the reaper would run the finished body again."""
    def or_fail() -> bool:
        try:
            return write()
        except StoreRejected as exc:
            log.error("job %s [%s]: the store refused its %s (%s); the job is recorded as failed so that its "
                      "finished body does not run again", lease.job_id, lease.token[:8], end, exc,
                      extra={"action": "settle_refused"})
            reason = f"the store refused the write of its end ({end}): {exc}"
            return lease.store.jobs.fail(lease.job_id, lease.token, reason, lease.worker)

    return _write(lease, end, or_fail, **after)


def _complete(task: Any, lease: Lease, value: Any) -> Any:
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    if lease.lost:  # the completion below is fenced: rejected if the lease moved on
        log.warning("job %s [%s] finished after losing its lease", job_id, token[:8])
    kept = messages.keepable_result(task, value)

    def complete() -> bool:
        if kept is not None:
            try:
                return store.jobs.complete(job_id, token, worker, kept)
            except StoreRejected as exc:
                # The kept result only serves a crash's post-run work: one too large is dropped.
                log.error("job %s [%s]: result not kept, the store refused it (%s)", job_id, token[:8], exc,
                          extra={"action": "result_not_kept"})
        return store.jobs.complete(job_id, token, worker)

    if _ending(lease, RunEnd.RETURNED, complete) is False:
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
    if lease.deferred_retry is not None or lease.retried:
        # The row became pending before the retry's message was sent, or does with it now.
        _send_deferred_retry(lease, str(exc.exc or exc))
        raise exc
    payload = None if (sig := exc.sig) is None else messages.encode(sig.task, sig.args, sig.kwargs,
                                                                     dict(sig.options), task.serializer)
    delay = 0.0 if task.request.is_eager else deadline.seconds_until(exc.when)  # apply() retries at once
    if _write(lease, RunEnd.RETRIED, lambda: lease.store.jobs.retry_later(
            lease.job_id, lease.token, delay, payload, str(exc.exc or exc), lease.worker)) is False:
        raise Ignore() from exc
    raise exc


def _send_deferred_retry(lease: Lease, reason: str) -> None:
    """A retry() the store held back: the row goes pending, then its message is sent (nothing when sent)."""
    if lease.deferred_retry is None:
        return
    due, message = lease.deferred_retry
    _write(lease, RunEnd.RETRIED, lambda: lease.store.jobs.retry_later(
        lease.job_id, lease.token, max(0.0, due - deadline.monotonic()), message, reason, lease.worker),
        then=lambda: messages.republish(lease.app, lease.job_id, message))


def _failed_unsent_retry(task: Any, lease: Lease, exc: BaseException) -> bool:
    """Whether this Reject ends a run whose retry's message was refused (the row pending): then it fails."""
    if not lease.retry_unsent:
        return False  # the body's own Reject, after a retry whose message went out: that retry runs
    store, job_id, token, failed = lease.store, lease.job_id, lease.token, [True]
    error = f"rejected: {exc.reason}"  # type: ignore[attr-defined]

    def write() -> bool:  # True even if the row moved on: a stale answer would send its message again
        failed[0] = store.jobs.fail_unsent_retry(job_id, token, lease.attempt, error, lease.worker)
        return True

    _write(lease, RunEnd.REJECTED, write, then=lambda: _dead_letter(task, lease) if failed[0] else None,
           landed=lambda: store.jobs.wrote(job_id, token, Event.FAILED))
    return True


def _dead_letter(task: Any, lease: Lease) -> None:
    """Send a failed job's stored message to its dead-letter queue, once (its audit best effort). The failure
    has landed, so the lease's state no longer matters: a store that does not answer keeps it for later."""
    if queue := lease.policy.dead_letter_queue:
        send = functools.partial(_send_dead_letter, task.app, lease.store, lease.job_id, queue)
        lease.runtime.kept_writes.write(lease.job_id, "dead letter", send)


def _send_dead_letter(app: Any, store: Store, job_id: str, queue: str) -> None:
    job = store.get(job_id)
    try:
        messages.republish(app, job_id, job.payload if job else None, queue=queue)
    except Exception as exc:  # noqa: BLE001 - kept, it would be retried for ever ahead of every other write
        log.error("job %s: failed, its dead letter not sent to %s (%s); `lease dlq list` shows the job",
                  job_id, queue, exc, extra={"action": "dead_letter_not_sent"})
        return
    try:
        store.event(job_id, Event.DEAD_LETTER_PUBLISHED, queue)
    except (StoreUnavailable, StoreRejected) as exc:
        log.warning("job %s: dead letter sent to %s, its audit not written (%s)", job_id, queue, exc,
                    extra={"action": Event.DEAD_LETTER_PUBLISHED})


def _fail(task: Any, lease: Lease, exc: BaseException) -> None:
    """A final failure of the attempt: the job is failed (and dead-lettered); Ignore if it moved on. Celery
    sees the body's own exception even when the write is deferred."""
    error, store, job_id = f"{type(exc).__name__}: {exc}", lease.store, lease.job_id
    if _ending(lease, RunEnd.FAILED, lambda: store.jobs.fail(job_id, lease.token, error, lease.worker),
               then=lambda: _dead_letter(task, lease),
               landed=lambda: store.jobs.wrote(job_id, lease.token, Event.FAILED)) is False:
        raise Ignore() from exc
