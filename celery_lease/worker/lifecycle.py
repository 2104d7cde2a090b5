"""One leased run: claim (take the lease, or learn why the body must not run), attach (join the runtime, store
STARTED), body (named by how it ends, a ``RunEnd``), settle (settle.py)."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task, states
from celery._state import _task_stack
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry, WorkerShutdown, WorkerTerminate

import celery_lease.deadline as deadline
import celery_lease.messaging.backend as results
import celery_lease.messaging.messages as messages
import celery_lease.worker.deliveries as deliveries
import celery_lease.worker.runtime as runtime

from ..config import TaskPolicy, task_policy
from ..errors import LeaseLost, StoreRejected, StoreUnavailable
from ..store import Claim, ClaimTerms, Job, Store
from ..vocabulary import ClaimOutcome, RunEnd, Status
from .lease import Lease
from .settle import settle

__all__ = ["run", "queue_of"]

log = logging.getLogger(__name__)


def queue_of(task: Task, request: Any) -> str | None:
    info = request.delivery_info or {}
    return info.get("routing_key") or getattr(task, "queue", None) or task.app.conf.task_default_queue


class _Resumed:
    """The claim found a completed job whose post-run work a crash interrupted: finish it."""

    def __init__(self, value: Any) -> None:
        self.value = value


def run(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one delivery of a leased task: claim, attach, body, settle."""
    claimed = _claim(task, args, kwargs)
    if isinstance(claimed, _Resumed):
        return claimed.value  # Celery's tracer stores it and sends the chain's next step
    rt, job, token, policy, sent, record_again = claimed
    request = task.request
    # Celery < 5.5's push_request starts blank: the body would see no id, hostname or delivery_info.
    body_request = Context(**{**request.__dict__, "args": args, "kwargs": kwargs})
    lease = rt.admit(task, request, body_request, job, token, policy, sent_at=sent, record_again=record_again)
    try:
        _store_started(task, request, lease)
        end, value, exc = _body(task, lease, body_request, args, kwargs)
        return settle(task, lease, end, value, exc)
    finally:
        rt.detach(request, lease, body_request)


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
            rt.claim_unanswered(job_id, token)  # the server may still commit it
        _fail_closed(task, queue, exc)
    if claim.outcome == ClaimOutcome.EARLY:
        deliveries.defer_early(task, store, rt.worker, claim.wait)
    if claim.outcome == ClaimOutcome.REPLACED:
        deliveries.skip_replaced_copy(task, store, rt.worker, claim.step)
    if not claim.claimed and claim.job is not None and rt.orphaned_claim(job_id, claim.job.lock_token):
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
    rt.forget_unanswered(lost)
    log.info("job %s [%s]: took back this process's claim [%s] whose answer was lost", job.id, token[:8],
             lost[:8], extra={"action": "lost_claim_taken_back"})
    return Claim(ClaimOutcome.CLAIMED, job)


def _store_started(task: Any, request: Any, lease: Lease) -> None:
    """Celery's task_track_started, once the claim proved this delivery runs the job; a backend that refuses
    it costs the report, not the run. An eager run stores none: its STARTED would stay for ever."""
    if request.is_eager or not task.lease_tracks_started or deliveries.ignores_result(task, request):
        return
    try:
        results.of(task.app, task.backend).store_result(
            lease.job_id, {"pid": os.getpid(), "hostname": request.hostname}, states.STARTED, request=request)
    except Exception as exc:  # noqa: BLE001 - any backend failure: the run goes on unreported
        log.warning("job %s [%s]: STARTED not stored (%s); the body runs", lease.job_id, lease.token[:8], exc,
                    extra={"action": "started_not_stored"})


def _call(task: Any, body_request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Celery's ``Task.__call__``, under the body's own request context (attached to its lease)."""
    _task_stack.push(task)
    task.request_stack.push(body_request)
    try:
        return task.run(*args, **kwargs)
    finally:
        task.pop_request()
        _task_stack.pop()


def _worker_terminating() -> bool:
    """True once a cold shutdown began in this worker (Celery's own flag)."""
    from celery.worker import state

    return bool(state.should_terminate)


def _worker_leaving(exc: BaseException) -> bool:
    """True when a BaseException means the worker is shutting down, not that the body failed."""
    from celery.worker import state

    if isinstance(exc, (WorkerShutdown, WorkerTerminate)) or state.should_stop or state.should_terminate:
        return True
    # A prefork child's terminate handler raises SystemExit in whatever runs; billiard flags it.
    from billiard import common

    fired = getattr(common, "terminate_handler_fired", None)
    return bool(fired is not None and fired())


def _body(task: Any, lease: Lease, body_request: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[RunEnd, Any, BaseException | None]:
    try:
        with lease.body():
            result = _call(task, body_request, args, kwargs)
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
        if _worker_terminating():
            return RunEnd.SHUTDOWN, None, exc
        # Raised after the loss (the interruption, or a LeaseLost turned into another error): no failure.
        return (RunEnd.LOST if lease.lost else RunEnd.FAILED), None, exc
    except BaseException as exc:  # noqa: BLE001 - named here, raised again by the settle step
        if _worker_leaving(exc):
            return RunEnd.SHUTDOWN, None, exc
        # The body's own SystemExit, KeyboardInterrupt or gevent.Timeout: final, as in plain Celery.
        return RunEnd.FAILED, None, exc
    return RunEnd.RETURNED, result, None
