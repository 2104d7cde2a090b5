"""The result-backend calls celery_lease makes itself (not Celery's tracer), through :func:`of`, so that
``lease_fault_injector`` can fail them in tests."""

from __future__ import annotations

from typing import Any

from kombu.utils.imports import symbol_by_name

from ..config import app_config

__all__ = ["of", "VERBS", "Injected"]

#: The backend methods the library calls (the verbs of the fault matrix).
VERBS = ("store_result", "get_state", "mark_as_retry", "mark_as_failure")


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
