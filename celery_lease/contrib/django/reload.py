"""Lease settings that change under a running process (``override_settings``): the cached settings,
policies and store are dropped, so the next use reads them as they are now."""

from __future__ import annotations

from typing import Any

import celery_lease.store as stores

from ...app_state import app_state

__all__ = ["install", "reload", "on_setting_changed"]


def reload(app: Any) -> None:
    """Forget ``app``'s validated lease settings, its tasks' policies and its store."""
    state = app_state(app)
    state.config = state.stale_after = None
    for task in list(app.tasks.values()):
        task.__dict__.pop("_lease_policies", None)
    stores.forget(app)


def on_setting_changed(setting: str = "", **_: Any) -> None:
    """``setting_changed`` receiver: reload the current Celery app when lease settings or DATABASES change."""
    from celery import current_app

    app = current_app._get_current_object()
    namespace = getattr(app, "namespace", None)
    prefix = f"{namespace}_LEASE_" if namespace else "LEASE_"
    if setting == "DATABASES" or setting.upper().startswith(prefix):
        reload(app)


def install() -> None:
    """Connect the receiver (the app does in ready()); connecting twice connects once."""
    from django.core.signals import setting_changed

    setting_changed.connect(on_setting_changed, dispatch_uid=__name__)
