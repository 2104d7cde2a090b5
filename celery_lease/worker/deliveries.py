"""Deliveries whose body must not run now (store down, job not available yet, leased or finished): acked,
logged and audited, the first two sent again for later (re-sends for an outage counted in the message's
header, messaging/messages.py)."""

from __future__ import annotations

import collections
import datetime
import logging
import random
import threading
from typing import Any, NoReturn

from celery import Task
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore, Reject

import celery_lease.messaging.backend as results
import celery_lease.messaging.messages as messages

from ..backoff import store_retry_delay
from ..context import RESUMED as _resumed
from ..errors import StoreRejected, StoreUnavailable
from ..store import Job, Store
from ..vocabulary import ClaimOutcome, Event, Status

__all__ = ["send_again", "fail_closed", "defer_early", "skip_duplicate", "skip_replaced_copy",
           "send_pending_step", "resumed", "resume_post_run", "FailedClosed", "FailedClosedRequeued",
           "StoreDown"]

log = logging.getLogger(__name__)

class StoreDown:
    """Marks the way out of a delivery that found the store unreachable (see FailedClosed)."""


class FailedClosed(StoreDown, Ignore):
    """The store was unreachable: the message was sent again for later and this delivery is acked."""


class FailedClosedRequeued(StoreDown, Reject):
    """The store was unreachable and the broker refused the re-send: the delivery goes back to its queue."""


def _send_again(task: Task, countdown: float, why: str, headers: dict[str, Any] | None = None,
                requeued: type[Reject] = Reject) -> None:
    """Re-send this delivery's message in ``countdown`` seconds; ``requeued`` if the broker refuses it."""
    request = task.request
    options: dict[str, Any] = {"countdown": countdown}
    if headers is not None:
        options["headers"] = headers
    sig = task.signature_from_request(request, **options)
    try:
        with messages.publishing_unrecorded():
            sig.apply_async()
    except Exception as publish_error:  # noqa: BLE001 - the broker is failing too
        log.error("job %s: cannot re-send (%s); rejecting with requeue", request.id, publish_error)
        raise requeued(why, requeue=True) from publish_error


def send_again(task: Task, why: str) -> None:
    """Send this delivery's message again now (Reject with requeue when the broker refuses it)."""
    _send_again(task, 0.0, why)


def fail_closed(task: Task, base: float, cap: float, exc: StoreUnavailable, rng: Any = random) -> NoReturn:
    """The store is down: send the message again later, each time later, and do not run the body."""
    request = task.request
    retries = messages.store_retries(request)
    delay = store_retry_delay(retries, base, cap, rng)
    log.warning("job %s not started, lease store unreachable (%s); delivering again in %.1fs (re-send %d)",
                request.id, exc, delay, retries + 1, extra={"action": "fail_closed"})
    headers = {**(getattr(request, "headers", None) or {}), messages.STORE_RETRIES_HEADER: retries + 1}
    _send_again(task, delay, str(exc), headers, FailedClosedRequeued)
    raise FailedClosed(str(exc))


def defer_early(task: Task, store: Store, worker: str, wait: float) -> NoReturn:
    """The job is not available yet (a copy of its message came early): send it for then."""
    job_id = task.request.id
    log.info("job %s delivered %.1fs before it is available: sent again for then", job_id, wait,
             extra={"action": "early_delivery_deferred"})
    _audit(store, job_id, Event.EARLY_DELIVERY_DEFERRED, f"available in {wait:.1f}s", worker,
           {"wait": round(wait, 3)})
    _send_again(task, wait, "delivered before the job is available")
    raise Ignore()


def _defer_if_owner_may_be_finishing(task: Task, store: Store, worker: str, job: Any) -> None:
    """Send this delivery again for later when the job completed less than a lease ago: its owner may not have
    stored the result yet, and that is no crash."""
    completed_at = getattr(job, "completed_at", None)
    settle = float(getattr(job, "lease_duration", None) or 0.0)
    if completed_at is None or settle <= 0:
        return
    try:
        now = store.now()
    except (StoreUnavailable, StoreRejected):
        now = completed_at  # the store's clock is out of reach: look again after a whole lease
    wait = completed_at + settle - now
    if wait <= 0:
        return
    log.info("job %s completed %.1fs ago and its result is not stored yet: delivery sent again in %.1fs",
             job.id, settle - wait, wait, extra={"action": "early_delivery_deferred"})
    _audit(store, job.id, Event.EARLY_DELIVERY_DEFERRED, f"completed {settle - wait:.1f}s ago, result not "
           f"stored yet", worker, {"wait": round(wait, 3), "after": "completion"})
    _send_again(task, wait, "completed moments ago; its owner may still store the result")
    raise Ignore()


