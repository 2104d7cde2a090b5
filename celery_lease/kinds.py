"""Which tasks are leased: the LeaseTask marker, read without importing Celery or the task class.

``LeaseTask`` carries ``_celery_lease_task = True``; the worker, the publish path and the signal
handlers ask ``is_lease_task``/``leased`` here instead of importing integration/task.py above them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LEASED_BUILTINS", "is_lease_task", "leased"]

#: Celery's built-ins that run a LeaseTask's items in one body: leased as one job whose lease
#: the items share. Every other ``celery.*`` task is never leased.
LEASED_BUILTINS = frozenset({"celery.map", "celery.starmap", "celery.chunks"})


def is_lease_task(obj: Any) -> bool:
    """Whether ``obj`` (a task class or instance) is a LeaseTask; ``is True`` so a Mock does not pass."""
    return getattr(obj, "_celery_lease_task", False) is True


def leased(task: Any) -> bool:
    """Whether runs of ``task`` take a lease: LeaseTasks, except Celery's own plumbing.

    ``celery.chord_unlock`` retries every second, ``celery.accumulate`` ends a replacement,
    ``celery.backend_cleanup`` is periodic housekeeping: leasing them (an app whose
    ``task_cls`` is LeaseTask makes them LeaseTasks) would only add rows and races.
    """
    name = getattr(task, "name", None) or ""
    kind = task if isinstance(task, type) else type(task)
    return is_lease_task(kind) and (not name.startswith("celery.") or name in LEASED_BUILTINS)
