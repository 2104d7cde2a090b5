"""Thin hooks into the worker: start-up checks, lost children, store outages, revokes and shutdown; a failure
in one is logged and contained, except at start-up, where a bad setting must stop the worker."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

from celery import bootsteps, platforms, signals
from celery.concurrency.base import BasePool
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request
from celery.worker.state import task_ready

import celery_lease.messaging.backend as results
import celery_lease.worker.runtime as runtime

from ..app_state import app_state
from ..config import app_config, check_recovery_bound, task_policy
from ..errors import LeaseConfigError, LeaseError, StoreUnavailable
from ..kinds import is_lease_task
from ..masking import mask_secrets
from ..vocabulary import CancelReason, Event, OnLost, WorkerLostOutcome
from ..worker.deliveries import StoreDown
from ..worker.outage import PauseStep, store_unreachable
from ..worker.threads import worker_id

__all__ = ["LeaseRequest", "WorkerStep", "install"]

log = logging.getLogger(__name__)


class LeaseRequest(Request):
    """A request whose main-process failure handler settles the lease of a dead pool child, and pauses the
    consumer when the delivery found the store unreachable. A child lost by accident is re-run by the
    lease, so Celery must not report that attempt as a failure."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if isinstance(exc, StoreDown):
            store_unreachable(self.task.app, str(exc))
        if self.worker_pid and isinstance(exc, TimeLimitExceeded):
            # acks_on_timeout=False: Celery requeues the message, so the lease requeues without sending.
            again = bool(self.task.acks_late) and not acks_on_timeout(self.task)
            if again and not return_ok:
                # Billiard's hard time limit (a body that raises TimeLimitExceeded itself comes through
                # on_success, return_ok). Billiard kills the child only after every failure handler (the
                # result backend, errbacks, task_failure receivers), and Celery requeues the message
                # before that: killed first, the child cannot run beside a copy another process claims.
                _kill_child(self.worker_pid)
            outcome = _settle_dead_child(self, type(exc).__name__, final=not again, resend=not again)
            self._lease_settled = outcome != WorkerLostOutcome.NONE
            # Billiard's on_timeout, called next, stores FAILURE and fires the errbacks: not twice.
            return super().on_failure(exc_info, send_failed_event=False, return_ok=True)
        if self.worker_pid and exc is not None and self._child_lost(exc):
            if self._stored_success():
                # The child died after its run (a task_postrun receiver, process_cleanup): Celery 5.7 acks
                # and reports the success; the lease completes the job rather than run it again.
                self._lease_settled = True
                _settle_dead_child(self, type(exc).__name__, final=False, succeeded=True)
                return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
            outcome = _settle_dead_child(self, type(exc).__name__, final=False)
            if outcome in RERUN:
                return self._rerun_by_lease(exc, exc_info, outcome)
            self._lease_settled = outcome != WorkerLostOutcome.NONE
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> bool:
        """Celery 5.7's ``task_retry_on_worker_lost``, except for a job whose lease already decided: its
        re-sent message would only be skipped, after overwriting FAILURE with RETRY."""
        if getattr(self, "_lease_settled", False):
            return False
        return bool(super()._retry_worker_lost(exc, exc_info))

    def _stored_success(self) -> bool:
        """Celery 5.7's check that the run stored SUCCESS before its child was lost (False before 5.7, which
        has none: the child's job is settled as lost, as Celery fails it)."""
        check = getattr(super(), "_success_was_stored", None)
        try:
            return bool(check and check())
        except Exception as exc:  # noqa: BLE001 - an unreadable backend: settled as a lost child
            log.warning("job %s: could not ask the result backend whether the lost child's run "
                        "succeeded (%s)", self.id, exc)
            return False

    def terminate(self, pool: Any, signal: Any = None) -> Any:
        """``revoke(terminate=True)``: cancel the job, fenced by the terminated process's owner (the main
        process never sees a child's token), then let Celery kill the run."""
        # Threads and solo cannot terminate a run (Celery raises NotImplementedError): it goes on. SIGUSR1
        # raises SoftTimeLimitExceeded in the body, which may clean up and return: its run ends as it ends,
        # as in Celery, so nothing is cancelled before it.
        if self.time_start and self.worker_pid and _can_terminate(pool) and not _soft_signal(signal):
            _cancel_terminated(self)
        return super().terminate(pool, signal)

    def _child_lost(self, exc: Any) -> bool:
        # Billiard reports a child's exit as SystemExit before Celery turns it into WorkerLostError.
        if self._already_cancelled or self._already_revoked:
            return False  # terminated on purpose: the revoke cancelled the job
        return isinstance(exc, (SystemExit, KeyboardInterrupt, WorkerLostError))

    def _rerun_by_lease(self, exc: BaseException, exc_info: Any, outcome: WorkerLostOutcome) -> None:
        """The lease re-sends the job (or already moved on): no FAILURE, no errback; RETRY as Celery's own,
        and the message acked."""
        task_ready(self)
        if self.store_errors:
            results.of(self.task.app, self.task.backend).mark_as_retry(
                self.id, exc, getattr(exc_info, "traceback", None), request=self._context)
        if self.task.acks_late:
            self.acknowledge()
        self.send_event("task-retried", exception=repr(exc))
        log.info("job %s: pool child lost, %s by the lease; not reported to Celery as a failure",
                 self.id, outcome, extra={"action": "worker_lost_rerun"})


