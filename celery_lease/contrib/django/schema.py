"""The store's schema revisions as Django migrations: ``manage.py migrate`` creates and upgrades the store.

Alembic's version table stays the truth: a forwards step only upgrades (a store a worker start or `lease
migrate` already brought further is left there), only a backwards step downgrades. On a database other
than ``CELERY_LEASE_DATABASE``'s a migration does nothing, yet Django records it: after each ``migrate``
(and each flush) on the store's database, ``catch_up`` brings the store forwards to the revision Django
has recorded there, or to the newest where this app's migrations are off (``TEST: {"MIGRATE": False}``,
pytest-django's ``--nomigrations``).
"""

from __future__ import annotations

from typing import Any

from django.db import connections, migrations
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

import celery_lease.store.migrating as migrating
import celery_lease.store.migrations as revisions

__all__ = ["RunStoreRevision", "catch_up"]


def _lease_store(alias: str) -> Any:
    """The current Celery app's store when it follows Django database ``alias``; None otherwise."""
    from celery import current_app

    from ...config import app_config
    from ...store import for_app

    app = current_app._get_current_object()
    if app_config(app).database != alias:
        return None
    return for_app(app, check=False, operator=True)


class RunStoreRevision(migrations.RunPython):
    """Bring the lease store up to ``revision`` (forwards: never down), or to the revision before it
    (backwards)."""

    reduces_to_sql = False

    def __init__(self, revision: str) -> None:
        self.revision = revision
        super().__init__(self._forwards, self._backwards, hints={"celery_lease_revision": revision})

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return f"{__name__}.{type(self).__name__}", [self.revision], {}

    def describe(self) -> str:
        return f"Bring the lease store to revision {self.revision}"

    def _forwards(self, apps: Any, schema_editor: Any) -> None:
        store = _lease_store(schema_editor.connection.alias)
        if store is not None:
            try:
                migrating.migrate(store, self.revision, downgrade=False)
            finally:
                store.dispose()  # a test database is cloned (or dropped) next: no session may stay

    def _backwards(self, apps: Any, schema_editor: Any) -> None:
        store = _lease_store(schema_editor.connection.alias)
        if store is None:
            return
        order = revisions.revisions()
        position = order.index(self.revision)
        try:
            if position == 0:
                migrating.drop(store)
            else:
                migrating.migrate(store, order[position - 1])
        finally:
            store.dispose()


def catch_up(sender: Any, using: str, plan: Any = None, **_: Any) -> None:
    """``post_migrate`` of this app (``sender``) on Django database ``using``: forwards only, to the newest
    revision Django recorded there; one version read for a store already at the newest. Nothing after a plan
    that took this app's migrations back (``migrate celery_lease zero`` leaves no store)."""
    if any(backwards and migration.app_label == sender.label for migration, backwards in plan or ()):
        return
    store = _own_store(using)
    if store is None:
        return
    try:
        if migrating.describe(store)[0] != revisions.head():
            target = _recorded_revision(sender.label, using)
            if target is not None:
                migrating.migrate(store, target, downgrade=False)
    finally:
        store.dispose()


def _own_store(alias: str) -> Any:
    """A store of its own on Django database ``alias`` when the current app's store follows it; None
    otherwise. Not the app's: disposing that after each flush would pull its engine from under a worker
    running in this process."""
    from celery import current_app

    from ...config import LONG_CALL_TIMEOUT, app_config
    from ...store import Store, database_url

    cfg = app_config(current_app._get_current_object())
    if cfg.database != alias:
        return None
    return Store.from_config(cfg, call_timeout=LONG_CALL_TIMEOUT, url=database_url(cfg))


def _recorded_revision(label: str, alias: str) -> str | None:
    """The newest store revision whose migration Django recorded as applied on ``alias``; the newest of all
    where the app's migrations are off (Django then makes every app's tables as they are now)."""
    if MigrationLoader.migrations_module(label)[0] is None:
        return revisions.head()
    order = revisions.revisions()
    recorded = MigrationRecorder(connections[alias]).applied_migrations()
    applied = [name.split("_", 1)[0] for app, name in recorded if app == label]
    known = [revision for revision in applied if revision in order]
    return max(known, key=order.index) if known else None
