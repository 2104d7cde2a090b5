"""LeaseTask composed with an app's own task class: Django's DjangoTask, or any ``task_cls``.

Celery's Django fixup makes DjangoTask an app's default task class, which ``base=LeaseTask`` alone
would drop: use ``task_cls="celery_lease.django:LeaseDjangoTask"`` (Celery >= 5.4).
"""

from __future__ import annotations

from typing import Any

from .integration.task import LeaseTask
from .worker.effects import connection_for

__all__ = ["LeaseDjangoTask", "lease_task_class", "connection_for"]  # noqa: F822 - LeaseDjangoTask is built on first use


def lease_task_class(base: type[Any], name: str | None = None) -> type[LeaseTask]:
    """A task class that is both LeaseTask and ``base`` (LeaseTask first, so it records and claims)."""
    if issubclass(base, LeaseTask):
        return base
    return type(name or f"Lease{base.__name__}", (LeaseTask, base), {"__module__": base.__module__})


def __getattr__(name: str) -> Any:
    # Built on first use, so importing this module never imports Django.
    if name != "LeaseDjangoTask":
        raise AttributeError(name)
    try:
        from celery.contrib.django.task import DjangoTask
    except ImportError as exc:
        raise ImportError("celery_lease.django.LeaseDjangoTask needs Celery >= 5.4 (which has "
                          "celery.contrib.django.task.DjangoTask) and Django: "
                          "pip install 'celery>=5.4' django") from exc
    cls = lease_task_class(DjangoTask, "LeaseDjangoTask")
    cls.__module__ = __name__
    globals()["LeaseDjangoTask"] = cls
    return cls
