"""LeaseTask, the base class, and Lease, the running job's handle: a LeaseTask records its job when published
and runs each delivery through the run lifecycle (lifecycle.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task
from celery._state import _task_stack
from celery.utils import uuid

import celery_lease.messaging.messages as messages
import celery_lease.publish.batching as batching
import celery_lease.publish.publishing as publishing
import celery_lease.publish.replacing as replacing
import celery_lease.worker.lifecycle as lifecycle
import celery_lease.worker.local as local
import celery_lease.worker.runtime as runtime

from ..config import TaskPolicy, app_config, task_policy
from ..kinds import LEASED_BUILTINS, leased
from ..worker.effects import check_key
from ..worker.lease import Lease

__all__ = ["LeaseTask", "Lease", "leased", "LEASED_BUILTINS"]

log = logging.getLogger(__name__)


def _on_commit(call: Callable[[], Any]) -> None:
    try:
        from django.db import transaction
    except ImportError as exc:
        raise ImportError("delay_on_commit and apply_async_on_commit publish when a Django transaction "
                          "commits: pip install django (or call delay / apply_async)") from exc
    transaction.on_commit(call)


class LeaseTask(Task):
    """A Celery task that runs only while its worker holds a lease on the job."""

    #: What kinds.is_lease_task reads: the layers below integration/ tell a LeaseTask by it.
    _celery_lease_task: ClassVar[bool] = True
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

    Request = "celery_lease.integration.signals:LeaseRequest"
    #: Celery's strategy, behind one read that acknowledges a sure duplicate first (strategy.py).
    Strategy = "celery_lease.integration.strategy:lease_strategy"

    #: Whether ``task_track_started`` applies: stored by the lease once its claim succeeded, so a
    #: duplicate delivery of a finished job never turns its state back to STARTED.
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
        batching.install()

    @property
    def lease(self) -> Lease | local.LocalLease | None:
        """The running job's lease, found through the current request (None outside any run); a LeaseTask
        called directly in a leased body (``celery.map`` items) shares it, a run outside a worker gets a
        local handle."""
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

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None, shadow: Any = None,
                    idempotency_key: str | None = None, **options: Any) -> Any:
        """Record the job (once per ``idempotency_key``), then publish it as Celery does."""
        if idempotency_key is not None:
            check_key("idempotency_key", idempotency_key)
        if self.app.conf.task_always_eager and idempotency_key is not None and leased(self) and (
                app_config(self.app).eager_store):
            holder = publishing.record_eager(self, task_id or uuid(), idempotency_key, options)
            if holder[0] is False:
                return self.AsyncResult(holder[1])  # the key's job ran already: not again, as in a worker
            task_id = holder[1]
        if self.app.conf.task_always_eager or messages.recording_disabled() or not leased(self):
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        return publishing.publish(self, super().apply_async, args, kwargs, task_id or uuid(), producer,
                                  link, link_error, shadow, idempotency_key, options)

    # ``base=LeaseTask`` replaces the Django fixup's DjangoTask, so LeaseTask carries its two methods.
    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay()`` once the current Django transaction commits (at once outside one), as DjangoTask."""
        _on_commit(functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async()`` once the current Django transaction commits, ``idempotency_key=`` too."""
        if kwargs.get("idempotency_key") is not None:
            check_key("idempotency_key", kwargs["idempotency_key"])  # now, not after the caller's commit
        _on_commit(functools.partial(self.apply_async, *args, **kwargs))

    def on_replace(self, sig: Any) -> Any:
        """``Task.replace()``: hand the job's id over to the replacement, then let Celery send it."""
        lease = runtime.own_lease(self)
        if lease is None or lease.job_id != self.request.id:
            return super().on_replace(sig)
        if self.request.is_eager:  # Celery applies the replacement here, under this job's id
            return replacing.hand_over_eager(self, lease, sig, super().on_replace)
        return replacing.hand_over(self, lease, sig, super().on_replace)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        runs_leased = self.__dict__.get("_lease_runs_leased")
        if runs_leased is None:  # fixed for the task: its class and name
            runs_leased = self.__dict__["_lease_runs_leased"] = leased(self)
        if not runs_leased:
            return super().__call__(*args, **kwargs)
        if request.is_eager and not request.called_directly and app_config(self.app).eager_store:
            return lifecycle.run(self, args, kwargs)
        if request.called_directly or request.is_eager:
            if self.lease is not None:
                return super().__call__(*args, **kwargs)  # called inside a leased or local run: share it
            # Under apply()'s tracer the body runs under the tracer's request, as a plain task's body does
            # (Celery's own __call__ would push a copy the tracer never reads); a __call__ of a mixin runs.
            call = self.run
            if request.called_directly or getattr(super().__call__, "__func__", None) is not Task.__call__:
                call = super().__call__
            with local.running(self.app, request.id, self.name):
                return call(*args, **kwargs)
        return lifecycle.run(self, args, kwargs)
