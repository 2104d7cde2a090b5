"""Eager leases on Django's test database with Django's runner
(``TEST_RUNNER = "celery_lease.contrib.django.testing.LeaseTestRunner"``)."""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner

import celery_lease.store as stores

from ...config import app_config
from ...errors import LeaseConfigError
from .reload import reload

__all__ = ["LeaseTestRunner", "eager_leases_on_test_database"]


def current_celery_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def eager_leases_on_test_database(app: Any) -> None:
    """Have ``app``'s eager runs lease in its store, which must follow a Django database alias."""
    reload(app)
    if app_config(app).database is None:
        raise LeaseConfigError("lease_database", None,
                               "is not set, so eager leases would go to lease_store_url, not the test "
                               "database",
                               "Set CELERY_LEASE_DATABASE = 'default' (and remove CELERY_LEASE_STORE_URL).")
    app.conf.lease_eager_store = True
    reload(app)


class LeaseTestRunner(DiscoverRunner):
    """Django's test runner; eager leases go to the lease store on the test database."""

    def setup_databases(self, **kwargs: Any) -> Any:
        old_config = super().setup_databases(**kwargs)
        eager_leases_on_test_database(current_celery_app())
        return old_config

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        stores.forget(current_celery_app())  # a database with open sessions cannot be dropped
        super().teardown_databases(old_config, **kwargs)
