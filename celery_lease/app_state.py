"""What celery_lease keeps on a Celery app in this process: one object, so no module touches another's
private attributes on the app. Fields hold higher layers' objects (``Any``); comments name the type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["AppState", "app_state"]

_KEY = "_celery_lease"  # the one attribute celery_lease sets on an app


@dataclasses.dataclass
class AppState:
    """celery_lease's state for one app in this process; a field at None is made on next use."""

    #: config.AppConfig: the validated ``lease_*`` settings (config.app_config()).
    config: Any = None
    #: (tasks registered, seconds): the derived lease_worker_stale_after (config.worker_stale_after()).
    stale_after: tuple[int, float] | None = None
    #: store.Store: the lease store (store.for_app(); store.forget() drops it).
    store: Any = None
    #: worker.runtime.retire: lets store.forget() stop an idle runtime without importing the worker.
    retire: Callable[[Any], bool] | None = None
    #: worker.local.LocalState: the effect keys, checkpoints and locks of runs outside a worker.
    local: Any = None
    #: reaper.clock_guard.ClockGuard: the reapers' guard against a store clock gone wrong.
    clock_guard: Any = None
    #: Whether integration.signals.install() added the worker steps.
    installed: bool = False
    #: Whether the CLI imported the app's task modules (cli.base).
    modules_loaded: bool = False
    #: Test seam of the reaper: called with the job id after its message is published, before the CAS.
    after_publish: Callable[[str], None] | None = None

    def take(self, name: str) -> Any:
        """Clear field ``name`` and return what it held, atomically: no value another thread sets is lost."""
        return self.__dict__.pop(name, None)


def app_state(app: Any) -> AppState:
    """The app's state in this process, made on first use (atomically: one per app)."""
    state: AppState | None = getattr(app, _KEY, None)
    if state is None:
        state = app.__dict__.setdefault(_KEY, AppState())
    return state
