"""Django's DEBUG error page and error e-mails without the lease store's password.

Django hides settings whose *name* looks secret; ``CELERY_LEASE_STORE_URL`` and a driver's frame
variables (psycopg's conninfo) do not look so, so every value is masked as well.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.views import debug

from ...masking import mask_secrets

__all__ = ["LeaseExceptionReporterFilter", "install"]

DJANGO_FILTER = "django.views.debug.SafeExceptionReporterFilter"
LEASE_FILTER = f"{__name__}.LeaseExceptionReporterFilter"
# Narrower than Django's pattern, which would hide every local named ``key`` or ``token``.
SECRET_NAME = re.compile(r"passw|secret", re.IGNORECASE)


class _Masked:
    """A value shown by its repr with the secrets masked (the page renders a variable's repr)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class LeaseExceptionReporterFilter(debug.SafeExceptionReporterFilter):
    """Django's filter; besides, no URL password, conninfo password or password argument is shown."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str):
            return mask_secrets(cleansed)
        if isinstance(cleansed, (dict, list, tuple, debug.CallableSettingWrapper)):
            return cleansed  # the items were cleansed one by one
        return _masked_repr(cleansed)

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        return [(name, self.cleansed_substitute if SECRET_NAME.search(name) and value is not None
                 else self.cleanse_setting("", value))
                for name, value in super().get_traceback_frame_variables(request, tb_frame)]


def _masked_repr(value: Any) -> Any:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - Django shows its own placeholder for a broken repr
        return value
    masked = mask_secrets(text)
    return value if masked == text else _Masked(masked)


def install() -> None:
    """Make the lease filter Django's default exception reporter filter, unless the project chose one."""
    if settings.DEFAULT_EXCEPTION_REPORTER_FILTER == DJANGO_FILTER:
        settings.DEFAULT_EXCEPTION_REPORTER_FILTER = LEASE_FILTER
        debug.get_default_exception_reporter_filter.cache_clear()
