"""Which tasks are leased: the LeaseTask marker, read without importing integration/task.py above it."""

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
    """Whether runs of ``task`` take a lease: LeaseTasks, except Celery's own plumbing (chord_unlock,
    backend_cleanup...), where a lease would only add rows and races."""
    name = getattr(task, "name", None) or ""
    kind = task if isinstance(task, type) else type(task)
    return is_lease_task(kind) and (not name.startswith("celery.") or name in LEASED_BUILTINS)
