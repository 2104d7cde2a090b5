"""LeaseTask, the base class, and Lease, the running job's handle.

A LeaseTask records its job when published, claims a lease before the body runs,
and completes, fails or reschedules the job with the lease's token afterwards. A
delivery for a job that someone else holds, or that is finished, does not run the
body: it is acknowledged and audited as ``duplicate_delivery_skipped``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from typing import Any

from celery import Task, states
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry, WorkerShutdown, WorkerTerminate
from celery.utils import uuid

from . import batching, deadline, deliveries, local, messages, publishing, replacing, runtime
from .config import TaskPolicy, app_config, task_policy
from .errors import LeaseLost, StoreRejected, StoreUnavailable
from .lease import Lease
from .store import Claim, ClaimTerms, Store, for_app
from .vocabulary import ClaimOutcome, Decision, Event, Status

# A group publishes its LeaseTask jobs a batch at a time: one INSERT per table per batch.
batching.install()

__all__ = ["LeaseTask", "Lease"]

log = logging.getLogger(__name__)


def _queue_of(task: Task, request: Any) -> str | None:
    info = request.delivery_info or {}
    return info.get("routing_key") or getattr(task, "queue", None) or task.app.conf.task_default_queue


#: Celery's built-ins that run a LeaseTask's items in one body: leased as one job whose lease
#: the items share. Every other ``celery.*`` task is never leased.
LEASED_BUILTINS = frozenset({"celery.map", "celery.starmap", "celery.chunks"})


def leased(task: Any) -> bool:
    """Whether runs of ``task`` take a lease: LeaseTasks, except Celery's own plumbing.

    ``celery.chord_unlock`` retries every second, ``celery.accumulate`` ends a replacement,
    ``celery.backend_cleanup`` is periodic housekeeping: leasing them (an app whose
    ``task_cls`` is LeaseTask makes them LeaseTasks) would only add rows and races.
    """
    name = getattr(task, "name", None) or ""
    kind = task if isinstance(task, type) else type(task)
    return issubclass(kind, LeaseTask) and (not name.startswith("celery.") or name in LEASED_BUILTINS)


class LeaseTask(Task):
    """A Celery task that runs only while its worker holds a lease on the job."""

    lease_store_retry_delay: float | None = None
    lease_store_retry_max: float | None = None
    lease_duration: float | None = None
    lease_heartbeat_interval: float | None = None
    lease_grace_period: float | None = None
    lease_max_runtime: float | None = None
    lease_on_lost: str | None = None
    lease_max_attempts: int | None = None
    lease_max_expirations: int | None = None
    lease_on_expired: str | None = None
    lease_backoff_base: float | None = None
    lease_backoff_max: float | None = None
    lease_backoff_jitter: bool | None = None
    lease_dead_letter_queue: str | None = None
    lease_dispatch_timeout: float | None = None
    lease_lock_ttl: float | None = None
    lease_lock_timeout: float | None = None

    Request = "celery_lease.signals:LeaseRequest"

    #: Whether Celery's ``task_track_started`` applies to this task. A leased task stores
    #: STARTED itself once its claim succeeded, so a duplicate delivery of a finished job
    #: never turns its state back to STARTED (Celery's tracer would, before the body runs).
    lease_tracks_started: bool | None = None

    @classmethod
    def bind(cls, app: Any) -> Any:
        inherited = getattr(cls, "lease_tracks_started", None)
        own = cls.__dict__.get("track_started")
        bound = super().bind(app)
        if "lease_tracks_started" not in cls.__dict__ and leased(cls):
            tracks = own if own is not None else inherited if inherited is not None else cls.track_started
            cls.lease_tracks_started = bool(tracks)
            cls.track_started = False
        return bound

    @classmethod
    def on_bound(cls, app: Any) -> None:
        from .signals import install

        install(app)

    @property
    def lease(self) -> Lease | local.LocalLease | None:
        """The running job's lease, found through the current request (None outside any run).

        A LeaseTask called directly inside a leased body (the items of ``celery.map``,
        ``celery.starmap`` and ``celery.chunks``) shares the lease of that body. A run outside
        a worker (eager, ``apply()``, a direct call) gets a local handle (local.py).
        """
        rt = runtime.current(self.app)
        lease = rt.lease_for(self.request) if rt is not None else None
        if lease is None and rt is not None and self.request.called_directly:
            for caller in reversed(_task_stack.stack):
                lease = rt.lease_for(caller.request)
                if lease is not None:
                    break
        return lease if lease is not None else local.current()

    def lease_policy(self, queue: str | None = None) -> TaskPolicy:
        """The lease options in force for this task on a queue."""
        return task_policy(self, queue)

    # -- publish -------------------------------------------------------------
    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None, shadow: Any = None,
                    idempotency_key: str | None = None, **options: Any) -> Any:
        """Record the job (once per ``idempotency_key``), then publish it as Celery does."""
        if self.app.conf.task_always_eager or messages.recording_disabled() or not leased(self):
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        return publishing.publish(self, super().apply_async, args, kwargs, task_id or uuid(), producer,
                                  link, link_error, shadow, idempotency_key, options)

    def on_replace(self, sig: Any) -> Any:
        """``Task.replace()``: hand the job's id over to the replacement, then let Celery send it."""
        lease = runtime.own_lease(self)
        if self.request.is_eager or lease is None or lease.job_id != self.request.id:
            return super().on_replace(sig)
        return replacing.hand_over(self, lease, sig, super().on_replace)

    # -- run -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if not leased(self):
            return super().__call__(*args, **kwargs)
        if request.is_eager and not request.called_directly and app_config(self.app).eager_store:
            return _run_leased(self, args, kwargs)
        if request.called_directly or request.is_eager:
            if self.lease is not None:
                return super().__call__(*args, **kwargs)  # inside a leased or local run: share it
            with local.running(self.app, request.id, self.name):
                return super().__call__(*args, **kwargs)
        return _run_leased(self, args, kwargs)


