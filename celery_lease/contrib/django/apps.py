"""The Django app config: registers the lease settings check when Django is ready."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate

__all__ = ["LeaseAppConfig"]


class LeaseAppConfig(AppConfig):
    """celery_lease in ``INSTALLED_APPS``: its system checks, a password-masking error reporter filter,
    lease settings that follow ``override_settings``, and a store that follows Django's migration records."""

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
        # The store follows Django's migration records: after migrate (and a test flush) on its database.
        post_migrate.connect(store_catches_up, sender=self, dispatch_uid=__name__)


def store_catches_up(sender: AppConfig, **kwargs: Any) -> None:
    """``post_migrate`` receiver: schema.catch_up, imported when a migrate runs (it loads alembic)."""
    from .schema import catch_up

    catch_up(sender, **kwargs)
