"""pytest cases run with pytest-django and the lease_store fixture in a child process.

tests/unit/test_django_pytest_plugin.py runs them (``pytest -p celery_lease.contrib.django.pytest_plugin``).
"""

import pytest
from django.db import connections

from tests.django_project import app
from tests.django_project.tasks import charge


@pytest.mark.django_db
@pytest.mark.parametrize("run", [1, 2])
def test_each_test_starts_from_an_empty_store_on_the_test_database(lease_store, run):
    name = str(connections["default"].settings_dict["NAME"])
    assert name.startswith(("test_", "file:memorydb_")) and name.split("?")[0] in lease_store.url
    result = charge.apply_async(("o-1",), idempotency_key="order-1").get()
    assert result["first"] is True  # the previous run's key is gone with its rows
    job = lease_store.get(result["job_id"])
    assert job is not None and job.status == "completed"


def test_without_the_fixture_eager_runs_keep_their_local_handle():
    assert not app.conf.get("lease_eager_store")
