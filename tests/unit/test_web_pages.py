"""celery_lease.web's pages (app, reads, actions) through Flask's test client, on SQLite and PostgreSQL.

The store holds the operations tests' scene (tests/apps/ops_app.py). Read-only pages share one
scene per store kind; the actions get a fresh scene each. The PostgreSQL store's URL carries a
password, and a dead letter's error quotes another URL with one: no page may show either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("flask", reason="celery lease web needs Flask: pip install 'celery-lease[web]'")

from celery_lease.store import for_app  # noqa: E402
from celery_lease.vocabulary import DeadLetterAction, Event  # noqa: E402
from celery_lease.web.app import create_app  # noqa: E402
from tests.apps import ops_app  # noqa: E402
from tests.conftest import SCENE_STORES, require_service, service_url, unique_prefix  # noqa: E402
from tests.helpers import with_password  # noqa: E402

LEAKED = "hunter2"  # the password in a dead letter's error text
ERROR = f"OperationalError: cannot reach postgresql://shop:{LEAKED}@db.internal/shop"


@dataclasses.dataclass
class Scene:
    app: Any
    store: Any
    client: Any
    password: str | None

    def html(self, path: str, status: int = 200) -> str:
        page = self.client.get(path)
        assert page.status_code == status, page.get_data(as_text=True)[:2000]
        return page.get_data(as_text=True)

    def csrf(self) -> str:
        return re.search(r'name="csrf" value="([^"]+)"', self.html("/dead-letters")).group(1)

    def post(self, path: str, **form: Any) -> Any:
        return self.client.post(path, data={"csrf": self.csrf(), **form})

    def events(self, job_id: str) -> list[str]:
        return [e["event"] for e in self.store.reports.list_events(job_id=job_id)]


@contextlib.contextmanager
def scene(kind: str, tmp_path: Any, allow_actions: bool = False, **settings: Any) -> Iterator[Scene]:
    password = None
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    else:
        url, password = with_password(require_service("PostgreSQL", service_url("postgres")))
    app = ops_app.build(url, unique_prefix(), "memory://")
    app.conf.update(settings)
    store = for_app(app, check=False, operator=True)
    store.migrate()
    try:
        ops_app.populate(store)
        ops_app._set(store, "failed-1", last_error=ERROR)
        yield Scene(app, store, create_app(app, store, allow_actions=allow_actions).test_client(), password)
    finally:
        store.drop_schema()
        store.engine.dispose()


@pytest.fixture(scope="module", params=SCENE_STORES)
def ro(request, tmp_path_factory) -> Iterator[Scene]:
    with scene(request.param, tmp_path_factory.mktemp("web")) as s:
        yield s


@pytest.fixture(params=SCENE_STORES)
def rw(request, tmp_path) -> Iterator[Scene]:
    with scene(request.param, tmp_path, allow_actions=True) as s:
        yield s


def rows_of(html: str, table: str) -> list[str]:
    """The text of each body row of the table with id ``table``, tags stripped."""
    body = html.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    body = body.split("<tbody>", 1)[-1]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    return [" ".join(re.sub(r"<[^>]+>", " ", row).split()) for row in rows]


# -- overview --------------------------------------------------------------------------
def test_overview_shows_expired_leases_with_their_stale_owner_and_the_stale_worker(ro):
    html = ro.html("/")

    expired = rows_of(html, "expired")
    assert [r.split()[0] for r in expired] == ["abandoned-2", "abandoned-1", "abandoned-0", "alive-expired"]
    assert all("dead@ops:2 stale" in r for r in expired[:3]) and "alive@ops:1 alive" in expired[3]
    workers = rows_of(html, "workers")
    assert workers[0].startswith("alive@ops:1 alive") and workers[1].startswith("dead@ops:2 stale 1h00m")
    assert 'id="count-running">6<' in html and 'id="count-expired">4<' in html


def test_the_overview_counts_every_running_job_not_only_the_rows_it_reads(ro, monkeypatch):
    reports = type(ro.store.reports)
    bounded = reports.running_rows
    monkeypatch.setattr(reports, "running_rows",
                        lambda self, limit=10_000, by_start=False: bounded(self, min(limit, 1), by_start))
    html = ro.html("/")
    assert 'id="count-running">6<' in html and 'id="count-expired">4<' in html
    assert len(rows_of(html, "expired")) == 1 and 'id="expired-more">and 3 more' in html


def test_the_overview_lists_at_most_fifty_expired_leases(ro, monkeypatch):
    monkeypatch.setattr("celery_lease.web.reads.RUNNING_SHOWN", 2)
    html = ro.html("/")
    assert len(rows_of(html, "expired")) == 2 and 'id="expired-more">and 2 more' in html
    assert 'id="count-expired">4<' in html


def test_overview_counts_jobs_by_queue_and_the_last_hours_recoveries(ro):
    html = ro.html("/")

    assert rows_of(html, "queues") == ["celery 3 4 3 60", "reports 1 2 0 0"]
    last_hour = rows_of(html, "last-hour")
    assert "reaped expired lease 2" in last_hour
    assert "duplicate deliveries skipped 1" in last_hour and "stale writes rejected 1" in last_hour


def test_the_overview_refreshes_from_a_fragment_of_the_same_page(ro):
    page, live = ro.html("/"), ro.html("/overview/live")

    assert 'data-live="/overview/live"' in page
    assert "<html" not in live and 'id="expired"' in live and "data-now=" in live


def test_running_jobs_carry_their_lease_for_the_live_bar(ro):
    html = ro.html("/")
    bars = re.findall(r'class="bar[^"]*" data-expires="([0-9.]+)" data-duration="([0-9.]*)"', html)

    assert len(bars) == 6 and all(float(duration) == 2.0 for _, duration in bars)
    assert html.count('class="bar expired"') == 4


def test_no_page_shows_a_password(ro):
    pages = ["/", "/overview/live", "/jobs", "/jobs?status=failed", "/jobs/failed-1", "/jobs/abandoned-0",
             "/reaper", "/dead-letters", "/jobs/no-such-job"]
    for path in pages:
        html = ro.client.get(path).get_data(as_text=True)
        assert LEAKED not in html, path
        assert ro.password is None or ro.password not in html, path
    assert "postgresql://shop:***@db.internal/shop" in ro.html("/jobs/failed-1")
    if ro.password:
        assert ":***@" in ro.html("/").split('id="store-url"', 1)[1][:200]


# -- jobs ------------------------------------------------------------------------------
def test_jobs_filter_by_status_queue_owner_and_expired_lease(ro):
    def ids(query: str) -> list[str]:
        return sorted(r.split()[0] for r in rows_of(ro.html(f"/jobs?{query}"), "jobs"))

    assert ids("status=running&queue=reports") == ["live-0", "live-1"]
    assert ids("owner=dead@ops:2") == ["abandoned-0", "abandoned-1", "abandoned-2"]
    assert ids("expired=1") == ["abandoned-0", "abandoned-1", "abandoned-2", "alive-expired"]
    assert ids("status=failed&task=ops.fails") == ["failed-0", "failed-1"]
    assert ids("status=pending&since=1h") == ["pending-0", "pending-1", "pending-2", "pending-late"]


def test_a_window_that_is_not_a_duration_is_named_not_guessed(ro):
    html = ro.html("/jobs?since=yesterday")

    assert "&#39;yesterday&#39; is not a duration" in html and rows_of(html, "jobs") == ["no jobs match"]


# -- a job -----------------------------------------------------------------------------
def test_a_jobs_timeline_lists_its_events_in_time_order_with_its_last_heartbeat(ro):
    html = ro.html("/jobs/abandoned-0")
    timeline = html.split('id="timeline"', 1)[1].split("</ol>", 1)[0]
    items = re.findall(r'<li class="(\w+)"><span class="offset">\+([^<]+)</span> '
                       r'<b class="event">([^<]+)</b>', timeline)

    # The first claim wrote no event: the job's row dates it (kind "row").
    assert [(kind, event) for kind, _, event in items] == [
        ("event", "published"), ("row", "claimed"), ("heartbeat", "last heartbeat"),
        ("event", "reaped_expired_lease")]
    assert html.count('class="mark ') == 4
    owners = html.split('id="owners"', 1)[1].split("</ol>", 1)[0]
    assert "dead@ops:2" in owners


def test_a_heartbeat_read_at_the_clock_reading_of_the_claim_and_the_end_sits_between_them():
    from celery_lease.web.reads import timeline

    row = {"worker": "w1", "reason": None, "source": "row"}
    marks = timeline([{"at": 5.0, "event": "claimed", **row}, {"at": 5.0, "event": "completed", **row}],
                     5.0, 5.0, 5.0)
    assert [m["event"] for m in marks] == ["claimed", "last heartbeat", "completed"]


def test_a_job_with_two_owners_lists_both_with_their_markup_intact(rw):
    """Masking is done on values: the text between two values (a time, then the next owner)
    is markup, never taken for a URL's password."""
    store = rw.store
    store.publishes.record("two-owners", "ops.quick", "celery", None, 3)
    store.event("two-owners", Event.CLAIMED, "first claim", "celery@alpha:11")
    store.event("two-owners", Event.LEASE_TAKEN_OVER, "lease expired past grace", "celery@beta:22")
    html = rw.html("/jobs/two-owners")
    owners = html.split('<ol id="owners">', 1)[1].split("</ol>", 1)[0]

    items = re.findall(r'<li>([^<]+) <span class="quiet">(\w+) [0-9: .-]+Z</span></li>', owners)
    assert items == [("celery@alpha:11", "claimed"), ("celery@beta:22", "lease_taken_over")], owners
    assert "***" not in owners