def _run_leased(task: LeaseTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = task.request
    job_id = request.id
    queue = _queue_of(task, request)
    policy = task_policy(task, queue)
    token = secrets.token_hex(16)
    rt: runtime.Runtime | None = None
    try:
        store = for_app(task.app)
        rt = runtime.for_app(task.app, store, request.hostname)
        terms = ClaimTerms(duration=policy.duration, grace=policy.grace_period,
                           max_attempts=policy.max_attempts, max_expirations=policy.max_expirations,
                           takeover=policy.on_expired == Decision.REQUEUE, recovery=policy.recovery())
        # The lease's local deadline counts from when the claim was sent, not answered.
        sent = deadline.monotonic()
        claim = store.claim(
            job_id, rt.worker, token, terms, task_name=task.name, queue=queue,
            payload=lambda: messages.encode(task.name, args, kwargs,
                                            dict(task.signature_from_request(request).options),
                                            task.serializer),
        )
    except StoreUnavailable as exc:
        if request.is_eager:
            raise  # no message to deliver again: the caller sees the outage
        if rt is not None:
            rt.claim_unanswered(job_id, token)  # the server may still commit it
        deliveries.fail_closed(task, policy.store_retry_delay, policy.store_retry_max, exc)
    if claim.outcome == ClaimOutcome.EARLY:
        deliveries.defer_early(task, store, rt.worker, claim.wait)
    assert rt is not None
    if not claim.claimed and claim.job is not None and rt.orphaned_claim(job_id, claim.job.lock_token):
        claim = _reclaim(store, rt, claim, token, terms)
    if not claim.claimed:
        if claim.job is not None and claim.job.status == Status.COMPLETED:
            resumed, value = deliveries.resume_post_run(task, store, rt.worker, claim.job)
            if resumed:
                return value  # Celery's tracer stores it and sends the chain's next step
        deliveries.skip_duplicate(task, store, rt.worker, claim.outcome, claim.job)
    job = claim.job
    assert job is not None
    deliveries.forget_store_retries(request)
    lease = Lease(rt, job_id, token, job.attempt_count, policy,
                  job.idempotency_key or f"{task.name}:{job_id}", job.checkpoint_state(),
                  sent_at=sent, app=task.app, acks_late=bool(task.acks_late))
    rt.attach(request, lease)
    if task.lease_tracks_started and not deliveries.ignores_result(task, request):
        # Celery's task_track_started, once the claim proved this delivery runs the job.
        task.backend.store_result(job_id, {"pid": os.getpid(), "hostname": request.hostname},
                                  states.STARTED, request=request)
    try:
        return _run_body(task, lease, args, kwargs)
    finally:
        rt.detach(request, lease)


def _reclaim(store: Store, rt: runtime.Runtime, claim: Claim, token: str, terms: ClaimTerms) -> Claim:
    """The job runs under a claim of this very process whose answer was lost: take it with ``token``."""
    assert claim.job is not None and claim.job.lock_token is not None
    lost = claim.job.lock_token
    try:
        job = store.reclaim(claim.job.id, lost, rt.worker, token, terms)
    except (StoreUnavailable, StoreRejected) as exc:
        log.warning("job %s: could not take back the claim whose answer was lost (%s)", claim.job.id, exc)
        return claim
    if job is None:
        return claim
    rt.forget_unanswered(lost)
    log.info("job %s [%s]: took back this process's claim [%s] whose answer was lost", job.id, token[:8],
             lost[:8], extra={"action": "lost_claim_taken_back"})
    return Claim(ClaimOutcome.CLAIMED, job)


def _dead_letter(task: LeaseTask, store: Store, job_id: str, policy: TaskPolicy) -> None:
    """Park a failed job's message on the dead-letter queue, when one is configured."""
    if not policy.dead_letter_queue:
        return
    job = store.get(job_id)
    messages.republish(task.app, job_id, job.payload if job else None, queue=policy.dead_letter_queue)
    store.event(job_id, Event.DEAD_LETTER_PUBLISHED, policy.dead_letter_queue)


def _worker_terminating() -> bool:
    """True once a cold shutdown began in this worker (Celery's own flag)."""
    from celery.worker import state

    return bool(state.should_terminate)


def _worker_leaving(exc: BaseException) -> bool:
    """True when a BaseException means the worker is shutting down, not that the body failed."""
    from celery.worker import state

    if isinstance(exc, (WorkerShutdown, WorkerTerminate)) or state.should_stop or state.should_terminate:
        return True
    # A prefork child's terminate handler raises SystemExit inside whatever runs (billiard
    # tells it from the body's own with a flag of its own, where it has one).
    from billiard import common

    fired = getattr(common, "terminate_handler_fired", None)
    return bool(fired is not None and fired())


def _fail(task: LeaseTask, lease: Lease, exc: BaseException) -> None:
    """A final failure of the attempt: the job is failed (and dead-lettered); Ignore if it moved on.

    A store that does not take the write (down, or a lock it waited on too long) gets it later,
    as a deferred completion does: the lease is kept and renewed, and Celery still sees the
    body's own exception.
    """
    error = f"{type(exc).__name__}: {exc}"
    try:
        failed = lease.store.fail(lease.job_id, lease.token, error, lease.worker)
    except StoreUnavailable as unavailable:
        log.error("job %s [%s] failed but the store is unreachable (%s); failure deferred",
                  lease.job_id, lease.token[:8], unavailable, extra={"action": "failure_deferred"})
        lease.deferred_failure = error
        lease.after_failure = lambda: _dead_letter(task, lease.store, lease.job_id, lease.policy)
        lease.runtime.defer_completion(lease)
        return
    if not failed:
        raise Ignore() from exc
    _dead_letter(task, lease.store, lease.job_id, lease.policy)


def _call(task: LeaseTask, lease: Lease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Celery's ``Task.__call__``, with the body's own request context resolved to its lease."""
    _task_stack.push(task)
    # A copy of the worker's request, as Celery >= 5.5 makes itself: before 5.5 push_request
    # starts from a blank one, and the body would see no id, hostname or delivery_info.
    task.push_request(**{**task.request.__dict__, "args": args, "kwargs": kwargs})
    request = task.request
    lease.runtime.bind(request, lease)
    try:
        return task.run(*args, **kwargs)
    finally:
        lease.runtime.unbind(request, lease)
        task.pop_request()
        _task_stack.pop()


def _run_body(task: LeaseTask, lease: Lease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    try:
        with lease.body():
            result = _call(task, lease, args, kwargs)
    except LeaseLost as exc:
        log.warning("job %s [%s] stopped: %s", job_id, token[:8], exc, extra={"action": "lease_lost"})
        raise Ignore() from exc
    except Retry as exc:
        if lease.retried:
            raise  # the row became pending before the retry's message was sent
        payload = None
        if exc.sig is not None:
            payload = messages.encode(exc.sig.task, exc.sig.args, exc.sig.kwargs, dict(exc.sig.options),
                                      task.serializer)
        if not store.retry_later(job_id, token, publishing.seconds_until(exc.when), payload,
                                 str(exc.exc or exc), worker):
            raise Ignore() from exc
        raise
    except Ignore:
        if lease.handed_over:
            raise  # Task.replace(): the replacement carries the job on
        # The task chose to drop its result: the job is still over.
        store.complete(job_id, token, worker)
        raise
    except Reject as exc:
        if exc.requeue:
            store.release(job_id, token, worker, reason=Event.REJECTED_REQUEUE)
        else:
            store.fail(job_id, token, f"rejected: {exc.reason}", worker)
        raise
    except Exception as exc:
        if _worker_terminating():
            # A cold shutdown of a solo pool raises Celery's own error inside the body:
            # the job did not fail, the worker left. Give it back and requeue its message.
            with contextlib.suppress(StoreUnavailable, StoreRejected):
                lease.give_back(Event.RELEASED_ON_SHUTDOWN)
            raise Reject(f"worker shutting down: {type(exc).__name__}", requeue=True) from exc
        _fail(task, lease, exc)
        raise
    except BaseException as exc:
        if _worker_leaving(exc):
            # The worker is shutting down mid-body: give the job back.
            with contextlib.suppress(StoreUnavailable, StoreRejected):
                lease.give_back(Event.RELEASED_ON_SHUTDOWN)
            raise
        # The body's own SystemExit or KeyboardInterrupt, or gevent's hard time limit
        # (gevent.Timeout): a failed attempt, final as in plain Celery.
        _fail(task, lease, exc)
        raise
    if lease.lost:
        # Lost while finishing: the completion below is fenced and will be rejected.
        log.warning("job %s [%s] finished after losing its lease", job_id, token[:8])
    lease.kept_result = deliveries.keepable_result(task, result)
    try:
        completed = store.complete(job_id, token, worker, lease.kept_result)
    except StoreUnavailable as exc:
        log.error("job %s [%s] finished but the store is unreachable (%s); completion deferred",
                  job_id, token[:8], exc, extra={"action": "completion_deferred"})
        lease.runtime.defer_completion(lease)
        return result
    if not completed:
        log.warning("job %s [%s]: completion rejected, the lease moved on", job_id, token[:8],
                    extra={"action": "stale_completion_rejected"})
        raise Ignore()
    return result
