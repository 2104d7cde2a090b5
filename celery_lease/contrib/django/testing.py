"""Eager leases on Django's test database with Django's runner
(``TEST_RUNNER = "celery_lease.contrib.django.testing.LeaseTestRunner"``).

The store commits on connections of its own, so a test database kept by ``--keepdb`` (and its kept
``--parallel`` clones) keeps the last run's store rows: the runner deletes them before the tests run."""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner

import celery_lease.store as stores
import celery_lease.store.migrating as migrating

from ...config import app_config
from ...errors import LeaseConfigError
from ...store.django_database import url_from_settings
from .reload import reload

__all__ = ["LeaseTestRunner", "eager_leases_on_test_database", "clear_kept_stores"]


def current_celery_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def eager_leases_on_test_database(app: Any, aliases: Any = None) -> bool:
    """Have ``app``'s eager runs lease in its store, which must follow a Django database alias; with
    ``aliases`` (those Django set up test databases for), only when the store's alias is one of them: else
    its NAME is still the development database's, and eager runs keep their local lease. Whether it did."""
    reload(app)
    database = app_config(app).database
    if database is None:
        raise LeaseConfigError("lease_database", None,
                               "is not set, so eager leases would go to lease_store_url, not the test "
                               "database",
                               "Set CELERY_LEASE_DATABASE = 'default' (and remove CELERY_LEASE_STORE_URL).")
    if aliases is not None and database not in aliases:
        return False
    app.conf.lease_eager_store = True
    reload(app)
    return True


def clear_kept_stores(app: Any, parallel: int = 0) -> int:
    """Delete the rows of ``app``'s store on the test database and, with ``parallel`` > 1, on each of its
    clones (Django keeps an existing clone under ``--keepdb``); the rows deleted. A previous run's effect
    and idempotency keys would otherwise make this run's first effects and keyed jobs seconds."""
    from django.db import connections

    cfg = app_config(app)
    connection = connections[cfg.database]
    databases = [connection.settings_dict]
    if parallel > 1:
        databases += [connection.creation.get_test_db_clone_settings(str(n)) for n in range(1, parallel + 1)]
    deleted = 0
    for settings_dict in databases:
        store = stores.Store.from_config(cfg, url=url_from_settings(cfg.database, settings_dict))
        try:
            if migrating.describe(store)[1]:  # a clone of an in-memory database is a new, empty one
                deleted += migrating.clear(store)
        finally:
            store.dispose()
    return deleted


class LeaseTestRunner(DiscoverRunner):
    """Django's test runner; eager leases go to the lease store on the test database."""

    def setup_databases(self, **kwargs: Any) -> Any:
        old_config = super().setup_databases(**kwargs)
        app = current_celery_app()
        # Only on a test database: with no case on the store's alias Django set none up, and NAME is still
        # the development database's.
        if eager_leases_on_test_database(app, kwargs.get("aliases")) and self.keepdb:
            clear_kept_stores(app, self.parallel)
        return old_config

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        stores.forget(current_celery_app())  # a database with open sessions cannot be dropped
        super().teardown_databases(old_config, **kwargs)
