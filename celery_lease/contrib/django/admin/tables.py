"""Which database and tables the admin reads: the store's alias and its configured table prefix.

A model's ``db_table`` is fixed before the Celery app's settings are read, so :func:`bind` sets it
once Django is ready (and on ``override_settings``).
"""

from __future__ import annotations

from typing import Any

from ....config import BY_NAME, app_config, load
from ....errors import LeaseConfigError

__all__ = ["bind", "store_alias", "celery_app", "on_setting_changed", "TABLES"]

TABLES = {"Job": "jobs", "DeadLetter": "jobs", "RunningLease": "jobs", "Event": "events"}


def celery_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def _prefix(app: Any) -> str:
    try:
        return str(load(app.conf, getattr(app, "namespace", None)).table_prefix)
    except LeaseConfigError:
        return str(BY_NAME["lease_table_prefix"].default)


def bind(app: Any | None = None) -> str:
    """Point the admin's models at the tables of the configured prefix; return that prefix."""
    from django.apps import apps

    prefix = _prefix(app or celery_app())
    for model in apps.get_app_config("celery_lease_admin").get_models():
        model._meta.db_table = prefix + TABLES[model.__name__]
    return prefix


def store_alias(app: Any | None = None) -> str | None:
    """The Django database alias the store follows (``lease_database``), or None."""
    return app_config(app or celery_app()).database


def on_setting_changed(setting: str = "", **_: Any) -> None:
    """``setting_changed`` receiver: a lease setting changed, the prefix may have too."""
    if "LEASE_" in setting.upper():
        bind()
