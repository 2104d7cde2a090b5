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

import celery_lease.config as config

from ..app_state import app_state
from .audited import AuditedWrites
from .base import StoreEngine
from .effects import EffectStatements
from .glance import DeliveryStatements, Glance
from .group import GroupedJobStatements, GroupedPublishStatements
from .jobs import JobStatements
from .publishes import PublishStatements
from .reaping import Expired, ReaperStatements
from .recovery import RecoveryStatements
from .replacing import ReplaceStatements
from .reports import ReportStatements
from .rows import COMPLETED, FAILED, PENDING, RUNNING, Claim, ClaimTerms, Job, NewJob
from .runs import RunStatements
from .workers import WorkerStatements

__all__ = ["Store", "StoreEngine", "PublishStatements", "JobStatements", "ReplaceStatements",
           "WorkerStatements", "EffectStatements", "DeliveryStatements", "ReaperStatements",
           "RunStatements", "RecoveryStatements", "ReportStatements", "Claim", "ClaimTerms", "Expired",
           "Glance", "Job", "NewJob", "for_app", "database_url", "forget", "call_timeout", "pool_size",
           "PENDING", "RUNNING", "COMPLETED", "FAILED"]


class Store(StoreEngine):
    """The lease store of one app: its engine, and the statements of each role built on it.

    The engine's own calls (transactions, the clock, ``get``, ``event``, the schema) are the
    store's; each group of statements is an attribute, so a caller names the part it uses:
    the worker's ``publishes``, ``jobs``, ``replacing``, ``workers``, ``effects`` and
    ``deliveries``, the reaper's ``reaping`` and ``runs``, the operators' ``reports`` and
    ``recovery``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        audited = AuditedWrites(self)
        self.workers = WorkerStatements(self)
        # lease_group_commit: first claims, completions and publish records due at once share one
        # commit, where the dialect can.
        grouped = self.group_commit and self.dialect.group_commit
        self.publishes = (GroupedPublishStatements if grouped else PublishStatements)(self, audited)
        self.jobs = (GroupedJobStatements if grouped else JobStatements)(self, audited, self.workers)
        self.replacing = ReplaceStatements(self, self.jobs, self.publishes)
        self.effects = EffectStatements(self)
        self.deliveries = DeliveryStatements(self)
        self.reaping = ReaperStatements(self)
        self.runs = RunStatements(self)
        self.recovery = RecoveryStatements(self)
        self.reports = ReportStatements(self)
        self.audited = audited


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

    cfg = app_config(app)
    url = database_url(cfg)
    state = app_state(app)
    store = state.store
    if store is None or (url is not None and store.url != url):
        with _lock:
            store = state.store
            if store is None or (url is not None and store.url != url):
                if store is not None:
                    forget(app)  # lease_database now names another database (a test database)
                bound = config.LONG_CALL_TIMEOUT if operator else call_timeout(app)
                store = Store.from_config(cfg, call_timeout=bound, pool_size=pool_size(app),
                                          stale_after=lambda: config.worker_stale_after(app), url=url)
                state.store = store
    if check:
        store.ensure_schema()
    return store


def database_url(cfg: config.AppConfig) -> str | None:
    """The URL of the Django database lease_database names, as Django configures it now; None unset."""
    if cfg.database is None:
        return None
    from .django_database import store_url

    return store_url(cfg.database)


def forget(app: Any) -> None:
    """Drop the app's store (its connections closed) and its idle runtime: the next use builds them afresh.

    For settings that change under a running process (Django's ``override_settings``, a test
    database): a runtime that still holds a lease keeps its store until that run ends.
    """
    state = app_state(app)
    store = state.take("store")
    # Set by worker.runtime.for_app: the store never imports the worker. With no runtime ever
    # built for the app there is none to retire, and nothing holds the store.
    retire = state.retire
    if (retire is None or retire(app)) and store is not None:
        store.dispose()
