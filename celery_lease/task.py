"""LeaseTask, the base class, and Lease, the running job's handle.

A LeaseTask records its job when published, claims a lease before the body runs,
and completes, fails or reschedules the job with the lease's token afterwards. A
delivery for a job that someone else holds, or that is finished, does not run the
body: it is acknowledged and audited as ``duplicate_delivery_skipped``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import threading
from collections.abc import Iterator
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from . import deliveries, heartbeat, messages
from .config import TaskPolicy, task_policy
from .errors import LeaseLost, StoreUnavailable
from .store import ClaimTerms, Store, for_app
from .vocabulary import ClaimOutcome, Decision, Event

__all__ = ["LeaseTask", "Lease"]

log = logging.getLogger(__name__)


class Lease:
    """The running job's lease: its token, attempt, checkpoint and fenced helpers."""

    def __init__(self, store: Store, hb: heartbeat.Heartbeat, job_id: str, token: str, attempt: int,
                 policy: TaskPolicy, idempotency_key: str, checkpoint_state: Any,
                 app: Any = None, acks_late: bool = True) -> None:
        self.store = store
        self.app = app
        self.acks_late = acks_late
        self.heartbeat = hb
        self.job_id = job_id
        self.token = token
        self.attempt = attempt
        self.policy = policy
        self.idempotency_key = idempotency_key
        self.checkpoint_state = checkpoint_state
        self.worker = hb.worker
        self.lost = False
        self.lost_reason: str | None = None
        self.lost_owner: str | None = None
        self.started_at = heartbeat.monotonic()
        self.renewed_at = self.started_at
        self._thread_id: int | None = None
        self._in_body = False
        self.finishing = False
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"<Lease job={self.job_id} token={self.token[:8]} attempt={self.attempt}>"

    def check(self) -> None:
        """Raise LeaseLost if the lease moved on."""
        if self.lost:
            raise LeaseLost(self.job_id, self.lost_reason or "lost", self.lost_owner)

    def extend(self, seconds: float) -> None:
        """Renew now with a longer lease, before a long blocking call."""
        self.check()
        if not self.heartbeat.extend(self, float(seconds)):
            self.check()

    def checkpoint(self, state: Any) -> None:
        """Save JSON progress under the token; a later attempt reads ``checkpoint_state``."""
        self.check()
        if not self.store.checkpoint(self.job_id, self.token, state, self.worker):
            self.mark_lost("checkpoint rejected: token no longer matches")
            self.check()
        self.checkpoint_state = state

    def effect(self, key: str, connection: Any = None) -> Any:
        """``with lease.effect(key) as first:`` records a side effect once per key."""
        from .effects import effect

        return effect(self, key, connection)

    def lock(self, resource: str, ttl: float | None = None, timeout: float | None = None) -> Any:
        """``with lease.lock(resource):`` a lease on a business resource."""
        from .effects import lock

        return lock(self, resource, ttl, timeout)

    def give_back(self, reason: Event = Event.RELEASED_ON_SHUTDOWN) -> bool:
        """Release the lease so the job runs again soon, re-sending its message if already acked."""
        if not self.store.release(self.job_id, self.token, self.worker, reason):
            return False
        if not self.acks_late and self.app is not None:
            # The broker forgot the message when it was acknowledged on delivery.
            job = self.store.get(self.job_id)
            try:
                messages.republish(self.app, self.job_id, job.payload if job else None)
            except Exception as exc:  # noqa: BLE001 - the dispatch scan re-sends it later
                log.warning("job %s released but not re-sent (%s); the reaper will re-dispatch it",
                            self.job_id, exc, extra={"action": "release_republish_failed"})
        return True

    def past_max_runtime(self, now: float) -> bool:
        limit = self.policy.max_runtime
        return limit is not None and now - self.started_at > limit

    def mark_lost(self, reason: str, owner: str | None = None) -> None:
        """Flag the lease lost; with ``lease_on_lost='raise'`` interrupt the body too."""
        with self._guard:
            if self.lost:
                return
            self.lost, self.lost_reason, self.lost_owner = True, reason, owner
            log.warning("lease on job %s [%s] lost: %s%s", self.job_id, self.token[:8], reason,
                        f" (now held by {owner})" if owner else "", extra={"action": "lease_lost"})
            if self.policy.on_lost == "raise" and self._in_body and self._thread_id is not None:
                heartbeat.raise_in_thread(self._thread_id, self._async_error())

    def _async_error(self) -> type[LeaseLost]:
        # The interpreter instantiates an asynchronous exception with no arguments.
        job_id, reason, owner = self.job_id, self.lost_reason or "lost", self.lost_owner

        def __init__(error: LeaseLost) -> None:
            LeaseLost.__init__(error, job_id, reason, owner)

        return type("LeaseLost", (LeaseLost,), {"__init__": __init__, "__module__": __name__})

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """Mark the task body as running so a lost lease may interrupt it."""
        with self._guard:
            self._thread_id = threading.get_ident()
            self._in_body = True
        try:
            yield
        finally:
            with self._guard:
                self._in_body = False
                self.finishing = True
                if self.lost and self.policy.on_lost == "raise" and self._thread_id is not None:
                    # An interruption queued just as the body returned must not land
                    # in the bookkeeping that follows.
                    heartbeat.raise_in_thread(self._thread_id, None)


# The leases of the jobs running in this process, by job id. Kept off the request
# context, which Celery copies into retries and canvas options.
_running: dict[str, Lease] = {}


def _queue_of(task: Task, request: Any) -> str | None:
    info = request.delivery_info or {}
    return info.get("routing_key") or getattr(task, "queue", None) or task.app.conf.task_default_queue


