"""``manage.py check`` for the lease settings, validated afresh (not from a process's cache)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error

from ...config import BY_NAME, UNKNOWN, fix_for, load, problems_of, written_as
from ...errors import LeaseConfigError

__all__ = ["check_lease_settings", "UNKNOWN_SETTING", "INVALID_SETTING"]

UNKNOWN_SETTING = "celery_lease.E001"  # a CELERY_LEASE_* name that is no setting (a typo)
INVALID_SETTING = "celery_lease.E002"  # a setting whose value breaks its rule or another's


def check_lease_settings(app_configs: Any = None, **_: Any) -> list[CheckMessage]:
    """One Error per problem of the current Celery app's lease settings; none when they are valid."""
    from celery import current_app

    app = current_app._get_current_object()
    namespace = getattr(app, "namespace", None)
    try:
        load(app.conf, namespace)
    except LeaseConfigError as exc:
        return [Error(str(problem), hint=fix_for(problem), obj=_as_written(problem.setting, namespace),
                      id=UNKNOWN_SETTING if problem.rule == UNKNOWN else INVALID_SETTING)
                for problem in problems_of(exc)]
    return []


def _as_written(setting: str, namespace: str | None) -> str:
    # A known setting is shown as the project spells it; a typo already is.
    return written_as(setting, namespace) if setting in BY_NAME else setting
