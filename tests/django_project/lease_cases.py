"""Django test cases run by Django's own runner (``django-admin test``) in a child process.

tests/unit/test_django_testing.py runs them with ``LeaseTestRunner`` on SQLite and
PostgreSQL; each case prints nothing and asserts what a project's test would see.
"""

from celery import states
from django.db import connections
from django.test import TestCase, override_settings

from celery_lease.store import for_app

from . import app
from .tasks import charge


class OnTheTestDatabase:
    """Two classes, so that ``--parallel 2`` runs each in a worker of its own, on its own clone."""

    def test_the_store_is_this_process_test_database(self):
        name = str(connections["default"].settings_dict["NAME"])
        assert name.startswith(("test_", "file:memorydb_")), name
        url = for_app(app).url  # the clone has the store's tables: migrate made them before cloning
        assert url.endswith(f"/{name}") or f"/{name.split('?')[0]}?" in url, (name, url)


class EagerLeasesOnTheTestDatabase(OnTheTestDatabase, TestCase):

    def test_an_eager_run_takes_a_lease_in_the_store_and_its_key_is_first_once(self):
        first = charge.delay("o-1").get()
        again = charge.delay("o-1").get()
        job = for_app(app).get(first["job_id"])
        assert job is not None and job.status == "completed", job
        assert (first["first"], again["first"]) == (True, False)

    def test_an_eager_run_leaves_no_started_result(self):
        result = charge.apply(("o-2",))
        assert result.state == states.SUCCESS
        assert app.backend.get_task_meta(result.id)["status"] != states.STARTED



class LeaseSettingsFollowOverrideSettings(OnTheTestDatabase, TestCase):
    def test_a_store_url_beside_the_database_is_a_config_error(self):
        from celery_lease.errors import LeaseConfigError

        with override_settings(CELERY_LEASE_STORE_URL="sqlite:///elsewhere.sqlite3"):
            try:
                charge.delay("o-3").get()
            except LeaseConfigError as exc:
                assert "CELERY_LEASE_STORE_URL" in str(exc)
            else:
                raise AssertionError("no LeaseConfigError")
        assert charge.delay("o-3").get()["first"] is True

    def test_an_idempotency_key_runs_the_eager_job_once_as_a_worker_would(self):
        first = charge.apply_async(("o-4",), idempotency_key="order-4")
        again = charge.apply_async(("o-4",), idempotency_key="order-4")
        assert first.get()["first"] is True
        assert again.id == first.id  # the key's job, not run again
        job = for_app(app).get(first.id)
        assert job is not None and job.status == "completed" and job.idempotency_key == "order-4", job
