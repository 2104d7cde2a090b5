"""The Django app config: registers the lease settings check when Django is ready."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["LeaseAppConfig"]


class LeaseAppConfig(AppConfig):
    """celery_lease in ``INSTALLED_APPS``: its system checks."""

    name = "celery_lease.contrib.django"
    label = "celery_lease"
    verbose_name = "Celery leases"

    def ready(self) -> None:
        from django.core import checks

        from .checks import check_lease_settings

        checks.register(check_lease_settings, "celery_lease")