def test_a_jobs_owners_begin_with_the_first_claim_its_row_records(rw):
    ops_app.taken_over_twice(rw.store, "thrice")
    html = rw.html("/jobs/thrice")
    owners = html.split('<ol id="owners">', 1)[1].split("</ol>", 1)[0]

    items = re.findall(r'<li>([^<]+) <span class="quiet">(\w+) [0-9: .-]+Z</span></li>', owners)
    assert items == [("w1", "claimed"), ("w2", "lease_taken_over"), ("w3", "lease_taken_over")], owners
    timeline = html.split('id="timeline"', 1)[1].split("</ol>", 1)[0]
    kinds = re.findall(r'<li class="(\w+)"><span class="offset">[^<]+</span> <b class="event">([^<]+)</b>',
                       timeline)
    assert kinds[0] == ("event", "published") and ("row", "claimed") in kinds
    assert kinds[-1] == ("row", "completed")


def test_a_page_shows_a_secret_in_a_values_url_query_masked(rw):
    secret = "qu3rysecret"
    store = rw.store
    store.publishes.record("query-secret", "ops.quick", "celery", None, 3)
    error = (f"OperationalError: cannot reach postgresql://shop@db.internal/shop?sslmode=require"
             f"&password={secret}&application_name=x")
    ops_app._set(store, "query-secret", last_error=error, status="failed")
    html = rw.html("/jobs/query-secret")

    assert secret not in html
    assert "?sslmode=require&amp;password=***&amp;application_name=x" in html


