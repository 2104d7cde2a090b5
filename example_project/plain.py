"""Plain Celery for the demo's ``--mode plain``: the shop's tasks without celery_lease.

``self.lease`` answers as plain Celery would: nothing is fenced or remembered across
deliveries, so every ``effect`` block runs (its ``first`` is always True), a checkpoint
lives only as long as the process, and ``check``/``extend`` have nothing to check or
extend. ``apply_async`` accepts and ignores ``idempotency_key``: every call publishes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from celery import Task

__all__ = ["PlainTask", "NoLease"]


class NoLease:
    """The stand-in for a lease handle when no lease exists."""

    token = ""
    attempt = 1
    lost = False

    def __init__(self, task: Task) -> None:
        self.job_id = task.request.id
        self.idempotency_key = f"{task.name}:{task.request.id}"
        self.checkpoint_state: Any = None

    def check(self) -> None:
        """Nothing can be lost, so nothing is checked."""

    def extend(self, seconds: float) -> None:
        """No lease to extend."""

    def checkpoint(self, state: Any) -> None:
        self.checkpoint_state = state

    @contextlib.contextmanager
    def effect(self, key: str, connection: Any = None) -> Iterator[bool]:
        yield True


class PlainTask(Task):
    """A plain Celery task with the attributes the shop's tasks read."""

    @property
    def lease(self) -> NoLease:
        request = self.request
        handle = getattr(request, "_no_lease", None)
        if handle is None or handle.job_id != request.id:
            handle = NoLease(self)
            request._no_lease = handle
        return handle

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    producer: Any = None, link: Any = None, link_error: Any = None, shadow: Any = None,
                    idempotency_key: str | None = None, **options: Any) -> Any:
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
