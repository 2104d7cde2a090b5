"""The lease store's admin pages, driven with Django's test client under Django's own runner.

tests/integration/test_django_admin.py runs these cases in a child process (admin_settings.py)
on SQLite, PostgreSQL and MariaDB, the store following ``CELERY_LEASE_DATABASE = "default"`` with
a table prefix of its own. ``TransactionTestCase``: the store commits on connections of its own,
and the pages must see what it committed (SQLite would also lock the store out of a test's open
transaction). Each case starts from an empty store.
"""

import re
import uuid

from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import TransactionTestCase, override_settings
from django.test.utils import CaptureQueriesContext

from celery_lease.contrib.django.admin.apps import NO_DATABASE, check_admin_setup
from celery_lease.contrib.django.admin.models import Job
from celery_lease.contrib.django.admin.paging import BoundedPaginator
from celery_lease.store import ClaimTerms, for_app, migrating

from . import app
from .tasks import charge

TERMS = ClaimTerms(duration=30.0, grace=1.0, max_attempts=5, max_expirations=5, takeover=False)
JOBS = "/admin/celery_lease_admin/job/"
DEAD_LETTERS = "/admin/celery_lease_admin/deadletter/"
RUNNING = "/admin/celery_lease_admin/runninglease/"
EVENTS = "/admin/celery_lease_admin/event/"


class AdminCase(TransactionTestCase):
    databases = {"default"}

    def setUp(self):
        self.store = for_app(app)
        self.admin = User.objects.create_superuser("alice", "alice@example.com", "pw")
        self.client.force_login(self.admin)

    def tearDown(self):
        current = for_app(app)
        migrating.clear(current)
        if current is not self.store:  # a case's override_settings made the app build another
            self.store.dispose()  # a test database with open sessions cannot be dropped

    def published(self, key=None):
        """A pending job, recorded by a real publish (its message goes to the memory broker)."""
        return charge.apply_async((uuid.uuid4().hex,), idempotency_key=key).id

    def running(self, key=None):
        job_id = self.published(key)
        token = uuid.uuid4().hex
        assert self.store.jobs.claim(job_id, "worker-1", token, TERMS, charge.name, "celery",
                                     lambda: None).claimed
        return job_id, token

    def dead_letter(self, key=None):
        job_id, token = self.running(key)
        assert self.store.jobs.fail(job_id, token, "ValueError: card declined")
        return job_id

    def events(self, job_id, name):
        with self.store.begin() as conn:
            t = self.store.t.events
            return [dict(r._mapping) for r in conn.execute(
                t.select().where(t.c.job_id == job_id, t.c.event == name))]

    def act(self, url, action, *job_ids, confirm=True, plan=None):
        """Post the action; to confirm it, post the confirmation its plan page (``plan``, or one asked for
        now) holds, as a browser would."""
        form = {"action": action, "_selected_action": list(job_ids), "index": 0}
        if not confirm:
            return self.client.post(url, form, follow=True)
        plan = plan if plan is not None else self.client.post(url, form, follow=True).content.decode()
        form.update(post="yes", confirm="yes", stamp=re.findall(r'name="stamp" value="([^"]*)"', plan))
        return self.client.post(url, form, follow=True)


class TheLists(AdminCase):

    def test_the_models_read_the_tables_of_the_configured_prefix(self):
        prefix = app.conf.lease_table_prefix
        assert prefix != "celery_lease_"
        assert Job._meta.db_table == f"{prefix}jobs" == self.store.t.jobs.name

    def test_the_job_list_filters_by_status_queue_and_task_and_searches_by_id_and_key(self):
        first, second = self.published("order-1"), self.dead_letter("order-2")
        page = self.client.get(JOBS).content.decode()
        assert first in page and second in page
        for link in ("?status__exact=failed", "?queue_name=celery", f"?task_name={charge.name}"):
            assert link in page, link
        failed = self.client.get(JOBS, {"status__exact": "failed"}).content.decode()
        assert second in failed and first not in failed
        by_key = self.client.get(JOBS, {"q": "order-1"}).content.decode()
        assert first in by_key and second not in by_key
        by_id = self.client.get(JOBS, {"q": second}).content.decode()
        assert second in by_id and first not in by_id

    def test_no_list_counts_a_whole_table(self):
        for _ in range(3):
            self.dead_letter()
        self.running()
        with CaptureQueriesContext(connections["default"]) as queries:
            for url in (JOBS, DEAD_LETTERS, RUNNING, EVENTS, f"{JOBS}?status__exact=failed"):
                assert self.client.get(url).status_code == 200, url
        counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
        assert counts, "no bounded count was run"
        for sql in counts:
            assert re.search(r"\bLIMIT\b", sql, re.IGNORECASE), sql

    def test_past_the_count_limit_the_list_says_more_than_and_stops_counting(self):
        for _ in range(3):
            self.published()
        limit, BoundedPaginator.limit = BoundedPaginator.limit, 2
        try:
            page = self.client.get(JOBS).content.decode()
        finally:
            BoundedPaginator.limit = limit
        assert "more than 2 jobs" in page

    def test_running_leases_show_their_owner_and_expiry_on_the_stores_clock(self):
        job_id, _ = self.running()
        pending = self.published()  # not a running lease
        page = self.client.get(RUNNING).content.decode()
        assert job_id in page and "worker-1" in page and "expires in" in page.lower()
        assert re.search(r">(2\d|30)\.\ds<", page), page  # a 30 s lease, just claimed
        assert pending not in page

    def test_a_jobs_page_shows_its_events(self):
        job_id = self.dead_letter()
        page = self.client.get(f"{JOBS}{job_id}/change/").content.decode()
        assert "ValueError: card declined" in page and "failed" in page


