"""The store's schema revisions as Django migrations: ``manage.py migrate`` creates and upgrades the store.

Alembic's version table stays the truth: a forwards step only upgrades (a store a worker start or `lease
migrate` already brought further is left there), only a backwards step downgrades. On a database other
than ``CELERY_LEASE_DATABASE``'s a migration does nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

import celery_lease.store.migrating as migrating
import celery_lease.store.migrations as revisions

__all__ = ["RunStoreRevision"]


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
