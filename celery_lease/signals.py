"""Thin hooks into the worker: start-up checks, lost children, revokes and shutdown.

Each hook delegates to one function; a failure in one is logged and contained,
except at start-up, where a bad setting must stop the worker.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from . import heartbeat
from .config import app_config, task_policy
from .errors import LeaseConfigError, LeaseError
from .vocabulary import Event

__all__ = ["LeaseRequest", "WorkerStep", "install"]

log = logging.getLogger(__name__)


class LeaseRequest(Request):
    """A request whose main-process failure handler frees the lease of a dead child."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded)) and self.worker_pid:
            owner = heartbeat.worker_id(self.hostname, self.worker_pid)
            try:
                from .reaper import recover_worker_lost

                recover_worker_lost(self.task.app, self.id, owner, type(exc).__name__)
            except LeaseError as error:
                log.warning("job %s: could not release the lease of dead child %s: %s",
                            self.id, owner, error)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


class WorkerStep(bootsteps.StartStopStep):
    """At worker start: validate the lease settings, every LeaseTask's options on every queue it
    may run on, and check the store's schema (fail fast).

    An empty store is created at the newest revision; an older schema is refused, never
    upgraded behind the operator's back.
    """

    label = "celery_lease"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        from .store import for_app

        app_config(worker.app)
        validate_tasks(worker.app, consumed_queues(worker.app))
        store = for_app(worker.app, check=False)
        store.ensure_schema(create=True)
        store.worker_pool = (pool_name(worker.pool_cls), int(worker.concurrency or 0))
        super().__init__(worker, **kwargs)


def consumed_queues(app: Any) -> list[str]:
    """The queues this worker consumes (``-Q``, else the app's queues), set up before the steps."""
    queues = app.amqp.queues
    names = getattr(queues, "consume_from", None) or queues
    return sorted(names)


def routed_queue(app: Any, task: Any) -> str | None:
    """The queue the app's routes (or the task's ``queue`` option) send a task to by default."""
    queue = getattr(task, "queue", None)
    route = app.amqp.router.route({"queue": queue} if queue else {}, task.name)
    queue = route.get("queue")
    return getattr(queue, "name", queue)


def validate_tasks(app: Any, queues: list[str]) -> None:
    """Resolve the lease policy of every registered LeaseTask on its routed queue and on each
    queue this worker consumes: a bad option stops the worker here, naming the task and setting,
    instead of failing the first publish of that task in a web request."""
    from .task import LeaseTask

    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, LeaseTask):
            continue
        for queue in dict.fromkeys([routed_queue(app, task), *queues]):
            try:
                task_policy(task, queue)
            except LeaseConfigError as exc:
                where = f", on queue {queue!r}" if queue else ""
                raise LeaseConfigError(exc.setting, exc.value, f"{exc.rule}{where}",
                                       f"Fix task {name}'s lease options or lease_queue_policies; the worker "
                                       "would otherwise fail this task at its first publish") from None


def pool_name(pool_cls: Any) -> str:
    """Celery's name of a pool class (``prefork``, ``threads``, ``solo``, ``gevent``...)."""
    from celery.concurrency import ALIASES

    if isinstance(pool_cls, str):
        return pool_cls
    path = f"{pool_cls.__module__}:{pool_cls.__name__}"
    return next((name for name, target in ALIASES.items() if target == path), path)


def install(app: Any) -> None:
    """Add celery_lease's worker steps to an app (idempotent)."""
    if getattr(app, "_celery_lease_installed", False):
        return
    app._celery_lease_installed = True
    app.steps["worker"].add(WorkerStep)
    try:
        from .brokers import VisibilityStep
    except ImportError:
        return
    app.steps["consumer"].add(VisibilityStep)


def _release_held(reason: Event) -> None:
    pid = os.getpid()
    for key, hb in list(heartbeat._process.items()):
        if key.endswith(f":{pid}"):
            try:
                released = hb.release_all(reason)
                if released:
                    log.info("released %d lease(s) held by %s on shutdown", released, hb.worker)
            finally:
                hb.stop()


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    _release_held(Event.RELEASED_ON_SHUTDOWN)


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    _release_held(Event.RELEASED_ON_SHUTDOWN)


@signals.task_revoked.connect
def _on_revoked(request: Any = None, terminated: bool = False, expired: bool = False,
                sender: Any = None, **_: Any) -> None:
    task = sender
    if request is None or task is None or not hasattr(task, "lease_policy"):
        return
    from .store import for_app

    reason = "expired" if expired else ("terminated" if terminated else "revoked")
    for_app(task.app).cancel(request.id, reason)