# What recover_worker_lost answers when the job runs again (or someone else holds it).
RERUN = (WorkerLostOutcome.REQUEUE, WorkerLostOutcome.LOST_RACE, WorkerLostOutcome.ERROR,
         WorkerLostOutcome.STORE_UNAVAILABLE)


def _can_terminate(pool: Any) -> bool:
    # Prefork binds billiard's terminate_job on the instance; threads and solo keep BasePool's.
    return getattr(pool.terminate_job, "__func__", None) is not BasePool.terminate_job


def _soft_signal(sig: Any) -> bool:
    """Whether a terminate signal is billiard's soft time limit (SIGUSR1): the child lives on."""
    try:
        return platforms.signals.signum(sig or "TERM") == signal.SIGUSR1
    except (TypeError, ValueError):
        return False


def _cancel_terminated(request: LeaseRequest) -> None:
    owner = worker_id(request.hostname, request.worker_pid)
    _cancel(request.task.app, request.id, CancelReason.TERMINATED, owner)


def _cancel(app: Any, job_id: str, reason: CancelReason, owner: str | None = None,
            task_name: str | None = None, queue: str | None = None) -> None:
    """Cancel a job from a hook: an outage keeps the cancel for later, and no error reaches Celery, which acks
    the revoked delivery whatever happens here."""
    try:
        from ..store import for_app

        store = for_app(app, check=False)
        runtime.for_app(app, store).kept_writes.cancel(job_id, reason, owner, task_name, queue)
    except Exception as error:  # noqa: BLE001 - a hook never raises into Celery's revoke
        log.warning("job %s: could not cancel it (%s): %s", job_id, reason, error)


def acks_on_timeout(task: Any) -> bool:
    """Whether a hard time limit acks the message (Celery 5.7's ``acks_on_timeout``, else
    ``acks_on_failure_or_timeout``)."""
    value = getattr(task, "acks_on_timeout", None)
    if value is None:
        value = getattr(task, "acks_on_failure_or_timeout", None)
    return True if value is None else bool(value)