def test_a_job_page_hides_the_message_arguments_by_default(ro):
    html = ro.html("/jobs/pending-1")
    message = html.split('id="message"', 1)[1].split("</table>", 1)[0]

    assert "ops.quick" in message and 'id="arguments-hidden"' in message
    assert "<th>args</th>" not in message and "<th>kwargs</th>" not in message


def test_the_setting_shows_the_message_arguments(tmp_path):
    with scene("sqlite", tmp_path, lease_web_show_arguments=True) as s:
        message = s.html("/jobs/pending-1").split('id="message"', 1)[1].split("</table>", 1)[0]

    assert "<th>args</th><td><code>[1]</code>" in message and "arguments-hidden" not in message


def test_a_unique_id_prefix_leads_to_the_job_and_an_unknown_id_says_so(ro):
    found = ro.client.get("/jobs/pending-l")
    assert found.status_code == 302 and found.location.endswith("/jobs/pending-late")

    assert "no job &#39;nope&#39; in the lease store" in ro.html("/jobs/nope", status=404)
    assert "matches several jobs" in ro.html("/jobs/live-", status=409)


# -- reaper ----------------------------------------------------------------------------
def test_the_reaper_page_shows_each_decision_of_a_dry_run_with_its_reason(ro):
    html = ro.html("/reaper")

    plan = {r.split()[0]: r for r in rows_of(html, "plan")}
    assert set(plan) == {"abandoned-0", "abandoned-1", "abandoned-2", "alive-expired"}
    assert "requeue lease expired, owner dead@ops:2 gone (lease expired" in plan["abandoned-0"]
    assert "owner last seen 1h00m" in plan["abandoned-0"]
    assert "skip_owner_alive" in plan["alive-expired"]
    assert "waiting for the hard grace" in plan["alive-expired"]
    assert ro.store.get("abandoned-0").status == "running"  # a dry run


# -- dead letters ------------------------------------------------------------------------
def test_dead_letters_list_failures_and_mark_revoked_jobs(ro):
    rows = rows_of(ro.html("/dead-letters"), "dead-letters")

    assert [r.split()[0] for r in rows] == ["failed-0", "failed-1", "revoked-0"]
    assert "revoked" in rows[2].split()[1]


