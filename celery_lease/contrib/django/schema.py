"""The store's schema revisions as Django migrations: ``manage.py migrate`` creates and upgrades the store.

Alembic's version table stays the truth. Each migration of this app names one store revision
(celery_lease/store/migrations/versions) and runs it, through the store's own migration code
(store/migrating.py) on the store's own connections, on the database ``CELERY_LEASE_DATABASE``
names; on any other database, or with the store on ``CELERY_LEASE_STORE_URL``, it does nothing
(``celery lease migrate`` migrates such a store). Going back runs the previous revision; going
back past the first drops the store's tables.
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
    """Bring the lease store to ``revision`` (forwards), or to the revision before it (backwards)."""

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
                migrating.migrate(store, self.revision)
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