def _audit(store: Store, job_id: str, event: Event, reason: str, worker: str, detail: Any) -> None:
    """Audit a delivery whose body does not run; a store outage costs the event, not the delivery (raising
    would let Celery write FAILURE for a job another delivery runs)."""
    try:
        store.event(job_id, event, reason, worker, detail=detail)
    except (StoreUnavailable, StoreRejected) as exc:
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
    if outcome == ClaimOutcome.DONE and _vanished(store, job_id):
        # A restore or failover forgot the finished job: this message is all that is left of it.
        log.error("job %s: its row vanished from the store while a duplicate delivery was skipped; "
                  "delivery sent again, it runs as a first one", job_id,
                  extra={"action": "job_recorded_again"})
        send_again(task, "its row vanished from the store")
    raise Ignore()


def skip_replaced_copy(task: Task, store: Store, worker: str, step: Job | None) -> NoReturn:
    """A copy of a replaced run's message: not run, or it would replace the job a second time."""
    send_pending_step(task.app, task.request.id, step)
    skip_duplicate(task, store, worker, ClaimOutcome.REPLACED, None)


def send_pending_step(app: Any, job_id: str, step: Job | None) -> bool:
    """Send the stored message of the pending row that carries a replaced job on again (its chain's first
    step, or its own row holding the replacement's message): after a hand-over whose answer was lost, that
    row is all that carries the job."""
    if step is None or step.status != Status.PENDING:
        return False
    what = "its replacement" if step.id == job_id else f"its chain's first step {step.id}"
    try:
        messages.republish(app, step.id, step.payload)
    except Exception as exc:  # noqa: BLE001 - the step stays pending: the dispatch scan sends it
        log.warning("job %s: %s not sent again (%s); the dispatch scan will", job_id, what, exc)
        return False
    log.info("job %s: %s, pending, sent again", job_id, what, extra={"action": "replaced_step_sent_again"})
    return True


def _vanished(store: Store, job_id: str) -> bool:
    """Whether the store has no row for ``job_id`` now (an unreachable store: it had one a moment ago)."""
    try:
        return store.get(job_id) is None
    except (StoreUnavailable, StoreRejected):
        return False


def resumed(job_id: str) -> bool:
    """Whether this context is finishing ``job_id``'s post-run work (resume_post_run)."""
    return _resumed.get() == job_id


def _why_not_resumable(task: Task, store: Store, job: Any) -> str | None:
    """Why a missing result would not prove a crash interrupted the post-run work (None if it would)."""
    backend = task.backend
    if isinstance(backend, RPCBackend):
        return "the rpc:// backend sends results to the caller, a worker cannot read them"
    if not getattr(backend, "persistent", True):
        return "the result backend is not persistent"
    expires = task.app.conf.result_expires
    if isinstance(expires, datetime.timedelta):
        expires = expires.total_seconds()
    completed_at = getattr(job, "completed_at", None)
    if expires and completed_at is not None:
        age = store.now() - completed_at  # unreachable: the delivery is sent again (fail closed)
        if age >= float(expires):
            return f"completed {age:.0f}s ago, past result_expires ({float(expires):.0f}s)"
    return None