def _kill_child(pid: int) -> None:
    """SIGKILL a timed-out pool child now rather than after Celery's handlers (billiard's own SIGTERM, then
    SIGKILL 0.1 s later, finds it dead and reaps it). Only a live child of this process: a pid billiard
    already reaped may name another process by now (and without /proc nothing is killed here)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return
    if state not in ("Z", "X") and int(parent) == os.getpid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _settle_dead_child(request: LeaseRequest, reason: str, final: bool, resend: bool = True,
                       succeeded: bool = False) -> WorkerLostOutcome:
    owner = worker_id(request.hostname, request.worker_pid)
    from ..reaper.worker_lost import complete_worker_lost, recover_worker_lost

    app, job_id = request.task.app, request.id
    try:
        if succeeded:
            return complete_worker_lost(app, job_id, owner, reason)
        return recover_worker_lost(app, job_id, owner, reason, final=final, resend=resend)
    except StoreUnavailable as error:
        if not succeeded:
            log.warning("job %s: could not settle the lease of dead child %s: %s", job_id, owner, error)
            return WorkerLostOutcome.STORE_UNAVAILABLE
        # Celery acks the message and keeps SUCCESS: the completion is kept and written once the store
        # answers (the reaper holds back for a lease's time after an outage), never left to a re-run.
        from ..store import for_app

        runtime.for_app(app, for_app(app, check=False)).kept_writes.keep(
            job_id, "completion", lambda: complete_worker_lost(app, job_id, owner, reason))
        return WorkerLostOutcome.STORE_UNAVAILABLE
    except LeaseError as error:
        log.warning("job %s: could not settle the lease of dead child %s: %s", request.id, owner, error)
        # The lease expires and the reaper settles it (a final failure is then a re-run).
        return WorkerLostOutcome.STORE_UNAVAILABLE


class WorkerStep(bootsteps.StartStopStep):
    """At worker start: validate the lease settings and every LeaseTask's options on each queue it may run on,
    and check the store's schema (an older one is refused, never upgraded)."""

    label = "celery_lease"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        try:
            self._check(worker)
        except LeaseError as exc:
            from celery.apps.worker import Worker as CommandLineWorker

            if not isinstance(worker, CommandLineWorker):
                raise  # an embedded worker (start_worker, a test's) gives its caller the error itself
            # One line, as `celery lease` prints it: Celery's traceback buries it under dozens of frames.
            log.critical("celery_lease: worker not started: %s: %s", type(exc).__name__,
                         mask_secrets(" ".join(str(exc).split())))
            code = platforms.EX_UNAVAILABLE if isinstance(exc, StoreUnavailable) else platforms.EX_FAILURE
            if isinstance(exc, LeaseConfigError):
                code = getattr(os, "EX_CONFIG", 78)  # as `celery lease` exits; os has none on Windows
            raise SystemExit(code) from exc
        super().__init__(worker, **kwargs)

    def _check(self, worker: Any) -> None:
        from ..reaper.run import register
        from ..store import for_app

        app_config(worker.app)
        # A LeaseTask first bound inside finalize's on_after_finalize, whose receivers Celery has already
        # listed, deferred the reaper task to a signal that never comes: register it before consuming.
        register(worker.app)
        if getattr(worker, "task_events", False):
            # `-E`: the lease's task events go out wherever this worker's events do.
            worker.app.conf.worker_send_task_events = True
        # An unreachable store or a schema of the wrong revision stops the worker first.
        store = for_app(worker.app, check=False)
        store.ensure_schema(create=True)
        check_recovery_bound(worker.app)
        pool = pool_name(worker)
        validate_tasks(worker.app, consumed_queues(worker.app))
        check_pool(worker.app, pool, consumed_queues(worker.app))
        store.workers.worker_pool = (pool, int(getattr(worker, "concurrency", 0) or 0))
        runtime.PROCESS.starting = (worker.app, worker.hostname)  # what a forked pool child registers under
        self.pool = pool

    def start(self, worker: Any) -> None:
        """Register the process that runs bodies now (a prefork worker's children register as they start)."""
        if self.pool != "prefork":
            register_process(worker.app, worker.hostname)


def register_process(app: Any, hostname: str) -> None:
    """Start this process's runtime: its heartbeat registers the process and keeps it alive."""
    from ..store import for_app

    try:
        runtime.for_app(app, for_app(app), hostname).start()
    except LeaseError as error:
        # The heartbeat registers the process later; leases do not depend on this row.
        log.warning("worker %s could not register in the lease store yet: %s", hostname, error)


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    starting = runtime.PROCESS.starting
    if starting is not None:
        register_process(*starting)


