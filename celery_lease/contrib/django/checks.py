"""``manage.py check`` for the lease settings, validated afresh (not from a process's cache)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error

from ...config import BY_NAME, UNKNOWN, fix_for, load, problems_of, written_as
from ...errors import LeaseConfigError
from ...store import database_url

__all__ = ["check_lease_settings", "UNKNOWN_SETTING", "INVALID_SETTING", "UNUSABLE_DATABASE"]

UNKNOWN_SETTING = "celery_lease.E001"  # a CELERY_LEASE_* name that is no setting (a typo)
INVALID_SETTING = "celery_lease.E002"  # a setting whose value breaks its rule or another's
UNUSABLE_DATABASE = "celery_lease.E003"  # CELERY_LEASE_DATABASE names a database the store cannot open


def check_lease_settings(app_configs: Any = None, **_: Any) -> list[CheckMessage]:
    """One Error per problem of the current Celery app's lease settings; none when they are valid."""
    from celery import current_app

    app = current_app._get_current_object()
    namespace = getattr(app, "namespace", None)
    try:
        cfg = load(app.conf, namespace)
    except LeaseConfigError as exc:
        return [Error(str(problem), hint=fix_for(problem), obj=_as_written(problem.setting, namespace),
                      id=UNKNOWN_SETTING if problem.rule == UNKNOWN else INVALID_SETTING)
                for problem in problems_of(exc)]
    try:
        # The alias's settings as Django has them now: under the test runner, which checks once its test
        # databases exist, the test database (a shared in-memory one for an in-memory SQLite database).
        database_url(cfg)
    except LeaseConfigError as exc:
        setting = _as_written("lease_database", namespace)
        return [Error(str(exc), obj=setting, id=UNUSABLE_DATABASE,
                      hint=f"point {setting} at a PostgreSQL, MySQL/MariaDB or SQLite-file entry of "
                           "settings.DATABASES that the store can open, or put the store on "
                           f"{_as_written('lease_store_url', namespace)} instead")]
    return []


def _as_written(setting: str, namespace: str | None) -> str:
    # A known setting is shown as the project spells it; a typo already is.
    return written_as(setting, namespace) if setting in BY_NAME else setting
