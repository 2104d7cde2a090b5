"""A pytest-django fixture for eager leases on the test database.

The store commits on connections of its own, so a test's rollback does not undo its rows: the
fixture deletes them after each test and closes the connections.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import celery_lease.store as stores
import celery_lease.store.migrating as migrating

from .reload import reload
from .testing import current_celery_app, eager_leases_on_test_database

__all__ = ["lease_store"]


@pytest.fixture
def lease_store(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Any]:
    """The lease store on the test database, eager runs leasing in it; emptied after the test."""
    app = current_celery_app()
    before = app.conf.get("lease_eager_store", None)
    eager_leases_on_test_database(app)
    store = stores.for_app(app)
    try:
        yield store
    finally:
        try:
            migrating.clear(stores.for_app(app, check=False))
        finally:
            if before is None:
                del app.conf["lease_eager_store"]
            else:
                app.conf.lease_eager_store = before
            reload(app)