def consumed_queues(app: Any) -> list[str]:
    """The queues this worker consumes (``-Q``, else the app's queues), set up before the steps."""
    queues = app.amqp.queues
    names = getattr(queues, "consume_from", None) or queues
    return sorted(names)


def routed_queue(app: Any, task: Any) -> str | None:
    """The queue the app's routes (or the task's ``queue`` option) send a task to by default."""
    try:
        route = app.amqp.router.route(dict(task._get_exec_options()), task.name, (), {}, task)
    except Exception:  # noqa: BLE001 - a router that reads a real call's arguments: its own queue
        # A routing function may index the arguments of the publish it routes; none exist at start-up.
        route = {"queue": getattr(task, "queue", None) or app.conf.task_default_queue}
    queue = route.get("queue")
    return getattr(queue, "name", queue)


def validate_tasks(app: Any, queues: list[str]) -> None:
    """Resolve every LeaseTask's policy on its routed queue and each consumed queue, so a bad option stops the
    worker here rather than failing a first publish in a web request."""
    for name, task in sorted(app.tasks.items()):
        if not is_lease_task(task):
            continue
        for queue in dict.fromkeys([routed_queue(app, task), *queues]):
            try:
                task_policy(task, queue)
            except LeaseConfigError as exc:
                where = f", on queue {queue!r}" if queue else ""
                raise LeaseConfigError(exc.setting, exc.value, f"{exc.rule}{where}",
                                       f"Fix task {name}'s lease options or lease_queue_policies; the worker "
                                       "would otherwise fail this task at its first publish") from None


def pool_name(worker: Any) -> str:
    """The worker's pool as Celery names it (prefork, threads, solo, gevent, eventlet)."""
    from celery.concurrency import ALIASES

    pool = getattr(worker, "pool_cls", None) or worker.app.conf.worker_pool or "prefork"
    if not isinstance(pool, str):
        path = f"{pool.__module__}:{pool.__name__}"
        return next((name for name, target in ALIASES.items() if target == path), path)
    return next((name for name, target in ALIASES.items() if target == pool), pool).lower()


def check_pool(app: Any, pool: str, queues: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse ``lease_on_lost='raise'`` where nothing can interrupt a body (eventlet's greenlets), set on a
    task or on a queue this worker consumes (a delivery's policy is its queue's; others never arrive)."""
    if pool != "eventlet":
        return
    for task in list(app.tasks.values()):
        if not hasattr(task, "lease_policy"):
            continue
        raising = [q for q in dict.fromkeys([None, *queues])
                   if task_policy(task, q).on_lost == OnLost.RAISE]
        if raising:
            where = f" on queue {raising[0]!r}" if raising[0] else ""
            raise LeaseConfigError(
                "lease_on_lost", OnLost.RAISE.value,
                f"cannot interrupt a body in the eventlet pool (task {task.name}{where})",
                "Set lease_on_lost='flag' (the body checks self.lease.lost / self.lease.check()) or run "
                "the worker with the prefork, threads or gevent pool.")


def install(app: Any) -> None:
    """Add celery_lease's worker steps to an app (idempotent)."""
    state = app_state(app)
    if state.installed:
        return
    state.installed = True
    from ..reaper.run import register

    register(app)
    app.steps["worker"].add(WorkerStep)
    app.steps["consumer"].add(PauseStep)
    from ..worker.brokers import VisibilityStep

    app.steps["consumer"].add(VisibilityStep)


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    runtime.release_all_in_process(Event.RELEASED_ON_SHUTDOWN)


@signals.task_revoked.connect
def _on_revoked(request: Any = None, terminated: bool = False, expired: bool = False,
                sender: Any = None, **_: Any) -> None:
    """A delivery Celery discarded as revoked or expired cancels the job only while it is pending: it may be a
    late duplicate of a run live elsewhere."""
    task = sender
    if request is None or task is None or terminated or not hasattr(task, "lease_policy"):
        return
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    reason = CancelReason.EXPIRED if expired else CancelReason.REVOKED
    _cancel(task.app, request.id, reason, task_name=task.name, queue=queue)