def _seconds_until(when: Any) -> float:
    if when is None:
        return 0.0
    if isinstance(when, datetime.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    return max(0.0, float(when))


class LeaseTask(Task):
    """A Celery task that runs only while its worker holds a lease on the job."""

    lease_store_retry_delay: float | None = None
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

    @classmethod
    def on_bound(cls, app: Any) -> None:
        from .signals import install

        install(app)

    @property
    def lease(self) -> Lease | None:
        """The running job's lease (None outside a leased run)."""
        return _running.get(self.request.id) if self.request.id else None

    def lease_policy(self, queue: str | None = None) -> TaskPolicy:
        """The lease options in force for this task on a queue."""
        return task_policy(self, queue)

    # -- publish -------------------------------------------------------------
    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None, shadow: Any = None,
                    idempotency_key: str | None = None, **options: Any) -> Any:
        """Record the job (once per ``idempotency_key``), then publish it as Celery does."""
        eager = self.app.conf.task_always_eager
        if eager or messages.recording_disabled():
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        task_id = task_id or uuid()
        route = self.app.amqp.router.route(dict(options), self.name, args, kwargs)
        queue = getattr(route.get("queue"), "name", None)
        policy = task_policy(self, queue)
        payload = messages.encode(self.name, args, kwargs, {
            **options, "link": link, "link_error": link_error, "shadow": shadow,
        }, options.get("serializer") or self.serializer)
        delay = _seconds_until(options.get("eta")) or _seconds_until(options.get("countdown"))
        store = for_app(self.app)
        created, holder = store.record(task_id, self.name, queue, payload, policy.max_attempts,
                                       idempotency_key, delay, recovery=policy.recovery())
        if holder != task_id:
            log.info("task %s not published again: idempotency key %r belongs to job %s",
                     self.name, idempotency_key, holder, extra={"action": "idempotent_publish"})
            return self.AsyncResult(holder)
        try:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        except BaseException:
            if created:
                store.forget_unpublished(task_id)
            raise

    # -- run -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return super().__call__(*args, **kwargs)
        return _run_leased(self, args, kwargs)


def _run_leased(task: LeaseTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = task.request
    job_id = request.id
    queue = _queue_of(task, request)
    policy = task_policy(task, queue)
    token = secrets.token_hex(16)
    try:
        store = for_app(task.app)
        hb = heartbeat.for_process(task.app, store, request.hostname)
        terms = ClaimTerms(duration=policy.duration, grace=policy.grace_period,
                           max_attempts=policy.max_attempts, max_expirations=policy.max_expirations,
                           takeover=policy.on_expired == Decision.REQUEUE, recovery=policy.recovery())
        claim = store.claim(
            job_id, hb.worker, token, terms, task_name=task.name, queue=queue,
            payload=lambda: messages.encode(task.name, args, kwargs,
                                            dict(task.signature_from_request(request).options),
                                            task.serializer),
        )
    except StoreUnavailable as exc:
        deliveries.fail_closed(task, policy.store_retry_delay, exc)
    if claim.outcome == ClaimOutcome.EARLY:
        deliveries.defer_early(task, store, hb.worker, claim.wait)
    if not claim.claimed:
        deliveries.skip_duplicate(task, store, hb.worker, claim.outcome, claim.job)
    job = claim.job
    assert job is not None
    lease = Lease(store, hb, job_id, token, job.attempt_count, policy,
                  job.idempotency_key or f"{task.name}:{job_id}", job.checkpoint_state(),
                  app=task.app, acks_late=bool(task.acks_late))
    _running[job_id] = lease
    hb.add(lease)
    try:
        return _run_body(task, lease, args, kwargs)
    finally:
        hb.remove(lease)
        _running.pop(job_id, None)


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


def _run_body(task: LeaseTask, lease: Lease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    store, job_id, token, worker = lease.store, lease.job_id, lease.token, lease.worker
    try:
        with lease.body():
            result = Task.__call__(task, *args, **kwargs)
    except LeaseLost as exc:
        log.warning("job %s [%s] stopped: %s", job_id, token[:8], exc, extra={"action": "lease_lost"})
        raise Ignore() from exc
    except Retry as exc:
        payload = None
        if exc.sig is not None:
            payload = messages.encode(exc.sig.task, exc.sig.args, exc.sig.kwargs, dict(exc.sig.options),
                                      task.serializer)
        if not store.retry_later(job_id, token, _seconds_until(exc.when), payload,
                                 str(exc.exc or exc), worker):
            raise Ignore() from exc
        raise
    except Ignore:
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
            with contextlib.suppress(StoreUnavailable):
                lease.give_back(Event.RELEASED_ON_SHUTDOWN)
            raise Reject(f"worker shutting down: {type(exc).__name__}", requeue=True) from exc
        if not store.fail(job_id, token, f"{type(exc).__name__}: {exc}", worker):
            raise Ignore() from exc
        _dead_letter(task, store, job_id, lease.policy)
        raise
    except BaseException:
        # Interpreter or worker shutting down mid-body: give the job back.
        with contextlib.suppress(StoreUnavailable):
            lease.give_back(Event.RELEASED_ON_SHUTDOWN)
        raise
    if lease.lost:
        # Lost while finishing: the completion below is fenced and will be rejected.
        log.warning("job %s [%s] finished after losing its lease", job_id, token[:8])
    try:
        completed = store.complete(job_id, token, worker)
    except StoreUnavailable as exc:
        log.error("job %s [%s] finished but the store is unreachable (%s); completion deferred",
                  job_id, token[:8], exc, extra={"action": "completion_deferred"})
        lease.heartbeat.defer_completion(lease)
        return result
    if not completed:
        log.warning("job %s [%s]: completion rejected, the lease moved on", job_id, token[:8],
                    extra={"action": "stale_completion_rejected"})
        raise Ignore()
    return result