class TheActions(AdminCase):

    def test_redrive_sends_a_dead_letter_back_to_pending_audited_with_the_admin_user(self):
        job_id = self.dead_letter()
        plan = self.act(DEAD_LETTERS, "redrive", job_id, confirm=False).content.decode()
        assert "Redrive dead letters?" in plan and job_id in plan
        assert self.store.get(job_id).status == "failed"  # nothing moved before the confirmation
        self.act(DEAD_LETTERS, "redrive", job_id)
        job = self.store.get(job_id)
        assert (job.status, job.attempt_count) == ("pending", 0)
        [event] = self.events(job_id, "dlq_redriven")
        assert event["worker"] == "admin:alice@127.0.0.1"

    def test_a_dead_letter_changed_since_its_plan_was_shown_is_skipped_not_moved(self):
        job_id = self.dead_letter()
        plan = self.act(DEAD_LETTERS, "discard", job_id, confirm=False).content.decode()
        # Meanwhile someone redrives it and it fails again: the plan no longer describes it.
        self.act(DEAD_LETTERS, "redrive", job_id)
        token = uuid.uuid4().hex
        assert self.store.jobs.claim(job_id, "worker-2", token, TERMS, charge.name, "celery",
                                     lambda: None).claimed
        assert self.store.jobs.fail(job_id, token, "ValueError: card declined again")
        page = self.act(DEAD_LETTERS, "discard", job_id, plan=plan).content.decode()
        assert "changed since the plan was shown" in page
        job = self.store.get(job_id)
        assert (job.status, job.last_error) == ("failed", "ValueError: card declined again")
        assert self.events(job_id, "dlq_discarded") == []
        self.act(DEAD_LETTERS, "discard", job_id)  # planned again, the move goes ahead
        assert self.store.get(job_id) is None

    def test_discard_deletes_a_dead_letter_audited_with_the_admin_user(self):
        job_id = self.dead_letter()
        self.act(DEAD_LETTERS, "discard", job_id)
        assert self.store.get(job_id) is None
        [event] = self.events(job_id, "dlq_discarded")
        assert event["worker"] == "admin:alice@127.0.0.1"

    def test_a_running_job_with_a_live_lease_is_refused_as_the_cli_refuses_it(self):
        job_id, token = self.running()
        plan = self.act(JOBS, "redrive", job_id, confirm=False).content.decode()
        assert f"job {job_id} is running, not a dead letter" in plan
        page = self.act(JOBS, "discard", job_id).content.decode()
        assert "Refused: job" in page
        job = self.store.get(job_id)
        assert (job.status, job.lock_token) == ("running", token)
        assert self.events(job_id, "dlq_discarded") == []

    def test_a_staff_user_without_the_permissions_sees_the_lists_but_cannot_redrive_or_discard(self):
        job_id = self.dead_letter()
        bob = User.objects.create_user("bob", password="pw", is_staff=True)
        bob.user_permissions.add(*Permission.objects.filter(content_type__app_label="celery_lease_admin",
                                                            codename__startswith="view_"))
        self.client.force_login(bob)
        page = self.client.get(DEAD_LETTERS).content.decode()
        assert job_id in page and 'value="redrive"' not in page and 'value="discard"' not in page
        for action in ("redrive", "discard"):
            self.act(DEAD_LETTERS, action, job_id)
        assert self.store.get(job_id).status == "failed"
        assert self.events(job_id, "dlq_redriven") == self.events(job_id, "dlq_discarded") == []
        bob.user_permissions.add(Permission.objects.get(codename="redrive_deadletter"))
        bob = User.objects.get(pk=bob.pk)  # permissions are cached on the user object
        self.client.force_login(bob)
        page = self.client.get(DEAD_LETTERS).content.decode()
        assert 'value="redrive"' in page and 'value="discard"' not in page

    def test_the_pages_are_read_only(self):
        job_id = self.dead_letter()
        assert self.client.get(f"{JOBS}add/").status_code == 403
        assert self.client.post(f"{JOBS}{job_id}/delete/").status_code == 403
        page = self.client.get(JOBS).content.decode()
        assert 'value="delete_selected"' not in page


class TheSetupCheck(AdminCase):

    def test_the_check_asks_for_the_store_on_a_django_database(self):
        assert check_admin_setup() == []
        with override_settings(CELERY_LEASE_DATABASE=None, CELERY_LEASE_STORE_URL="sqlite:///elsewhere.db"):
            assert [e.id for e in check_admin_setup()] == [NO_DATABASE]
