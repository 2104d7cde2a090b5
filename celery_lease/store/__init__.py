"""Every SQL statement celery_lease runs, spoken of as transitions.

Each transition is one conditional UPDATE (or INSERT) whose row count says
whether it happened, and writes its audit event in the same transaction. Writes
that belong to an owner carry ``WHERE id = :id AND lock_token = :token``: zero
rows means the caller lost the lease. Driver errors leave as StoreUnavailable.
The statements are grouped by who uses them, one module each.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import config
from .base import COMPLETED, FAILED, PENDING, RUNNING, Claim, Job, StoreBase
from .effects import EffectStatements
from .jobs import JobStatements
from .reaping import ReaperStatements
from .reports import ReportStatements
from .runs import RunStatements

__all__ = ["Store", "Claim", "Job", "for_app", "call_timeout", "pool_size",
           "PENDING", "RUNNING", "COMPLETED", "FAILED"]


class Store(JobStatements, ReaperStatements, EffectStatements, ReportStatements, RunStatements, StoreBase):
    """The lease store of one app."""


_lock = threading.Lock()


def call_timeout(app: Any) -> float:
    """The bound of the app's store calls: a share of the shortest lease the app knows now.

    That is the shortest of lease_duration, the queue policies' and the options of the tasks
    registered at this moment (config.CALL_TIMEOUT_SHARE says why the share).
    """
    return config.CALL_TIMEOUT_SHARE * config.shortest_lease(config.app_config(app), app.tasks.values())


def pool_size(app: Any) -> int | None:
    """Pooled connections of a worker process: one per concurrent task, the heartbeat and one spare.

    None (the default size) when the concurrency is not configured.
    """
    concurrency = app.conf.get("worker_concurrency")
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency > 0:
        return concurrency + 2
    return None


def for_app(app: Any, check: bool = True, *, operator: bool = False) -> Store:
    """The app's store (one per app; engines are rebuilt per process).

    ``check``: make sure once that the schema is at a revision this code runs against
    (SchemaMismatch otherwise). Only a worker start creates an empty store.

    ``operator``: this process is an operator's tool (the CLI), whose calls (migrations, scans
    of history) no lease waits on: when it builds the store, every call gets the long bound.
    """
    from ..config import app_config

    store = getattr(app, "_celery_lease_store", None)
    if store is None:
        with _lock:
            store = getattr(app, "_celery_lease_store", None)
            if store is None:
                bound = config.LONG_CALL_TIMEOUT if operator else call_timeout(app)
                store = Store.from_config(app_config(app), call_timeout=bound, pool_size=pool_size(app))
                app._celery_lease_store = store
    if check:
        store.ensure_schema()
    return store