def resume_post_run(task: Task, store: Store, worker: str, job: Any) -> tuple[bool, Any]:
    """(True, result) when a completed job's result is missing from the backend (or is a FAILURE), so a crash
    or a failure interrupted its post-run work: Celery's tracer finishes it with the kept result; the body
    does not run.
    StoreUnavailable when the store or backend cannot answer."""
    request = task.request
    if not messages.has_results(task):
        return False, None
    unsafe = _why_not_resumable(task, store, job)
    if unsafe is not None:
        log.info("job %s completed; its result cannot be checked (%s): duplicate delivery skipped", job.id,
                 unsafe, extra={"action": "duplicate_delivery_skipped"})
        return False, None
    try:
        state = results.of(task.app, task.backend).get_state(job.id)
    except Exception as exc:  # noqa: BLE001 - any backend failure: ask again later
        # Skipped now, a crash's unfinished post-run work would never be done: send it again.
        raise StoreUnavailable(f"job {job.id}: result backend unreadable ({exc}); the duplicate is checked "
                               "again later", job_id=job.id) from exc
    if results.post_run_finished(state):
        return False, None
    kept = store.jobs.kept_result(job.id)
    if kept is None:
        return False, None
    _defer_if_owner_may_be_finishing(task, store, worker, job)
    accept = task.app.conf.result_accept_content or task.app.conf.accept_content
    value = messages.decode_result(kept, accept, job.id)
    _resumed.set(job.id)
    log.warning("job %s completed but its result was never stored (state %s): storing the kept result "
                "and continuing its canvas; the body does not run again", job.id, state,
                extra={"action": "post_run_resumed"})
    _audit(store, job.id, Event.POST_RUN_RESUMED, f"result backend state was {state}", worker,
           {"redelivered": bool((request.delivery_info or {}).get("redelivered"))})
    return True, value


UNANSWERED_KEPT = 1000  # unanswered claim tokens a process remembers


class UnansweredClaims:
    """The claims a process sent and gave up on unanswered (the newest UNANSWERED_KEPT), by token: the
    server may have committed one that no body runs."""

    def __init__(self) -> None:
        self._claims: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._mutex = threading.Lock()

    def remember(self, job_id: str, token: str, app: Any) -> None:
        with self._mutex:
            self._claims[token] = (job_id, app)
            while len(self._claims) > UNANSWERED_KEPT:
                self._claims.popitem(last=False)

    def orphaned(self, job_id: str, token: str | None) -> bool:
        """Whether ``token`` on ``job_id`` is a claim of ours whose answer was lost (no body runs it)."""
        with self._mutex:
            return token is not None and self._claims.get(token, ("",))[0] == job_id

    def forget(self, token: str) -> None:
        with self._mutex:
            self._claims.pop(token, None)

    def release(self, store: Store, worker: str) -> None:
        """The heartbeat's part: give back those the store did commit (release_unanswered)."""
        with self._mutex:
            claims = [(token, job_id, app) for token, (job_id, app) in self._claims.items()]
        for token in release_unanswered(store, worker, claims) if claims else ():
            self.forget(token)


def release_unanswered(store: Store, worker: str, claims: list[tuple[str, str, Any]]) -> list[str]:
    """Give back, fenced on their tokens, the claims (token, job id, app) this process gave up on unanswered
    that the store did commit, and send each such job's message again: no body runs it, and the copy sent
    when the claim failed may have been skipped elsewhere as a duplicate of this very claim. Returns the
    tokens settled (released, or never committed); the rest wait for the store to answer."""
    settled: list[str] = []
    for token, job_id, app in claims:
        try:
            job = store.get(job_id)
            released = (job is not None and job.status == Status.RUNNING and job.lock_token == token
                        and store.jobs.release(job_id, token, worker, Event.RELEASED_AFTER_OUTAGE))
        except StoreUnavailable:
            break
        except StoreRejected as exc:
            log.error("job %s [%s]: the claim whose answer was lost could not be given back (%s); left to "
                      "the reaper", job_id, token[:8], exc, extra={"action": "give_back_rejected"})
            released = False
        settled.append(token)
        if not released or job is None:
            continue
        log.warning("job %s [%s]: a claim whose answer was lost had committed; given back and sent again",
                    job_id, token[:8], extra={"action": Event.RELEASED_AFTER_OUTAGE})
        try:
            messages.republish(app, job_id, job.payload)
        except Exception as exc:  # noqa: BLE001 - the reaper's dispatch scan sends it later
            log.warning("job %s: not sent again (%s); the reaper's dispatch scan will", job_id, exc)
    return settled
