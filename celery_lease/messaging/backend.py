"""The result-backend calls celery_lease makes itself (not Celery's tracer), through :func:`of`, so that
``lease_fault_injector`` can fail them in tests."""

from __future__ import annotations

from typing import Any

from celery import states
from kombu.utils.imports import symbol_by_name

from ..config import app_config

__all__ = ["of", "VERBS", "Injected", "post_run_finished"]

#: The backend methods the library calls (the verbs of the fault matrix).
VERBS = ("store_result", "get_state", "mark_as_retry", "mark_as_failure")


def post_run_finished(state: str) -> bool:
    """Whether the backend's state for a job the store has completed shows Celery's post-run work done. A
    FAILURE does not: the body returned, so it is that work failing (Celery 5.7 stores it when the next
    step's publish fails), and plain Celery, with acks_late, runs the delivered copy again."""
    return state in states.READY_STATES and state != states.FAILURE


class Injected:
    """A result backend whose library calls are first shown to a fault injector (which may raise)."""

    def __init__(self, backend: Any, injector: Any) -> None:
        self._backend, self._injector = backend, injector

    def _call(self, verb: str, task_id: str, *args: Any, **kwargs: Any) -> Any:
        self._injector.backend_call(verb, task_id)
        return getattr(self._backend, verb)(task_id, *args, **kwargs)

    def store_result(self, task_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("store_result", task_id, *args, **kwargs)

    def get_state(self, task_id: str) -> Any:
        return self._call("get_state", task_id)

    def mark_as_retry(self, task_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("mark_as_retry", task_id, *args, **kwargs)

    def mark_as_failure(self, task_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("mark_as_failure", task_id, *args, **kwargs)


def of(app: Any, backend: Any) -> Any:
    """``backend`` as the library calls it: itself, or wrapped by the app's lease_fault_injector."""
    path = app_config(app).fault_injector
    if path is None:
        return backend
    return Injected(backend, symbol_by_name(path))
