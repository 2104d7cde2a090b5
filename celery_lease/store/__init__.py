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

from .base import COMPLETED, FAILED, PENDING, RUNNING, Claim, Job, StoreBase
from .effects import EffectStatements
from .jobs import JobStatements
from .reaping import ReaperStatements
from .reports import ReportStatements

__all__ = ["Store", "Claim", "Job", "for_app", "PENDING", "RUNNING", "COMPLETED", "FAILED"]


class Store(JobStatements, ReaperStatements, EffectStatements, ReportStatements, StoreBase):
    """The lease store of one app."""



_lock = threading.Lock()


def for_app(app: Any, check: bool = True) -> Store:
    """The app's store (one per app; engines are rebuilt per process).

    ``check``: make sure once that the schema is at a revision this code runs against
    (SchemaMismatch otherwise). Only a worker start creates an empty store.
    """
    from ..config import app_config

    store = getattr(app, "_celery_lease_store", None)
    if store is None:
        with _lock:
            store = getattr(app, "_celery_lease_store", None)
            if store is None:
                cfg = app_config(app)
                store = Store(cfg.store_url, cfg.table_prefix, cfg.sqlite_busy_timeout)
                app._celery_lease_store = store
    if check:
        store.ensure_schema()
    return store
