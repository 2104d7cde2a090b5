"""The Django app config: registers the lease settings check when Django is ready."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["LeaseAppConfig"]


class LeaseAppConfig(AppConfig):
    """celery_lease in ``INSTALLED_APPS``: its system checks, a password-masking error reporter filter,
    and lease settings that follow ``override_settings``."""

    name = "celery_lease.contrib.django"
    label = "celery_lease"
    verbose_name = "Celery leases"

    def ready(self) -> None:
        from django.core import checks

        import celery_lease.contrib.django.reload as reload
        import celery_lease.contrib.django.reporting as reporting

        from .checks import check_lease_settings

        checks.register(check_lease_settings, "celery_lease")
        reporting.install()  # the DEBUG page and error mails mask the store's password
        reload.install()  # override_settings of a CELERY_LEASE_* setting or DATABASES reaches the store
