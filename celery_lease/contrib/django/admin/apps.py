"""The admin's Django app: binds the models to the store's tables and checks the admin can read them."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error

__all__ = ["LeaseAdminConfig", "check_admin_setup", "NO_DATABASE", "NO_ADMIN"]

NO_DATABASE = "celery_lease_admin.E001"  # the store follows no Django database
NO_ADMIN = "celery_lease_admin.E002"  # django.contrib.admin is not installed


class LeaseAdminConfig(AppConfig):
    """``celery_lease.contrib.django.admin`` in ``INSTALLED_APPS``: the lease store's admin pages."""

    name = "celery_lease.contrib.django.admin"
    label = "celery_lease_admin"
    verbose_name = "Celery leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks
        from django.core.signals import setting_changed

        from .tables import bind, on_setting_changed

        bind()
        setting_changed.connect(on_setting_changed, dispatch_uid=__name__)
        checks.register(check_admin_setup, "celery_lease")


def check_admin_setup(app_configs: Any = None, **_: Any) -> list[CheckMessage]:
    """The admin needs django.contrib.admin and the store on a Django database."""
    from django.apps import apps

    from ....errors import LeaseConfigError
    from .tables import store_alias

    found = []
    if not apps.is_installed("django.contrib.admin"):
        found.append(Error("celery_lease.contrib.django.admin needs django.contrib.admin",
                           hint="Add 'django.contrib.admin' to INSTALLED_APPS.", id=NO_ADMIN))
    try:
        alias = store_alias()
    except LeaseConfigError:
        return found  # the lease settings check reports it
    if alias is None:
        found.append(Error("the lease admin reads the store through a Django database, and the store "
                           "follows none (CELERY_LEASE_DATABASE is not set)",
                           hint="Set CELERY_LEASE_DATABASE to the alias of the store's database "
                                "(instead of CELERY_LEASE_STORE_URL).", id=NO_DATABASE))
    return found