def test_a_read_only_page_refuses_to_plan_or_apply_and_changes_nothing(ro):
    html = ro.html("/dead-letters")
    assert html.count("disabled>Plan a") == 2 and "--allow-actions" in html

    plan = ro.post("/dead-letters/plan", action="redrive", job="failed-0")
    apply = ro.post("/dead-letters/apply", action="redrive", job="failed-0", stamp="0", confirm="yes")

    assert plan.status_code == apply.status_code == 403
    assert "--allow-actions" in plan.get_data(as_text=True)
    assert ro.store.get("failed-0").status == "failed"


def test_a_redrive_shows_its_plan_and_after_confirmation_the_job_is_pending_and_audited(rw):
    plan = rw.post("/dead-letters/plan", action="redrive", job=["failed-0", "done-ops.quick-0"])
    html = plan.get_data(as_text=True)
    assert plan.status_code == 200 and rw.store.get("failed-0").status == "failed"  # only a plan
    assert [r.split()[0] for r in rows_of(html, "plan")] == ["failed-0"]
    assert "done-ops.quick-0 is completed, not a dead letter" in html
    stamp = re.search(r'name="stamp" value="([^"]+)"', html).group(1)

    done = rw.post("/dead-letters/apply", action="redrive", job="failed-0", stamp=stamp, confirm="yes")

    assert done.status_code == 200 and rows_of(done.get_data(as_text=True), "outcomes") == [
        "failed-0 ops.fails celery redriven message re-published"]
    job = rw.store.get("failed-0")
    assert (job.status, job.attempt_count) == ("pending", 0)
    [audit] = rw.store.reports.list_events(job_id="failed-0", event="dlq_redriven")
    assert audit["worker"] == "web:anonymous@127.0.0.1"


def test_without_a_selection_the_plan_is_the_oldest_batch_leaving_revoked_jobs_out(rw):
    html = rw.post("/dead-letters/plan", action="redrive").get_data(as_text=True)

    assert [r.split()[0] for r in rows_of(html, "plan")] == ["failed-0", "failed-1"]


def test_a_job_that_changed_after_the_plan_was_shown_is_skipped(rw):
    done = rw.post("/dead-letters/apply", action="redrive", job="failed-0", stamp="1.0", confirm="yes")

    assert "changed since the plan was shown" in done.get_data(as_text=True)
    assert rw.store.get("failed-0").status == "failed" and "dlq_redriven" not in rw.events("failed-0")


def test_a_confirmed_discard_deletes_the_dead_letter_and_keeps_its_audit(rw):
    html = rw.post("/dead-letters/plan", action="discard", job="failed-1").get_data(as_text=True)
    stamp = re.search(r'name="stamp" value="([^"]+)"', html).group(1)

    done = rw.post("/dead-letters/apply", action="discard", job="failed-1", stamp=stamp, confirm="yes")

    assert done.status_code == 200 and rw.store.get("failed-1") is None
    assert rw.events("failed-1")[-1] == "dlq_discarded"


def test_an_unknown_action_is_refused_naming_the_dead_letter_actions(rw):
    page = rw.post("/dead-letters/plan", action="requeue", job="failed-0")

    assert page.status_code == 400, page.get_data(as_text=True)
    text = page.get_data(as_text=True)
    assert "unknown action" in text and f"one of {', '.join(DeadLetterAction)}" in text
    assert rw.store.get("failed-0").status == "failed"


def test_a_selection_larger_than_a_batch_or_an_unconfirmed_apply_is_refused(rw):
    many = rw.post("/dead-letters/plan", action="redrive", job=[f"job-{i}" for i in range(11)])
    unconfirmed = rw.post("/dead-letters/apply", action="redrive", job="failed-0", stamp="0")
    unknown = rw.post("/dead-letters/plan", action="explode", job="failed-0")

    assert many.status_code == unconfirmed.status_code == unknown.status_code == 400
    assert "select at most 10" in many.get_data(as_text=True)
    assert rw.store.get("failed-0").status == "failed"


# -- the command ---------------------------------------------------------------------------
def test_the_command_refuses_actions_on_an_open_address_without_credentials(tmp_path, monkeypatch):
    from celery.bin.celery import celery
    from click.testing import CliRunner

    monkeypatch.setenv("OPS_STORE", f"sqlite:///{tmp_path / 'lease.sqlite3'}")
    monkeypatch.setenv("OPS_PREFIX", unique_prefix())
    monkeypatch.setenv("OPS_BROKER", "memory://")

    result = CliRunner().invoke(celery, ["-A", "tests.apps.ops_app", "lease", "web", "--allow-actions",
                                         "--bind", "0.0.0.0", "--port", "0"])

    assert result.exit_code != 0
    assert "would let anyone who reaches it change jobs" in result.output
    assert "lease_web_token or lease_web_basic_auth" in result.output
