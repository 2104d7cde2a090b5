"""Celery's own pytest fixtures (celery_app, celery_worker) run LeaseTasks under this configuration.

pytest-celery's Docker plugin is off (setup.cfg), so these are celery.contrib.pytest's
in-process fixtures: a user's existing Celery test suite keeps working with LeaseTask.
"""

from __future__ import annotations

import pytest

from celery_lease import LeaseTask
from celery_lease.store import for_app
from tests.conftest import drop_app_store, migrated_store, unique_prefix

pytestmark = pytest.mark.integration


@pytest.fixture
def celery_config(redis_url, postgres_url):
    broker = redis_url.rsplit("/", 1)[0] + "/13"
    return {
        "broker_url": broker, "result_backend": broker, "lease_store_url": postgres_url,
        "lease_table_prefix": unique_prefix(), "lease_duration": 1.5, "lease_heartbeat_interval": 0.2,
        "worker_hijack_root_logger": False,
        # redis-py deprecates the SETEX Celery's backend uses for expiring results.
        "result_expires": None,
    }


@pytest.fixture
def celery_worker_parameters():
    return {"perform_ping_check": False}


def test_the_in_process_celery_worker_fixture_runs_a_lease_task(celery_app, celery_worker):
    @celery_app.task(base=LeaseTask, bind=True, shared=False, name="fixtures.double")
    def double(self, x):
        return {"value": x * 2, "attempt": self.lease.attempt}

    celery_worker.reload()
    migrated_store(celery_app)  # publishing never creates the store's tables
    result = double.delay(21)
    assert result.get(timeout=15) == {"value": 42, "attempt": 1}
    store = for_app(celery_app)
    try:
        job = store.get(result.id)
        assert job.status == "completed" and job.attempt_count == 1
    finally:
        drop_app_store(celery_app)
